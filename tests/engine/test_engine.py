"""The engine end to end on the tiny checkpoints: equal to transformers, invariant to paging choices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, generate, load_params
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.engine.tuning import StepTuning
from jaxpaged.io.tokenizer import load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny(request):
    params = load_params(tiny_checkpoint_path(request.param), "float32", use_cache=False)
    return params, np.load(FIXTURES / f"hf_reference_{request.param}.npz")


@pytest.fixture(scope="module")
def qwen3():
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    return params, np.load(FIXTURES / "hf_reference_qwen3.npz")


def fixture_prompts(ref):
    return [list(map(int, ref[f"prompt_{i}"])) for i in range(4)]


def shared_prefix_prompts(ref):
    """Prompts that share 1-3 full blocks with the fixture prompts (so prefix caching has work)."""
    long = list(map(int, ref["prompt_2"]))
    return [long[:24] + [7, 8, 9, 10, 11], long[:17] + [100, 101], long + [5, 6, 7]]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_hf_generate_batched(tiny):
    params, ref = tiny
    outs = generate(params, fixture_prompts(ref), EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64,
                                                               max_model_len=128), GREEDY)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == list(map(int, ref[f"greedy_{i}"])), f"prompt {i}"
        assert out.outputs[0].finish_reason == "length"


BASE = dict(kv_cache_dtype="float32", max_model_len=64, max_num_batched_tokens=256)
CONFIGS = {
    "no_prefix_cache": dict(block_size=16, num_blocks=64, enable_prefix_caching=False),
    "bs8": dict(block_size=8, num_blocks=64),
    "bs16": dict(block_size=16, num_blocks=32),
    "bs32": dict(block_size=32, num_blocks=16),
    "max_len": dict(block_size=8, num_blocks=64, reservation="max_len", enable_prefix_caching=False),
    "chunked_prefill": dict(block_size=8, num_blocks=64, max_num_batched_tokens=16),
    "tiny_pool_preempts": dict(block_size=8, num_blocks=12, max_num_seqs=8),
    "few_seqs": dict(block_size=8, num_blocks=64, max_num_seqs=2),
    "sync_scheduling": dict(block_size=8, num_blocks=64, async_scheduling=False),
    "sync_tiny_pool": dict(block_size=8, num_blocks=12, max_num_seqs=8, async_scheduling=False),
    "token_bucket_1": dict(block_size=8, num_blocks=64),  # the GPU's buckets (TUNINGS)
}
# The GPU's token buckets (1, 2, 4, ...) on the CPU, where the engine's default starts at 16.
TUNINGS = {"token_bucket_1": StepTuning(min_token_bucket=1, step_executables=1, cublas_max_tokens=0)}


@pytest.fixture(scope="module")
def paging_baseline(qwen3):
    """The shared-prefix prompts' greedy tokens in one wave, prefix caching off: computed once, compared
    with every paging choice's."""
    params, ref = qwen3
    return token_ids(generate(params, shared_prefix_prompts(ref), EngineConfig(**BASE, block_size=16, num_blocks=64,
                                                                             enable_prefix_caching=False), GREEDY))


@pytest.mark.parametrize("name", [n if n not in ("few_seqs", "bs32") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CONFIGS])
def test_greedy_outputs_invariant_to_paging_choices(qwen3, paging_baseline, name):
    params, ref = qwen3
    prompts = fixture_prompts(ref) + shared_prefix_prompts(ref)
    config = EngineConfig(**{**BASE, **CONFIGS[name]})
    engine = LLMEngine(params, config, tuning=TUNINGS.get(name))
    # Two waves, so the second finds the first's blocks in the prefix cache.
    outs = run_to_completion(engine, prompts[:4], GREEDY) + run_to_completion(engine, prompts[4:], GREEDY)
    for i in range(4):
        assert outs[i].outputs[0].token_ids == list(map(int, ref[f"greedy_{i}"])), f"{name}: prompt {i}"
    assert token_ids(outs[4:]) == paging_baseline
    stats = engine.stats()
    if name in ("tiny_pool_preempts", "async_tiny_pool"):
        assert stats["preemptions"] > 0
    if name in ("bs8", "chunked_prefill"):
        assert stats["prefix_hit_tokens"] > 0
    engine.kv.check_invariants()
    assert stats["blocks_used"] == 0  # everything released


def test_prefix_hit_skips_cached_blocks(qwen3):
    params, ref = qwen3
    bs = 8
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=bs, num_blocks=64, max_model_len=128))
    shared = list(map(int, ref["prompt_2"]))[: 3 * bs]
    first = run_to_completion(engine, [shared + [1, 2, 3, 4, 5]], GREEDY)[0]
    before = engine.stats()["prefill_tokens"]
    second = run_to_completion(engine, [shared + [9, 8, 7]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * bs
    assert engine.stats()["prefill_tokens"] - before == 3  # only the uncached tail was computed
    alone = generate(params, [shared + [9, 8, 7]], EngineConfig(kv_cache_dtype="float32", block_size=bs, num_blocks=64,
                                                                max_model_len=128, enable_prefix_caching=False), GREEDY)
    assert second.outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_seeded_request_is_independent_of_the_batch(qwen3):
    params, ref = qwen3
    cfg = EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=128)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    prompts = fixture_prompts(ref)
    alone = generate(params, [prompts[1]], cfg, sp)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = generate(params, [prompts[0], prompts[1], prompts[2]], cfg, [others, sp, others])
    assert batched[1].outputs[0].token_ids == alone
    assert batched[0].outputs[0].token_ids != batched[2].outputs[0].token_ids


def test_bad_requests_are_rejected_and_others_complete(qwen3):
    params, ref = qwen3
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=64))
    good = engine.add_request(fixture_prompts(ref)[0], GREEDY)
    engine.step()  # the good request is running when the bad ones arrive
    with pytest.raises(ValueError, match="request 'empty': prompt is empty"):
        engine.add_request([], GREEDY, request_id="empty")
    with pytest.raises(ValueError, match=r"request 'long'.*exceeds max_model_len \(64\)"):
        engine.add_request([1] * 50, GREEDY, request_id="long")
    with pytest.raises(ValueError, match=r"request 'oov': prompt token id 512 at position 1 is outside"):
        engine.add_request([1, 512], GREEDY, request_id="oov")
    bad_sp = SamplingParams()
    bad_sp.temperature = float("nan")
    with pytest.raises(ValueError, match="request 'nan'.*temperature"):
        engine.add_request([1, 2], bad_sp, request_id="nan")
    with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
        engine.add_request("hello", GREEDY, request_id="text")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == [good]
    assert outs[0].outputs[0].token_ids == list(map(int, ref["greedy_0"]))


def test_generate_is_all_or_nothing(qwen3):
    params, ref = qwen3
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=64))
    with pytest.raises(ValueError, match="prompt is empty"):
        run_to_completion(engine, [fixture_prompts(ref)[0], []], GREEDY)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("field, value, match", [
    ("temperature", -0.5, r"temperature must be finite \(in float32\) and >= 0"), ("temperature", float("inf"), "must be finite"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_k", -3, "top_k must be -1"), ("max_tokens", 0, "max_tokens must be a positive"),
    ("seed", -1, "seed must be")])
def test_sampling_params_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_fp8_kv_cache_pool_and_stats(qwen3):
    """An fp8 pool: one byte an element plus a scale row a block; the stats report its sizes; a block
    larger than head_dim (no room for its scales) is refused naming the field."""
    params, _ = qwen3
    kw = dict(block_size=16, num_blocks=32, max_model_len=128)
    fp8 = LLMEngine(params, EngineConfig(kv_cache_dtype="fp8", **kw))
    full = LLMEngine(params, EngineConfig(kv_cache_dtype="bfloat16", **kw))
    assert fp8.kv_pool.dtype == jnp.float8_e4m3fn and fp8.kv_pool.shape[2] == 17
    assert fp8.stats()["kv_bytes_per_token"] == full.stats()["kv_bytes_per_token"] // 2 * 17 // 16
    assert fp8.stats()["kv_pool_bytes"] == fp8.kv_pool.nbytes
    e5 = LLMEngine(params, EngineConfig(kv_cache_dtype="fp8_e5m2", **kw))
    assert e5.kv_pool.dtype == jnp.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*block_size must be <= 32"):
        LLMEngine(params, EngineConfig(kv_cache_dtype="fp8", block_size=64, num_blocks=8, max_model_len=128))


def test_default_block_size_follows_the_kv_cache_dtype(qwen3):
    """16 tokens, or for an fp8 pool 64 capped at the head dim (the tiny model's 32): its attention
    reads 64-slot tiles; the engine's config holds the resolved size."""
    params, _ = qwen3
    assert EngineConfig().block_size is None
    assert EngineConfig(kv_cache_dtype="fp8").resolved_block_size(128) == 64
    assert LLMEngine(params, EngineConfig(num_blocks=32, max_model_len=128)).config.block_size == 16
    fp8 = LLMEngine(params, EngineConfig(kv_cache_dtype="fp8", num_blocks=8, max_model_len=128))
    assert fp8.config.block_size == params.config.head_dim == 32 and fp8.kv_pool.shape[2] == 33


def test_pool_too_small_for_one_sequence(qwen3):
    params, _ = qwen3
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=64"):
        LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=4, max_model_len=64))


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=12), "power of two"), (dict(reservation="contiguous"), "reservation must be"),
    (dict(attention_backend="cuda"), "attention_backend must be"), (dict(memory_fraction=1.5), "memory_fraction"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype="fp8_e3m4"), "kv_cache_dtype must be one of .*'fp8_e5m2'")])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_step_tuning_validation():
    with pytest.raises(ValueError, match="min_token_bucket must be a power of two"):
        StepTuning(min_token_bucket=3, step_executables=1, cublas_max_tokens=0)


def test_text_prompts_and_eos(tiny):
    params, ref = tiny
    tok = load_tokenizer(params.path)
    texts = [str(t) for t in ref["texts"]]
    cfg = EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=128)
    outs = generate(params, texts, cfg, GREEDY, tokenizer=tok)
    for i, out in enumerate(outs):
        assert out.prompt == texts[i]
        assert out.prompt_token_ids == list(map(int, ref[f"prompt_{i}"]))
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
        assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token >= 0
    # A stop token ends the request at its first occurrence.
    stop = outs[0].outputs[0].token_ids[5]
    sp = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    out = generate(params, [texts[0]], cfg, sp, tokenizer=tok)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    assert stop not in out.token_ids[:-1]


@pytest.mark.slow  # (an interpret-mode Pallas engine's warm-up: ~15 s on a CPU)
def test_pallas_backend_engine_matches_hf_and_warmup_covers_all_shapes(qwen3):
    """The engine on the Pallas kernels (interpret mode on CPU): same greedy tokens as transformers;
    after ``warmup()`` no step compiles again."""
    params, ref = qwen3
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=64,
                                            max_num_batched_tokens=32, attention_backend="triton"))
    engine.warmup(use_tqdm=False, freeze_gc=False)
    compiled = engine.runner.num_compiled_executables
    outs = run_to_completion(engine, fixture_prompts(ref)[:2], GREEDY)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == list(map(int, ref[f"greedy_{i}"]))
    assert engine.runner.num_compiled_executables == compiled


@pytest.mark.slow  # (Mosaic GPU's interpreter: ~15 s on a CPU)
def test_mosaic_backend_engine_matches_the_reference_backend():
    """The engine on the Mosaic GPU kernel (its interpreter on CPU) over a bf16 pool and an fp8 pool
    (blocks of 64; bf16 weights: the configurations the kernel runs on Hopper; the kernel reads head_dim
    64/128, so a random model of the tiny shapes at head_dim 64): the jnp reference backend's greedy
    tokens over the same pool through prefill and decode steps (over bf16 the decode step a uniform
    decode step, the decode kernel's); a configuration it cannot run is refused before anything is
    built. (The kernel over float32 pools: its own tests.)"""
    from jaxpaged.models.checkpoint import random_params
    from jaxpaged.models.config import QwenConfig
    from jaxpaged.models.tiny import tiny_config

    # (two layers, not the tiny model's three: each layer's kernel launch is interpreted; two still read
    # their own layer of the pool)
    params = random_params(QwenConfig.from_dict({**tiny_config("qwen3", 512), "head_dim": 64, "num_hidden_layers": 2}),
                           "bfloat16")
    prompts = [[5, 77, 300, 2, 9, 41, 41, 8, 100], [400, 12]]
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # a prefill step, then a decode step
    for kv_dtype in ("auto", "fp8"):
        tokens = {}
        for name in ("reference", "mosaic"):
            cfg = EngineConfig(kv_cache_dtype=kv_dtype, num_blocks=8, block_size=64, max_model_len=64,
                               max_num_batched_tokens=32, attention_backend=name)
            engine = LLMEngine(params, cfg)
            before = set(engine.runner._shapes_seen)  # (a runner, and what it compiled, outlives its engine)
            tokens[name] = [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, sp)]
            marks = name == "mosaic"
            assert engine._uniform_decode == marks
            assert any(key[0].uniform_decode for key in engine.runner._shapes_seen - before) == marks
        assert tokens["mosaic"] == tokens["reference"], kv_dtype
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*batch_invariant"):
        LLMEngine(params, dataclasses.replace(cfg, batch_invariant=True))
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*fp8 pool.*block_size"):
        LLMEngine(params, dataclasses.replace(cfg, block_size=16))
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*head_dim 32"):
        LLMEngine(load_params(tiny_checkpoint_path("qwen3"), "float32"), dataclasses.replace(cfg, kv_cache_dtype="float32"))


def test_warmup_freezes_the_long_lived_heap_and_the_pool_is_still_freed(qwen3):
    """After ``warmup()`` the objects alive then are out of the cyclic collector's reach (a full collection
    no longer walks them), and a dropped engine still releases its KV pool at once (reference counts)."""
    import gc
    import weakref

    params, _ = qwen3
    engine = LLMEngine(params, EngineConfig(**SMALL, max_num_batched_tokens=32))
    try:
        engine.warmup(use_tqdm=False)
        frozen = gc.get_freeze_count()
        assert frozen > 1000 and len(gc.get_objects()) < frozen  # most of the heap is frozen
        run_to_completion(engine, [[1, 2, 3]], GREEDY)
        pool, ref = weakref.ref(engine.kv_pool), weakref.ref(engine)
        del engine
        assert ref() is None and pool() is None
    finally:
        gc.unfreeze()  # the rest of the suite collects as usual (conftest does it after every test too)


@pytest.mark.parametrize("num_blocks", [pytest.param(64, marks=pytest.mark.slow), 12])
def test_async_and_sync_scheduling_agree_with_stops_and_sampling(qwen3, num_blocks):
    """Stop tokens, EOS, max_tokens, seeded sampling and preemption (small pool): same outputs and
    finish reasons whether the next step is dispatched before the previous tokens are read or not."""
    params, ref = qwen3
    prompts = fixture_prompts(ref) + shared_prefix_prompts(ref)
    greedy = [list(map(int, ref[f"greedy_{i}"])) for i in range(4)]
    sps = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[greedy[0][7]]),
           SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
           SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=11, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[greedy[3][0]]),
           SamplingParams(temperature=1.0, max_tokens=15, seed=5),
           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    results = {}
    for mode in (True, False):
        cfg = EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=num_blocks, max_model_len=64,
                           max_num_seqs=8, async_scheduling=mode)
        engine = LLMEngine(params, cfg)
        outs = run_to_completion(engine, prompts, sps)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        engine.kv.check_invariants()
        assert engine.stats()["blocks_used"] == 0 and not engine.has_unfinished_requests()
        if num_blocks == 12:
            assert engine.stats()["preemptions"] > 0
    assert results[True] == results[False]
    toks, reasons = zip(*results[True])
    assert toks[0] == greedy[0][:8] and reasons[0] == "stop"
    assert toks[1] == greedy[1][:9] and reasons[1] == "length"
    assert toks[3] == greedy[3][:1] and reasons[3] == "stop"
    assert len(toks[5]) == 1 and reasons[5] == "length"


# ---- defects found in review (each failed before its fix) ----------------------------------------------

SMALL = dict(kv_cache_dtype="float32", block_size=8, num_blocks=64, max_model_len=64)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_returns_an_abort_output(qwen3, async_scheduling):
    """An aborted request comes back once, with finish_reason "abort" and only the tokens the host had
    seen (under async scheduling its token still in flight is dropped, never a placeholder); its blocks
    are freed and the other request is unaffected."""
    params, ref = qwen3
    engine = LLMEngine(params, EngineConfig(**SMALL, async_scheduling=async_scheduling))
    keep = engine.add_request(fixture_prompts(ref)[0], GREEDY)
    gone = engine.add_request([6, 7, 8], GREEDY)
    engine.step()
    engine.step()
    engine.abort_request(gone)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == [gone, keep]
    aborted = outs[0].outputs[0]
    assert aborted.finish_reason == "abort" and outs[0].finished
    assert len(aborted.token_ids) == (1 if async_scheduling else 2) and -1 not in aborted.token_ids
    assert outs[1].outputs[0].token_ids == list(map(int, ref["greedy_0"]))
    assert engine.kv.num_used_blocks == 0
    engine.kv.check_invariants()
    with pytest.raises(KeyError, match="no unfinished request"):
        engine.abort_request(gone)


def test_prompt_over_the_budget_without_chunked_prefill_is_rejected(qwen3):
    params, _ = qwen3
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=128, max_num_batched_tokens=32,
                                            enable_chunked_prefill=False))  # max_model_len: the model's (1024)
    with pytest.raises(ValueError, match=r"request '0'.*max_num_batched_tokens \(32\).*chunked prefill is off"):
        engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=8))
    assert not engine.has_unfinished_requests()
    out = run_to_completion(engine, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_auto_request_ids_never_collide_with_chosen_ones(qwen3):
    params, _ = qwen3
    engine = LLMEngine(params, EngineConfig(**SMALL))
    assert engine.add_request([1, 2], GREEDY, request_id="1") == "1"
    ids = [engine.add_request([1, 2], GREEDY) for _ in range(3)]
    assert ids == ["0", "2", "3"]


def test_a_refused_request_takes_no_id(qwen3):
    params, _ = qwen3
    engine = LLMEngine(params, EngineConfig(**SMALL))
    with pytest.raises(ValueError, match="request '0': prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="prompt 1: request '1': prompt token id 1000000"):
        engine.add_requests([[1, 2], [10**6]], GREEDY)
    assert engine.add_request([1, 2], GREEDY) == "0"  # the first accepted request gets the first id
    assert engine.add_requests([[3], [4]], GREEDY) == ["1", "2"]


def test_any_error_withdraws_the_whole_batch(qwen3):
    params, _ = qwen3
    engine = LLMEngine(params, EngineConfig(**SMALL))
    with pytest.raises(TypeError):
        run_to_completion(engine, [[1, 2, 3], None], GREEDY)
    assert not engine.has_unfinished_requests()
    outs = run_to_completion(engine, [[4, 5, 6]], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [[4, 5, 6]]


def test_step_and_stats_utilisation_agree_with_shared_blocks(qwen3):
    params, _ = qwen3
    engine = LLMEngine(params, EngineConfig(**SMALL))
    prefix = list(range(1, 17))  # two full blocks shared by every request
    for i in range(4):
        engine.add_request(prefix + [20 + i, 30 + i, 40 + i], SamplingParams(temperature=0, max_tokens=12))
    agree = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.running:
            assert engine.metrics.records[-1].block_utilisation == engine.kv.stats().block_utilisation <= 1.0
            agree += 1
    assert agree > 3 and engine.kv.stats().prefix_hit_blocks > 0


def test_runners_belong_to_their_weights(qwen3):
    import gc
    import weakref

    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    first = LLMEngine(params, EngineConfig(**SMALL))
    run_to_completion(first, [[1, 2, 3]], GREEDY)
    assert first.stats()["compiled_shapes"] > 0
    second = LLMEngine(params, EngineConfig(**SMALL))
    assert second.runner is first.runner  # shared compiled steps ...
    assert second.stats()["compiled_shapes"] == 0 and second.stats()["compile_seconds"] == 0  # ... not counts
    runner = weakref.ref(first.runner)
    del first, second, params
    gc.collect()
    assert runner() is None  # dropping the weights releases the runner and its executables


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pool_dtype_defaults_to_the_weights(dtype):
    params = load_params(tiny_checkpoint_path("qwen2"), dtype, use_cache=False)
    engine = LLMEngine(params, EngineConfig(block_size=8, num_blocks=16, max_model_len=64, compilation_cache=False))
    assert engine.kv_pool.dtype == np.dtype(dtype) and engine.stats()["kv_dtype"] == dtype
    assert LLMEngine(params, EngineConfig(block_size=8, num_blocks=16, max_model_len=64, kv_cache_dtype="float32")
                     ).kv_pool.dtype == np.float32


def test_a_dropped_engine_frees_its_pool_at_once(qwen3):
    """No reference cycle through the engine: its KV pool (most of the device memory) is released when
    the last reference goes, not at the next garbage collection (a second engine in the same process
    would otherwise size its pool from what the first one still holds)."""
    import gc
    import weakref

    params, _ = qwen3
    engine = LLMEngine(params, EngineConfig(**SMALL))
    run_to_completion(engine, [[1, 2, 3], [4, 5]], GREEDY)
    pool, ref = weakref.ref(engine.kv_pool), weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert ref() is None and pool() is None
    finally:
        gc.enable()


def test_longest_first_orders_rows_by_context_and_keeps_ties():
    from types import SimpleNamespace

    from jaxpaged.engine.step_inputs import longest_first

    seqs = [SimpleNamespace(name=c, num_computed_tokens=k) for c, k in zip("abcde", [10, 300, 0, 300, 42])]
    scheduled = [(seqs[0], 1), (seqs[1], 1), (seqs[2], 64), (seqs[3], 1), (seqs[4], 1)]
    order = [(s.name, n) for s, n in longest_first(scheduled)]
    assert order == [("b", 1), ("d", 1), ("c", 64), ("e", 1), ("a", 1)]  # 301, 301, 64, 43, 11
