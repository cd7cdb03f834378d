"""``batch_invariant=True``: a request's tokens (and the model's logits for a token) are bitwise the same
whatever else is batched, arrival order, chunked prefill, prefix-cache hits (on the device or reloaded
from the host tier), block size, preemption and async scheduling; in float32 and bf16, on the Pallas backend (interpret mode on the CPU).

The jnp reference attention backend is not batch-invariant (its batched dots and reductions follow
XLA's shape-dependent code paths: a float32 token's logits were seen to change with the step's token
count on the CPU), so ``batch_invariant`` carries its guarantee on the Pallas backend only.

Every arrangement is compared with the same requests run one at a time, in a fresh engine with
prefix caching off (the "alone" baseline).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
from jaxpaged.models.attention_backends import get_attention_fn
from jaxpaged.models.ops import get_model_ops
from jaxpaged.kernels.kv_write import write_kv
from jaxpaged.llm import run_to_completion
from jaxpaged.models.kv_pool import init_kv_pool
from jaxpaged.models.tiny import tiny_checkpoint_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the model checks' helpers
from paged_forward import build_chunk_step, forward_all_logits  # noqa: E402

RNG = np.random.default_rng(7)
SHARED = [int(t) for t in RNG.integers(1, 512, 24)]
PROMPTS = [SHARED + [int(t) for t in RNG.integers(1, 512, n)] for n in (3, 11, 1)] + \
          [SHARED[:9] + [5, 6, 7], [int(t) for t in RNG.integers(1, 512, 17)]]
# Few output tokens each (every step runs the Pallas kernels in interpret mode on a CPU), different
# lengths, so requests finish at different steps and the batch changes under the survivors.
SPS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
       SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=5, seed=3, ignore_eos=True),
       SamplingParams(temperature=1.0, max_tokens=7, seed=11, ignore_eos=True),
       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
       SamplingParams(temperature=0.7, top_p=0.8, max_tokens=4, seed=5, ignore_eos=True)]
BASE = dict(block_size=32, num_blocks=24, max_model_len=64, max_num_batched_tokens=64, batch_invariant=True)
CASES = [("float32", "triton"), ("bfloat16", "triton")]
# Each arrangement in one dtype, the dtypes alternating over the arrangements (interpret-mode kernels
# make every step cost on a CPU); the logits test below checks both dtypes step by step.
F32, BF16 = [CASES[0]], [CASES[1]]


@functools.cache
def params(dtype):
    return load_params(tiny_checkpoint_path("qwen3"), dtype, use_cache=False)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def engine(dtype, backend, **overrides):
    return LLMEngine(params(dtype), EngineConfig(**{**BASE, "kv_cache_dtype": dtype, "attention_backend": backend,
                                                    **overrides}))


@functools.cache
def alone(dtype, backend):
    """The baseline, computed once per run: the first pytest-xdist worker to need it writes it to the run's
    shared folder (under a lock), the others read it (each costs ~25 s of interpret-mode steps)."""
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not folder:
        return compute_alone(dtype, backend)
    path = Path(folder) / f"batch-invariance-alone-{dtype}-{backend}.json"
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(compute_alone(dtype, backend)))
        return json.loads(path.read_text())


# The baseline's pool: any (block size is among what must not matter), so each dtype's is a pool another
# test of that dtype uses, and the steps compile once (each interpret-mode step costs seconds of XLA
# compile on a CPU): BASE (float32's batched test, blocks of 32), blocks of 8 in a pool of 10
# (bfloat16's chunked-prefill, preemption and host-tier tests).
ALONE_POOL = {"float32": {}, "bfloat16": dict(block_size=8, num_blocks=10)}


def compute_alone(dtype, backend):
    eng = engine(dtype, backend, enable_prefix_caching=False, **ALONE_POOL[dtype])
    return [list(tokens(run_to_completion(eng, [p], sp))[0]) for p, sp in zip(PROMPTS, SPS)]


def staggered(eng, order):
    """Requests arrive while others run: two at first, one more after every engine step."""
    pending = list(order)
    rids = {}
    results = {}
    while pending or eng.has_unfinished_requests():
        for _ in range(2 if not rids else 1):
            if pending:
                i = pending.pop(0)
                rids[eng.add_request(PROMPTS[i], SPS[i])] = i
        for out in eng.step():
            results[rids[out.request_id]] = out.outputs[0].token_ids
    return [results[i] for i in range(len(PROMPTS))]


def check(dtype, backend, got, what):
    want = alone(dtype, backend)
    diff = [i for i in range(len(PROMPTS)) if list(got[i]) != list(want[i])]
    assert not diff, f"{dtype}/{backend} {what}: requests {diff} differ from alone"


@pytest.mark.parametrize("dtype,backend", F32)
def test_batched_reordered_and_staggered(dtype, backend):
    eng = engine(dtype, backend)
    check(dtype, backend, tokens(run_to_completion(eng, PROMPTS, SPS)), "batched")
    rev = tokens(run_to_completion(eng, PROMPTS[::-1], SPS[::-1]))[::-1]  # warm prefix cache too
    check(dtype, backend, rev, "reversed arrival, warm cache")
    check(dtype, backend, staggered(engine(dtype, backend, enable_prefix_caching=False), [4, 2, 0, 3, 1]),
          "staggered arrival, caching off")


@pytest.mark.parametrize("dtype,backend", BF16)
def test_chunked_prefill_and_prefix_cache(dtype, backend):
    """Chunks of 12 tokens into blocks of 8 (chunks end mid-block), then the same prompts again over the
    cached blocks. (A budget of 12 tokens pads every step to the smallest token bucket: the steps are
    the ones the pool's other tests compile.)"""
    eng = engine(dtype, backend, max_num_batched_tokens=12, **ALONE_POOL[dtype])
    check(dtype, backend, tokens(run_to_completion(eng, PROMPTS, SPS)), "chunk budget 12, block size 8")
    warm = tokens(run_to_completion(eng, PROMPTS, SPS))
    assert eng.stats()["prefix_hit_tokens"] > 0
    check(dtype, backend, warm, "chunk budget 12, block size 8, warm cache")


@pytest.mark.parametrize("dtype,backend", BF16)  # (the pool of the preemption test below: steps compiled once)
def test_block_size_8_and_a_host_tier(dtype, backend):
    """Blocks of 8 in a pool of 10 with a host tier (``kv_offloading_size``): the prompts, then two
    others that evict their cached blocks to the host, then the prompts again, whose prefix hits are
    copied back from the host."""
    eng = engine(dtype, backend, block_size=8, num_blocks=10, kv_offloading_size=1e-3)
    check(dtype, backend, tokens(run_to_completion(eng, PROMPTS, SPS)), "block size 8")
    others = [[int(t) for t in np.random.default_rng(9).integers(1, 512, 56)] for _ in range(2)]
    run_to_completion(eng, others, SamplingParams(max_tokens=1))
    check(dtype, backend, tokens(run_to_completion(eng, PROMPTS, SPS)), "block size 8, hits reloaded from the host")
    assert eng.stats()["blocks_reloaded"] > 0
    eng.kv.check_invariants()


@pytest.mark.parametrize("dtype,backend", BF16)
def test_preemption_with_async_scheduling(dtype, backend):
    eng = engine(dtype, backend, block_size=8, num_blocks=10, async_scheduling=True, enable_prefix_caching=False)
    check(dtype, backend, tokens(run_to_completion(eng, PROMPTS, SPS)), "tiny pool, async")
    assert eng.stats()["preemptions"] > 0


# float32 throughout, and bfloat16 over an fp8 KV cache (per-token scales; the bfloat16 model's steps are
# the same as over a bfloat16 pool but for the attention's reads, which the kernel tests check bitwise).
@pytest.mark.parametrize("dtype,backend,kv_dtype", [("float32", "triton", "float32"),
                                                    ("bfloat16", "triton", "float8_e4m3fn")])
def test_logits_of_a_token_do_not_depend_on_its_step(dtype, backend, kv_dtype):
    """Model level: the logits of one sequence's tokens, computed in one prefill alone, in a padded
    batch with another sequence, and as a prefill chunk followed by decode steps, are bitwise equal
    (with an fp8 KV cache too: each token's scales depend on that token alone)."""
    p = params(dtype)
    cfg = p.config
    attn, write = get_attention_fn(backend, True), write_kv
    ops = get_model_ops(True)
    seq, other, bs = PROMPTS[1], PROMPTS[4], 8
    table, other_table = list(range(1, 7)), list(range(7, 12))

    def run(chunks):
        pool = init_kv_pool(cfg, 16, bs, kv_dtype)
        rows = []
        for step in chunks:
            inp = build_chunk_step(step, bs, width=8)  # padded to the engine's token / sequence buckets
            logits, pool = forward_all_logits(p.graphdef, p.state, pool, inp.token_ids, inp.positions, inp.meta,
                                              attn, write, ops)
            rows.append(np.asarray(logits)[: len(step[0][0])])
        return np.concatenate(rows)

    one_prefill = run([[(seq, 0, table)]])
    batched = run([[(seq, 0, table), (other, 0, other_table)]])
    # (3 decode steps: a token's logits depend on the tokens before it only, so the chunked run can stop
    # there and compare with the first 23 rows; each interpret-mode step costs ~0.5 s)
    chunked = run([[(seq[:10], 0, table)], [(seq[10:20], 10, table), (other[:4], 0, other_table)]]
                  + [[(seq[i:i + 1], i, table)] for i in range(20, 23)])
    np.testing.assert_array_equal(batched[: len(seq)], one_prefill)
    np.testing.assert_array_equal(chunked, one_prefill[:23])
    assert np.all(np.isfinite(one_prefill))
