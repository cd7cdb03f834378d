"""The jitted step updates the donated KV pool in place: no copy of the pool in the compiled HLO."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
from jaxpaged.engine.step_inputs import bucket, build_step_inputs
from jaxpaged.models.tiny import tiny_checkpoint_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # check_step_hlo's HLO reading
from hlo_report import entry_param_readers, pool_hlo_report  # noqa: E402


def test_step_hlo_aliases_pool_and_never_copies_it():
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=64))
    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
    engine.add_request([9, 8, 7], SamplingParams(max_tokens=4))
    inputs = build_step_inputs(engine.scheduler.schedule(), engine.kv.tables, 8)
    hlo = engine.runner.lower_text(params.state, engine.kv_pool, inputs)
    # One pool array, aliased; never copied; no part of it sliced out (attention and the write index it).
    # On a GPU the other alias is the tokens written into the donated spare buffer (runner.step).
    aliases = 1 + engine.runner.donate_spare_tokens
    assert pool_hlo_report(hlo, engine.kv_pool.shape) == dict(aliased=1, aliases=aliases, copies=0, slices=0)


def test_step_inputs_are_read_once():
    """``transfer.to_step_memory``: the packed inputs and the previous tokens (fresh buffers every
    step) are each read by one copy, so XLA's CUDA graph needs no per-launch patching of the many
    kernels that read slot mappings, block tables and lengths."""
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=64))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    inputs = build_step_inputs(engine.scheduler.schedule(), engine.kv.tables, 8)
    hlo = engine.runner.lower_text(params.state, engine.kv_pool, inputs)
    num_leaves = len(jax.tree.leaves(params.state))
    packed, prev = num_leaves + 1, num_leaves + 2  # (leaves..., pool, packed, prev_tokens, spare_tokens)
    assert entry_param_readers(hlo, [packed, prev]) == {packed: 1, prev: 1}


def test_tokens_are_written_into_a_recycled_buffer():
    """Every step's tokens go into the donated buffer of an output the engine has read back (two
    steps before; the engine's two spare buffers at first, and again after it idled between requests),
    never into a fresh allocation and never into the buffer the step reads its placeholders from: a
    fresh 1 KB output each step moved XLA's temporary buffer, and with it every node of the step's CUDA
    graph. Outputs are the same with and without async scheduling."""
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    waves = [[[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]], [[2, 7, 1, 8]]]
    want = None
    for async_scheduling in (True, False):
        engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=64,
                                                async_scheduling=async_scheduling, compilation_cache=False))
        first_spares = list(engine._free_tokens)
        calls = []  # (prev_tokens, spare_tokens, output) per step

        def spy(state, kv_pool, inputs, prev_tokens=None, spare_tokens=None, step=engine.runner.step):
            tokens, pool = step(state, kv_pool, inputs, prev_tokens, spare_tokens)
            calls.append((prev_tokens, spare_tokens, tokens))
            return tokens, pool

        engine.runner.step = spy  # (the runner is shared by engines over these weights: put back below)
        outs = {}
        try:
            for wave in waves:  # the engine idles (steps that schedule nothing) between the waves
                for i, p in enumerate(wave):
                    engine.add_request(p, SamplingParams(max_tokens=5 + i, temperature=0))
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        outs[o.request_id] = o.outputs[0].token_ids
        finally:
            del engine.runner.step
        outputs = [out for _, _, out in calls]
        assert len(calls) > 10 and all(calls[i][1] is first_spares[i] for i in range(2))
        for prev, spare, _ in calls:
            assert spare is not None and spare is not prev
            assert spare.is_deleted() == engine.runner.donate_spare_tokens  # donated (on a GPU)
            assert any(spare is b for b in first_spares + outputs)
        assert len({id(o) for o in outputs}) == len(outputs)
        want = want or outs
        assert outs == want and len(outs) == 4

def test_pool_hlo_report_sees_slices_and_copies():
    """The check above would catch a layer, a [1, N, ...] slice, keys only, or a copy of the pool."""
    pool = jax.numpy.zeros((3, 16, 8, 2, 2, 32))
    probes = {"layer": lambda p: p[1] * 2, "slice_in_dim": lambda p: jax.lax.slice_in_dim(p, 1, 2) * 2,
              "keys": lambda p: p[1:2, :, :, 0:1] * 2}
    for name, fn in probes.items():
        hlo = jax.jit(fn).lower(pool).compile().as_text()
        assert pool_hlo_report(hlo, pool.shape)["slices"] > 0, name
    hlo = jax.jit(lambda p: p.at[0, 0, 0].set(1.0)).lower(pool).compile().as_text()  # not donated: copied
    assert pool_hlo_report(hlo, pool.shape)["copies"] > 0 and pool_hlo_report(hlo, pool.shape)["slices"] == 0


def test_step_inputs_layout():
    """Ragged prefill + decode in one step: slots, lengths and logits indices line up."""
    from jaxpaged.kv import BlockTables
    from jaxpaged.request import Sequence

    tables = BlockTables()
    a = Sequence("a", list(range(10)), SamplingParams())
    a.block_table_row, a.num_computed_tokens = tables.add([5, 2]), 0
    b = Sequence("b", list(range(20)), SamplingParams(temperature=0.5, top_k=3, seed=7))
    b.block_table_row, b.num_computed_tokens = tables.add([1, 4, 6]), 19
    inp = build_step_inputs([(a, 10), (b, 1)], tables, block_size=8)
    assert inp.token_ids.shape == (16,) and inp.meta.cu_q_lens.shape == (9,)
    np.testing.assert_array_equal(inp.meta.cu_q_lens[:3], [0, 10, 11])
    np.testing.assert_array_equal(inp.meta.kv_lens[:2], [10, 20])
    np.testing.assert_array_equal(inp.positions[:11], list(range(10)) + [19])
    expected_slots = [5 * 8 + i for i in range(8)] + [2 * 8, 2 * 8 + 1] + [6 * 8 + 3]
    np.testing.assert_array_equal(inp.meta.slot_mapping[:11], expected_slots)
    assert (inp.meta.slot_mapping[11:] == -1).all()
    np.testing.assert_array_equal(inp.logits_indices[:2], [9, 10])
    assert inp.top_k[1] == 3 and inp.seeds[1] == 7 and inp.temperature[1] == np.float32(0.5)
    assert bucket(1, 16) == 16 and bucket(17, 16) == 32 and bucket(256, 8) == 256


def test_inputs_travel_as_one_buffer_and_the_step_has_no_host_round_trip():
    """13 input arrays pack into one i32 buffer (one host-to-device copy) and unpack bit-exactly; the
    compiled step contains no conditional (XLA reads a cond's predicate back to the host mid-step)."""
    import dataclasses

    from jaxpaged.engine.step_inputs import pack, unpack

    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    engine = LLMEngine(params, EngineConfig(block_size=8, num_blocks=64, max_model_len=64))
    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(temperature=0.7, top_p=0.9, seed=3))
    engine.add_request([9, 8, 7], SamplingParams(temperature=0))
    inputs = build_step_inputs(engine.scheduler.schedule(), engine.kv.tables, 8)
    assert inputs.sampling_mode == "filtered"
    packed, layout = pack(inputs)
    assert packed.dtype == np.int32 and packed.ndim == 1
    back = unpack(packed, layout)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(dataclasses.replace(inputs, packed=None))):
        assert np.asarray(got).dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    hlo = engine.runner.lower_text(params.state, engine.kv_pool, inputs)
    assert " conditional(" not in hlo
    # Loops only with a trip count known at compile time: XLA runs those without reading a predicate
    # back (the step has none since the sampler's noise is a hash rather than threefry's rolled loop).
    assert all("known_trip_count" in line for line in hlo.splitlines() if " while(" in line)


def test_built_inputs_are_their_own_packed_buffer():
    """``build_step_inputs`` lays its arrays out in one buffer in ``StepLayout``'s order, so ``pack``
    returns that buffer without a copy; it equals the generic packing of the same arrays (a copy of the
    inputs without the buffer), for a mixed prefill + decode step with padded tokens and rows."""
    import dataclasses

    from jaxpaged.engine.step_inputs import pack, unpack

    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    engine = LLMEngine(params, EngineConfig(block_size=8, num_blocks=64, max_model_len=64, max_num_seqs=4,
                                            compilation_cache=False))
    engine.add_request(list(range(1, 12)), SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=4))
    engine.step()  # the first request decodes from here on
    engine.add_request([9, 8, 7], SamplingParams(temperature=0, max_tokens=4))
    scheduled = engine.scheduler.schedule()
    assert sorted(n for _, n in scheduled) == [1, 3]
    for width in (None, 16):
        inputs = build_step_inputs(scheduled, engine.kv.tables, 8, width=width, max_seqs=4, min_tokens=8)
        fast, layout = pack(inputs)
        assert fast is inputs.packed
        slow, slow_layout = pack(dataclasses.replace(inputs, packed=None))
        assert layout == slow_layout and fast.dtype == slow.dtype == np.int32
        np.testing.assert_array_equal(fast, slow)
        assert inputs.meta.slot_mapping.shape == (8,) and inputs.meta.slot_mapping[4:].tolist() == [-1] * 4
        # Every array starts a multiple of 256 bytes into the buffer (Mosaic GPU kernels need aligned operands).
        for name in ("cu_q_lens", "kv_lens", "block_tables", "slot_mapping"):
            view = getattr(inputs.meta, name)
            assert (view.__array_interface__["data"][0] - fast.__array_interface__["data"][0]) % 256 == 0, name
    # A decode step is marked uniform where asked (a compiled variant of its own: its layout says so, and
    # unpacking keeps it); this mixed step never is.
    assert not build_step_inputs(scheduled, engine.kv.tables, 8, uniform_decode=True).uniform_decode
    engine.step()
    decode = engine.scheduler.schedule()
    assert [n for _, n in decode] == [1, 1]
    assert not build_step_inputs(decode, engine.kv.tables, 8).uniform_decode
    inputs = build_step_inputs(decode, engine.kv.tables, 8, max_seqs=4, uniform_decode=True)
    packed, layout = pack(inputs)
    assert inputs.uniform_decode and layout.uniform_decode and unpack(packed, layout).uniform_decode
    # An engine that marks decode steps (Mosaic over bf16 on a GPU) warms up both variants of each bucket
    # a decode step can fill (up to max_num_seqs = 4), one-token steps as decode steps only.
    engine._uniform_decode, engine.min_token_bucket = True, 1
    warmed = [(w.token_ids.shape[0], w.uniform_decode) for w in engine._warmup_steps() if w.sampling_mode == "random"]
    assert warmed[:5] == [(1, True), (2, False), (2, True), (4, False), (4, True)]
    assert warmed[5:] == [(8 << i, False) for i in range(len(warmed) - 5)] and len(warmed) > 5


def test_step_copies_alternate_and_give_the_same_tokens():
    """``StepTuning.step_executables=2``: two jitted copies of a small step are launched in turn (each
    compiled once per shape), and a step's tokens do not depend on which copy ran it."""
    from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
    from jaxpaged.engine.tuning import StepTuning
    from jaxpaged.llm import run_to_completion
    from jaxpaged.models.tiny import tiny_checkpoint_path

    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    outs = {}
    for n in (1, 2):
        tuning = StepTuning(min_token_bucket=16, step_executables=n, cublas_max_tokens=0)
        engine = LLMEngine(params, EngineConfig(block_size=8, num_blocks=32, max_model_len=32, compilation_cache=False),
                           tuning=tuning)
        runner = engine.runner
        assert runner.step_executables == n and len(runner._flat(engine.params.state)[0]) == n
        outs[n] = [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, sp)]
        copies = runner._flat(engine.params.state)[0]
        assert all(c._cache_size() >= 1 for c in copies)  # every copy ran
        assert runner.num_compiled_shapes == len({k[:-1] for k in runner._shapes_seen})
        assert runner.num_compiled_executables == len(runner._shapes_seen) >= runner.num_compiled_shapes
        assert runner.num_copies(32) == n and runner.num_copies(64) == 1  # large steps: one copy
    assert outs[1] == outs[2]
    np.testing.assert_array_equal([len(t) for t in outs[2]], [6, 6])


def test_cublas_covers_decode_sized_steps_only():
    """``StepTuning.cublas_max_tokens``: steps of 33..N padded tokens compile separately (XLA's GEMMs
    through cuBLAS on a GPU), smaller and larger steps the default way; tokens do not change (on the
    CPU the option has no effect); the default is 0 (never) off a GPU."""
    from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
    from jaxpaged.engine.model_runner import CUBLAS_OPTIONS
    from jaxpaged.engine.tuning import StepTuning
    from jaxpaged.llm import run_to_completion
    from jaxpaged.models.tiny import tiny_checkpoint_path

    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = {}
    assert StepTuning.default().cublas_max_tokens == (512 if jax.default_backend() == "gpu" else 0)
    for n in (0, 64):
        tuning = StepTuning(min_token_bucket=16, step_executables=1, cublas_max_tokens=n)
        engine = LLMEngine(params, EngineConfig(block_size=8, num_blocks=32, max_model_len=64, compilation_cache=False),
                           tuning=tuning)
        runner = engine.runner
        assert [runner.uses_cublas(t) for t in (16, 32, 64, 128)] == [False, False, bool(n), False]
        outs[n] = run_to_completion(engine, [list(range(40))], sp)[0].outputs[0].token_ids  # a 64-token prefill
        assert sorted(key[-2] for key in runner._shapes_seen) == ([False, True] if n else [False, False])
    assert outs[0] == outs[64]
    assert CUBLAS_OPTIONS == {"xla_gpu_enable_triton_gemm": False}
