"""Qwen3-MoE: greedy tokens equal to Hugging Face transformers' (float32, recorded fixtures) through the engine with
prefix caching, chunked prefill and preemption, on one device and with the experts split over 4 devices;
the MoE layer against a loop over experts; its config; batch invariance (fp8 experts:
``tests/models/test_fp8_weights.py``).

The tiny checkpoints under ``tests/fixtures/qwen3_moe/`` were written by transformers
(``tests/fixtures/make_hf_moe_reference.py``): 4 experts top-2 renormalised with a dense layer in
``mlp_only_layers``; 8 experts top-3 not renormalised with ``decoder_sparse_step`` 2; 6 experts top-4.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
from jaxpaged.kernels.grouped_matmul import grouped_matmul_reference
from jaxpaged.llm import run_to_completion
from jaxpaged.models.config import CheckpointError, QwenConfig
from jaxpaged.models.kv_pool import init_kv_pool
from jaxpaged.models.moe import route, sparse_moe
from jaxpaged.models.ops import get_model_ops
from jaxpaged.models.qwen import DEFAULT_OPS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the model checks' helpers
from paged_forward import build_chunk_step, forward_all_logits  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_moe"
VARIANTS = ("e4_k2_norm", "e8_k3_step2", "e6_k4_norm")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def reference(variant):
    ref = np.load(FIXTURES / variant / "hf_reference.npz")
    return [ref[f"prompt_{i}"].tolist() for i in range(4)], [ref[f"greedy_{i}"].tolist() for i in range(4)], ref


def engine(params, tp=1):
    """Chunked prefill (16 tokens a step, prompts up to 38), a pool of 12 blocks of 8 for 4 requests of up
    to 54 tokens (preemption), prefix caching on (prompt 3 shares prompt 2's first 29 tokens)."""
    return LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=12, max_model_len=64,
                                          max_num_batched_tokens=16, max_num_seqs=4, attention_backend="reference",
                                          tensor_parallel_size=tp, compilation_cache=False))


def check_greedy(e, variant):
    prompts, want, _ = reference(variant)
    outs = run_to_completion(e, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = e.stats()
    assert stats["preemptions"] > 0
    assert outs[3].num_cached_tokens == 24  # prompt 2's first 3 blocks
    assert max(map(len, prompts)) > e.config.max_num_batched_tokens  # prefills were chunked


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_hf_through_the_engine(variant):
    check_greedy(engine(load_params(FIXTURES / variant, "float32", use_cache=False)), variant)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (the suite forces 4 CPU devices without a GPU)")
def test_expert_parallel_matches_hf(variant="e8_k3_step2", tp=4):
    """Experts split over 4 devices (2 of 8 each), attention and the dense layers' MLPs split as tensor
    parallelism does (KV heads replicated): the same greedy tokens; each device holds its experts' weights
    only. (Two shards' partial outputs summing to the whole layer's: ``test_moe_layer_matches_expert_loop``.)"""
    p = load_params(FIXTURES / variant, "float32", use_cache=False, tensor_parallel_size=tp)
    cfg = p.config
    one = load_params(FIXTURES / variant, "float32", use_cache=False)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    for name in ("experts_gate_up", "experts_down"):
        split = p.state["layers"][layer]["mlp"][name][...]
        whole = np.asarray(one.state["layers"][layer]["mlp"][name][...])
        per = cfg.num_experts // tp
        assert len(split.addressable_shards) == tp
        for shard in split.addressable_shards:
            first = shard.index[0].start or 0
            assert shard.data.shape == (per,) + whole.shape[1:]
            np.testing.assert_array_equal(np.asarray(shard.data), whole[first:first + per])
    check_greedy(engine(p, tp), variant)


def test_logits_match_hf():
    """All four prompts in one ragged step (padding tokens and a padding sequence too): every position's
    logits as transformers computed them."""
    params = load_params(FIXTURES / "e4_k2_norm", "float32", use_cache=False)
    cfg, graphdef, state = params.config, params.graphdef, params.state
    prompts, _, ref = reference("e4_k2_norm")
    perm = list(np.random.default_rng(3).permutation(32))
    chunks = []
    for p in prompts:
        n = -(-len(p) // 8)
        chunks.append((p, 0, perm[:n]))
        perm = perm[n:]
    step = build_chunk_step(chunks, 8, width=8)
    pool = jnp.full_like(init_kv_pool(cfg, 32, 8, jnp.float32), jnp.nan)  # stale blocks: NaN
    out, _ = forward_all_logits(graphdef, state, pool, step.token_ids, step.positions, step.meta)
    out, start = np.asarray(out), 0
    for i, p in enumerate(prompts):
        want = ref[f"logits_{i}"]
        assert np.linalg.norm(out[start:start + len(p)] - want) / np.linalg.norm(want) < 1e-4
        start += len(p)


def test_config_fields_and_bounds():
    raw = json.loads((FIXTURES / "e8_k3_step2" / "config.json").read_text())
    cfg = QwenConfig.from_dict(raw)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 3, 16)
    assert not cfg.norm_topk_prob
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, False]  # decoder_sparse_step 2
    published = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 8}  # the Hub's spelling
    assert QwenConfig.from_dict(published) == cfg
    only = QwenConfig.from_dict(raw | {"decoder_sparse_step": 1, "mlp_only_layers": [1]})
    assert [only.is_moe_layer(i) for i in range(3)] == [True, False, True]
    for change, field in (({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                          ({"mlp_only_layers": [3]}, "mlp_only_layers"),
                          ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
                          ({"norm_topk_prob": 1}, "norm_topk_prob"),
                          ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                          ({"num_local_experts": None}, "num_experts")):
        with pytest.raises(CheckpointError, match=field):
            QwenConfig.from_dict(raw | change)


def expert_loop(x, router, gate_up, down, top_k, norm):
    """Hugging Face's MoE block in float64 numpy: softmax, top-k, renormalise, then expert by expert."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, top, -1)
    if norm:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = np.nonzero(top == e)
        h = x[tok] @ np.asarray(gate_up[e], np.float64)
        g, u = np.split(h, 2, axis=-1)
        out[tok] += ((g / (1 + np.exp(-g)) * u) @ np.asarray(down[e], np.float64)) * weights[tok, slot, None]
    return out, top, weights


@pytest.mark.parametrize("norm", [True, False])
def test_moe_layer_matches_expert_loop(norm, random_moe_layer):
    """3 tokens, top-2 of 8 experts: at least 2 experts get no token. The layer with ``ragged_dot`` and with
    the dense loop reference equals the loop over experts; and split over 2 expert shards, the shards'
    partial outputs sum to it (expert parallelism's arithmetic, on one device)."""
    t, h, i, e, k = 3, 16, 8, 8, 2
    x, router, gate_up, down = random_moe_layer(0, t, h, i, e, jnp.float32, 0.5)
    want, top, weights = expert_loop(x, router, gate_up, down, k, norm)
    assert len(set(top.ravel())) < e
    got_w, got_e = route(x @ router, k, norm)
    np.testing.assert_array_equal(np.asarray(got_e), top)
    np.testing.assert_allclose(np.asarray(got_w), weights, rtol=1e-6)
    for ops in (DEFAULT_OPS, dataclasses.replace(DEFAULT_OPS, grouped_matmul=jax.jit(grouped_matmul_reference))):
        got = sparse_moe(x, router, gate_up, down, top_k=k, norm_topk_prob=norm, ops=ops)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    parts = [sparse_moe(x, router, gate_up[s * 4:(s + 1) * 4], down[s * 4:(s + 1) * 4], top_k=k, norm_topk_prob=norm,
                        ops=dataclasses.replace(DEFAULT_OPS, expert_shard=lambda s=s: s)) for s in range(2)]
    np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), want, rtol=1e-5, atol=1e-5)


def test_moe_layer_batch_invariant(random_moe_layer):
    """With ``batch_invariant`` ops (the fixed-tile matmul and grouped matmul, interpret mode) a token's MoE
    output is bitwise the same alone, in a batch of 20 and at another place in another batch."""
    x, router, gate_up, down = random_moe_layer(1, 20, 32, 16, 6, jnp.bfloat16, 0.3)
    k = 4
    ops = get_model_ops(batch_invariant=True)
    moe = jax.jit(lambda rows: sparse_moe(rows, router, gate_up, down, top_k=k, norm_topk_prob=True, ops=ops))
    batch = np.asarray(moe(x).astype(jnp.float32))
    alone = np.asarray(moe(x[7:8]).astype(jnp.float32))
    np.testing.assert_array_equal(alone[0], batch[7])
    shuffled = np.asarray(moe(x[::-1]).astype(jnp.float32))
    np.testing.assert_array_equal(shuffled[::-1], batch)


def test_benchmark_shapes_are_qwen3_30b_a3b():
    """``--model qwen3-30b-a3b``'s shapes: 30.5B parameters (the abstract model, nothing allocated), of which
    the floor's products per token (``benchmarks/floor.py``: attention, router, 8 experts, LM head) plus
    the embedding row are the ~3.3B active ones."""
    import floor

    from jaxpaged.models.convert import abstract_model
    from jaxpaged.workloads import BENCHMARK_MODELS, QWEN3_30B_A3B

    assert "qwen3-30b-a3b" in BENCHMARK_MODELS
    cfg = QwenConfig.from_dict(QWEN3_30B_A3B)
    _, state = abstract_model(cfg, "bfloat16")
    assert round(sum(x.size for x in jax.tree.leaves(state)) / 1e9, 1) == 30.5
    active = sum(k * n * count for k, n, count in floor.gemm_shapes(cfg).values())
    assert abs(active + cfg.vocab_size * cfg.hidden_size - 3.3e9) < 0.1e9
