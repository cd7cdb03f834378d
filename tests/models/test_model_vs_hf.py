"""Our Qwen2 / Qwen3 logits equal Hugging Face transformers' (recorded fixtures) through the paged path."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.convert import load_hf_checkpoint
from jaxpaged.models.kv_pool import init_kv_pool
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.models.qwen import DEFAULT_OPS, ModelOps
from jaxpaged.kernels.add_rms_norm import add_rms_norm
from jaxpaged.models.ops import fused_qkv, gemv_or_xla_matmul, matmul_parts, silu_mul_matmul_parts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the model checks' helpers
from paged_forward import build_chunk_step, forward_all_logits  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BLOCK_SIZE = 8
NUM_BLOCKS = 32


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request):
    cfg, graphdef, state = load_hf_checkpoint(tiny_checkpoint_path(request.param), dtype="float32")
    ref = np.load(FIXTURES / f"hf_reference_{request.param}.npz")
    return cfg, graphdef, state, ref


def poisoned_pool(cfg):
    """A pool full of NaN: anything read past a sequence's length would poison the logits."""
    pool = init_kv_pool(cfg, NUM_BLOCKS, BLOCK_SIZE, jnp.float32)
    return jnp.full_like(pool, jnp.nan)


def run_chunks(cfg, graphdef, state, prompt, chunk_sizes, table, ops=DEFAULT_OPS):
    pool = poisoned_pool(cfg)
    logits, start = [], 0
    for size in chunk_sizes:
        ids = prompt[start:start + size]
        step = build_chunk_step([(ids, start, table)], BLOCK_SIZE, width=NUM_BLOCKS)  # padded to buckets
        out, pool = forward_all_logits(graphdef, state, pool, step.token_ids, step.positions, step.meta, ops=ops)
        logits.append(np.asarray(out)[:size])
        start += size
    return np.concatenate(logits)


def random_table(n, seed):
    return list(np.random.default_rng(seed).permutation(NUM_BLOCKS)[:n])


@pytest.mark.parametrize("prompt_idx", [0, 1, 2, 3])
def test_whole_prompt_matches_hf(model, prompt_idx):
    cfg, graphdef, state, ref = model
    prompt = ref[f"prompt_{prompt_idx}"]
    table = random_table(-(-len(prompt) // BLOCK_SIZE), prompt_idx)
    ours = run_chunks(cfg, graphdef, state, prompt, [len(prompt)], table)
    assert rel_err(ours, ref[f"logits_{prompt_idx}"]) < 1e-4


def test_two_chunks_match_hf(model):
    """A prefix already in the pool, then the rest (what a prefix-cache hit or chunked prefill does)."""
    cfg, graphdef, state, ref = model
    prompt = ref["prompt_2"]
    split = 2 * BLOCK_SIZE + 3
    ours = run_chunks(cfg, graphdef, state, prompt, [split, len(prompt) - split], random_table(5, 7))
    assert rel_err(ours, ref["logits_2"]) < 1e-4


def test_fused_qkv_epilogue_matches_hf(model):
    """The GPU path's fused qkv epilogue (one Pallas kernel: bias, q/k norm, RoPE, KV write; interpret
    mode here) gives Hugging Face's logits too: a prefix chunk, then token-by-token decode."""
    cfg, graphdef, state, ref = model
    ops = ModelOps(qkv_epilogue=functools.partial(fused_qkv, interpret=True))
    prompt = ref["prompt_2"]
    split = BLOCK_SIZE + 3
    ours = run_chunks(cfg, graphdef, state, prompt, [split] + [1] * (len(prompt) - split), random_table(5, 3), ops)
    assert rel_err(ours, ref["logits_2"]) < 1e-4


def test_fused_residual_matches_hf(model):
    """The GPU path's residual stream (products handed to the next norm as partials; the add + RMSNorm
    kernel, interpret mode) gives Hugging Face's logits: a prefix chunk, then decode steps."""
    cfg, graphdef, state, ref = model
    ops = ModelOps(matmul_parts=functools.partial(matmul_parts, interpret=True),
                   silu_mul_matmul_parts=functools.partial(silu_mul_matmul_parts, interpret=True),
                   add_rms_norm=functools.partial(add_rms_norm, interpret=True))
    prompt = ref["prompt_2"]
    split = BLOCK_SIZE + 3
    ours = run_chunks(cfg, graphdef, state, prompt, [split] + [1] * 3, random_table(5, 3), ops)
    assert rel_err(ours, ref["logits_2"][: split + 3]) < 1e-4


def test_token_by_token_decode_matches_hf(model):
    cfg, graphdef, state, ref = model
    prompt = ref["prompt_1"]
    ours = run_chunks(cfg, graphdef, state, prompt, [1] * len(prompt), random_table(3, 11))
    assert rel_err(ours, ref["logits_1"]) < 1e-4


def test_ragged_batch_matches_hf(model):
    """All prompts in one step, each with its own blocks, plus padding tokens and a padding sequence."""
    cfg, graphdef, state, ref = model
    prompts = [ref[f"prompt_{i}"] for i in range(4)]
    perm = list(np.random.default_rng(3).permutation(NUM_BLOCKS))
    chunks = []
    for p in prompts:
        n = -(-len(p) // BLOCK_SIZE)
        chunks.append((p, 0, perm[:n]))
        perm = perm[n:]
    step = build_chunk_step(chunks, BLOCK_SIZE, width=8)  # 4 sequences padded to 8, tokens to 64
    assert step.token_ids.shape[0] > sum(map(len, prompts)) and step.meta.kv_lens.shape[0] > len(prompts)
    out, _ = forward_all_logits(graphdef, state, poisoned_pool(cfg), step.token_ids, step.positions, step.meta)
    out = np.asarray(out)
    start = 0
    for i, p in enumerate(prompts):
        assert rel_err(out[start:start + len(p)], ref[f"logits_{i}"]) < 1e-4
        start += len(p)
    assert np.all(np.isfinite(out))


def test_tokenizer_matches_hf(model):
    """The packaged tokenizer.json gives the token ids transformers' AutoTokenizer gave."""
    import tokenizers

    cfg, _, _, ref = model
    tok = tokenizers.Tokenizer.from_file(str(tiny_checkpoint_path(cfg.model_type) / "tokenizer.json"))
    for i, text in enumerate(ref["texts"]):
        assert tok.encode(str(text)).ids == list(ref[f"prompt_{i}"])


@pytest.mark.slow  # (interpret-mode kernels over a whole bf16 model: ~30 s on a CPU)
@pytest.mark.parametrize("family", ["qwen3"])  # (the residual path is the same in both families; the f32
def test_fused_residual_bf16_matches_unfused_gemv_path(family):  # test above runs it for both against HF)
    """bf16, the GPU's decode path in interpret mode (GEMV partials into the add + RMSNorm kernel)
    against the same GEMVs with the model's own adds and norms, both against the float32 model: a
    1-token step and a 24-token chunk (the GEMV's 32-row tile).
    Not bitwise: inside jit XLA may skip the bf16 rounding between fused ops
    (``xla_allow_excess_precision``, on by default) while the kernel rounds where the ops do (eagerly
    the two agree bitwise), so the fused path must be as close to float32 as the plain one (measured
    ~1% relative logit error either way) and pick the same argmax."""
    cfg, graphdef, state = load_hf_checkpoint(tiny_checkpoint_path(family), dtype="bfloat16")
    _, graphdef32, state32 = load_hf_checkpoint(tiny_checkpoint_path(family), dtype="float32")
    plain = ModelOps(matmul=functools.partial(gemv_or_xla_matmul, interpret=True),
                     qkv_epilogue=functools.partial(fused_qkv, interpret=True))
    fused = dataclasses.replace(plain, matmul_parts=functools.partial(matmul_parts, interpret=True),
                                silu_mul_matmul_parts=functools.partial(silu_mul_matmul_parts, interpret=True),
                                add_rms_norm=functools.partial(add_rms_norm, interpret=True))
    prompt = list(np.random.default_rng(4).integers(1, cfg.vocab_size, 24))
    for ids, rows in ((prompt[:1], 1), (prompt, 32)):
        step = build_chunk_step([(ids, 0, list(range(4)))], BLOCK_SIZE, width=4)
        meta = dataclasses.replace(step.meta, slot_mapping=step.meta.slot_mapping[:rows])
        tokens, positions = step.token_ids[:rows], step.positions[:rows]
        outs = []
        for gd, st, ops, dtype in ((graphdef32, state32, DEFAULT_OPS, jnp.float32),
                                   (graphdef, state, plain, jnp.bfloat16), (graphdef, state, fused, jnp.bfloat16)):
            pool = init_kv_pool(cfg, NUM_BLOCKS, BLOCK_SIZE, dtype)  # (donated by each call)
            out, _ = forward_all_logits(gd, st, pool, tokens, positions, meta, ops=ops)
            outs.append(np.asarray(out, np.float32)[: len(ids)])
        ref, got_plain, got_fused = outs
        assert rel_err(got_fused, ref) <= 1.2 * rel_err(got_plain, ref) + 1e-3, len(ids)
        assert np.mean(np.argmax(got_fused, -1) == np.argmax(got_plain, -1)) >= 0.9
