"""Tensor parallelism on CPU devices: the same greedy tokens as one device, weights and pool really split,
and a step whose only collectives are the all-reduces of activations and the gather of the logits.

The multi-device checks run in a subprocess with ``--xla_force_host_platform_device_count`` (this
pytest process has already started JAX with one CPU device). Both tiny checkpoints have 4 query heads
and 2 KV heads, so tp=2 splits the KV heads and tp=4 replicates each one on two devices.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from jaxpaged import EngineConfig
from jaxpaged.models.config import QwenConfig
from jaxpaged.models.sharding import check_divisible, kv_heads_of_shard, param_spec, shard_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import re
import jax, numpy as np
from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
from jaxpaged.engine.step_inputs import build_step_inputs
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.models.sharding import per_device_bytes

assert jax.device_count() == 4
prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8, 7], list(range(20, 45)), [3] * 17]
sp = SamplingParams(temperature=0, max_tokens=6)


def engine(params, tp, backend="reference"):
    return LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=32, max_model_len=64,
                                          max_num_batched_tokens=32, max_num_seqs=4, attention_backend=backend,
                                          tensor_parallel_size=tp, compilation_cache=False))


def tokens(e):
    return [o.outputs[0].token_ids for o in run_to_completion(e, prompts, sp)]


# (Qwen2 at tp=2, its q/k/v biases split with the heads, is the fused qkv epilogue's check below)
for name, tps in (("qwen3", (2, 4)),):  # at 4: KV heads replicated
    one = load_params(tiny_checkpoint_path(name), "float32", use_cache=False)
    cfg = one.config
    want = tokens(engine(one, 1))
    for tp in tps:
        p = load_params(tiny_checkpoint_path(name), "float32", use_cache=False, tensor_parallel_size=tp)
        e = engine(p, tp)
        got = tokens(e)
        assert got == want, (name, tp, got, want)
        (jitted,) = e.runner._flat(e.params.state)[0]  # one copy of the step under tensor parallelism
        compiled = jitted._cache_size()
        assert tokens(e) == want and jitted._cache_size() == compiled  # fed-back tokens: no new executable

        # Weights split: each device holds 1/tp of every split matrix (and only that).
        layer = p.state["layers"][0]
        qkv_cols = tp * (cfg.num_attention_heads // tp + 2 * max(cfg.num_key_value_heads // tp, 1)) * cfg.head_dim
        for arr, shard_shape in [(layer["attn"]["qkv_proj"][...], (cfg.hidden_size, qkv_cols // tp)),
                                 (layer["attn"]["o_proj"][...], (cfg.q_size // tp, cfg.hidden_size)),
                                 (layer["mlp"]["gate_up_proj"][...], (cfg.hidden_size, 2 * cfg.intermediate_size // tp)),
                                 (layer["mlp"]["down_proj"][...], (cfg.intermediate_size // tp, cfg.hidden_size)),
                                 (p.state["embed_tokens"][...], (cfg.vocab_size // tp, cfg.hidden_size))]:
            assert len(arr.sharding.device_set) == tp
            assert {s.data.shape for s in arr.addressable_shards} == {shard_shape}, (arr.shape, shard_shape)
        # Shard s's fused qkv block is [q_s | k_s | v_s] of the one-device weight (KV heads replicated at tp=4).
        w1 = np.asarray(one.state["layers"][0]["attn"]["qkv_proj"][...])
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        for s, shard in enumerate(sorted(layer["attn"]["qkv_proj"][...].addressable_shards, key=lambda x: x.index[1].start)):
            kv = s * hkv // tp if hkv >= tp else s // (tp // hkv)
            nkv = max(hkv // tp, 1)
            q = w1[:, s * hq // tp * d:(s + 1) * hq // tp * d]
            k = w1[:, cfg.q_size + kv * d: cfg.q_size + (kv + nkv) * d]
            v = w1[:, cfg.q_size + cfg.kv_size + kv * d: cfg.q_size + cfg.kv_size + (kv + nkv) * d]
            np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate([q, k, v], axis=1))

        # Pool split over KV heads: one head per device at tp=2 and (replicated) at tp=4.
        pool = e.kv_pool  # [L, N, bs, 2, Hkv, D]
        layers = cfg.num_hidden_layers
        assert {s.data.shape for s in pool.addressable_shards} == {(layers, 32, 8, 2, 1, d)}
        assert len(pool.sharding.device_set) == tp and pool.shape == (layers, 32, 8, 2, max(hkv, tp), d)
        sizes = per_device_bytes((p.state, e.kv_pool))
        assert len(sizes) == tp and len(set(sizes.values())) == 1, sizes

        # The compiled step: pool aliased; collectives only all-reduce [T, H] and all-gather of logits [S, V].
        e.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=4))
        e.add_request([9, 8, 7], SamplingParams(max_tokens=4))
        inputs = build_step_inputs(e.scheduler.schedule(), e.kv.tables, 8)
        hlo = e.runner.lower_text(p.state, e.kv_pool, inputs)
        header = hlo.splitlines()[0]
        # the one pool array (and on a GPU the token buffer the step writes into: ModelRunner.step's spare_tokens)
        aliases = 1 + e.runner.donate_spare_tokens
        assert len(re.findall(r"\{\d+\}: \(\d+, \{\}, (?:may|must)-alias\)", header)) == aliases
        t, s_rows = inputs.token_ids.shape[0], inputs.logits_indices.shape[0]
        colls = [l for l in hlo.splitlines() if re.search(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?\(", l)]
        reduces = [l for l in colls if " all-reduce" in l]
        gathers = [l for l in colls if " all-gather" in l]
        assert len(reduces) == 1 + 2 * cfg.num_hidden_layers, colls
        assert all(f"f32[{t},{cfg.hidden_size}]" in l for l in reduces), reduces
        assert len(gathers) == 1 and f"f32[{s_rows},{cfg.vocab_size}]" in gathers[0], gathers
        assert len(colls) == len(reduces) + len(gathers), colls
        print("OK", name, tp, got[0])

# The user entry point: LLM(..., tensor_parallel_size=2) loads split and runs split.
from jaxpaged import LLM
llm = LLM(tiny_checkpoint_path("qwen3"), dtype="float32", tensor_parallel_size=2, block_size=8, num_blocks=32,
          max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4, attention_backend="reference",
          compilation_cache=False)
assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
assert llm.params.mesh.shape["tp"] == 2

# The host tier per shard: each device offloads its own KV head to host memory and reloads it.
p2 = llm.params
e = LLMEngine(p2, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=10, max_model_len=64,
                               max_num_batched_tokens=32, max_num_seqs=4, attention_backend="reference",
                               tensor_parallel_size=2, compilation_cache=False, kv_offloading_size=1e-3))
assert tokens(e) == want
run_to_completion(e, [list(range(100, 156)), list(range(200, 256))], SamplingParams(max_tokens=1))
assert tokens(e) == want and e.stats()["blocks_reloaded"] > 0
e.kv.check_invariants()
host = next(a for a in e.kv_transfers.slots if a is not None)
assert host.sharding.memory_kind == "pinned_host" and len(host.sharding.device_set) == 2
assert {s.data.shape[-2] for s in host.addressable_shards} == {1}  # one KV head per device
print("OK host tier")

# The Pallas kernels (interpret mode here) run per shard too: the same greedy tokens as one device
# (float32: the reference backend's, whose first three of six are these).
prompts, sp = prompts[:2], SamplingParams(temperature=0, max_tokens=3)
qwen3_ref = [w[:3] for w in want[:2]]
p = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False, tensor_parallel_size=2)
assert tokens(engine(p, 2, "triton")) == qwen3_ref
print("OK pallas")

# The GPU's fused qkv epilogue (interpret mode here) per shard: its own q heads, KV heads and pool half,
# the Qwen2 bias split with them, and KV heads replicated at tp=4.
import dataclasses, functools
import jaxpaged.engine.model_runner as runner_module
from jaxpaged.models.ops import fused_qkv
from jaxpaged.models.qwen import DEFAULT_OPS
fused_ops = dataclasses.replace(DEFAULT_OPS, qkv_epilogue=functools.partial(fused_qkv, interpret=True))
plain_get_model_ops = runner_module.get_model_ops
for name, tp in (("qwen2", 2), ("qwen3", 4)):
    ref = qwen3_ref if name == "qwen3" else tokens(engine(load_params(tiny_checkpoint_path(name), "float32",
                                                                        use_cache=False), 1))
    runner_module.get_model_ops = lambda *a, **k: fused_ops
    try:
        got = tokens(engine(load_params(tiny_checkpoint_path(name), "float32", use_cache=False,
                                        tensor_parallel_size=tp), tp))
    finally:
        runner_module.get_model_ops = plain_get_model_ops
    assert got == ref, (name, tp, got, ref)
print("OK fused qkv epilogue")

# fp8 weights quantized at load (a scale per output channel) split over 2 devices: each shard holds its
# columns' scales (whole ones where the rows are split, every shard scaling its partial product alike):
# the row-split weights and scales bitwise the one-device ones, the same greedy tokens.
q1 = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False, quantization="fp8")
q2 = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False, quantization="fp8", tensor_parallel_size=2)
for module, name, cols in (("attn", "qkv_proj", True), ("attn", "o_proj", False), ("mlp", "gate_up_proj", True),
                           ("mlp", "down_proj", False)):
    w, scale = (q2.state["layers"][0][module][name + k][...] for k in ("", "_scale"))
    assert w.dtype == jax.numpy.float8_e4m3fn and len(w.sharding.device_set) == 2
    assert {s.data.shape for s in scale.addressable_shards} == {(scale.shape[0] // 2,) if cols else scale.shape}
    if not cols:
        for a, b in ((w, q1.state["layers"][0][module][name][...]), (scale, q1.state["layers"][0][module][name + "_scale"][...])):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), name
assert tokens(engine(q2, 2)) == tokens(engine(q1, 1))
print("OK fp8 weights")

try:
    engine(load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False), 2)
except ValueError as err:
    assert "tensor_parallel_size=2" in str(err)
else:
    raise AssertionError("a one-device model under tensor_parallel_size=2 must be refused")
print("DONE")
"""


def with_device_count(devices: int | None) -> str:
    """This run's XLA flags (the suite's, see conftest.py) with ``devices`` forced CPU devices (None: one)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices else []))


def run_forced(script: str, devices: int, timeout: int = 600) -> str:
    env = dict(os.environ, XLA_FLAGS=with_device_count(devices), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


def test_tensor_parallel_engine_on_four_cpu_devices():
    out = run_forced(SCRIPT, 4)
    assert out.count("OK ") == 6 and "DONE" in out, out


def test_shard_config_and_kv_head_replication():
    cfg = QwenConfig(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    assert shard_config(cfg, 1) is cfg
    local = shard_config(cfg, 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.vocab_size) == (2, 1, 64, 128)
    # tp=4 > 2 KV heads: shards 0,1 read KV head 0 (their q heads 0-3), shards 2,3 KV head 1.
    assert [list(kv_heads_of_shard(cfg, 4, s)) for s in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads_of_shard(cfg, 2, s)) for s in range(2)] == [[0], [1]]
    assert [list(kv_heads_of_shard(dataclasses.replace(cfg, num_key_value_heads=4), 2, s)) for s in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_divisible(dataclasses.replace(cfg, num_key_value_heads=8, num_attention_heads=24), 3)
    with pytest.raises(ValueError, match="vocab_size"):
        check_divisible(dataclasses.replace(cfg, vocab_size=510), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    assert str(param_spec(("layers", 0, "attn", "qkv_proj"))) == str(param_spec(("lm_head",)))
    assert param_spec(("layers", 0, "input_layernorm", "weight")) == param_spec(("norm", "weight"))
