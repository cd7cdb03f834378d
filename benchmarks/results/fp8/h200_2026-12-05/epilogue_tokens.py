"""The fused qkv epilogue over an fp8 pool by tokens a program (``block_tokens``): a decode step's slots
(each token in its own block) and a prefill's (consecutive tokens fill a block), Qwen3-0.6B shapes
(Hq 16 / Hkv 8, D 128, q/k norms), 28 launches a step with the pool donated, us a launch; the bf16 pool
at its default for scale. It times the kernel of ``epilogue_32_tokens.patch`` beside it (on today's
kernel, several tokens a program over an fp8 pool store the values as one token a program does). With
the patch applied, from the repository root, on a GPU (``epilogue_tokens.log``: the H200, 2026-12-05):

    SIZES=256,2048 BLOCK_TOKENS=1,32,64 python3 benchmarks/results/fp8/h200_2026-12-05/epilogue_tokens.py

``SIZES=256,1024,8192`` sets the step sizes. Each fp8 result is checked bitwise against one token a
program (the kernel's default below 33 tokens, checked against the XLA path by the tests).
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.kv_write import pool_shape
from jaxpaged.kernels.qkv_epilogue import qkv_epilogue, token_block
from jaxpaged.models.qwen import rope_cos_sin

HQ, HKV, D, L = 16, 8, 128, 28
INTERPRET = jax.default_backend() == "cpu"
SIZES = [int(x) for x in os.environ.get("SIZES", "256,1024,8192").split(",")]
BLOCKS = [int(x) for x in os.environ.get("BLOCK_TOKENS", "1,8,16,32,64").split(",")]


def inputs(t, prefill, bs, rng):
    parts = jnp.asarray(rng.standard_normal((1, t, (HQ + 2 * HKV) * D)), jnp.bfloat16)
    qn = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.bfloat16)
    kn = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 1000, t), jnp.int32), D, 1e6, jnp.bfloat16)
    blocks = t + 8
    if prefill:  # consecutive tokens fill a block, the blocks in random order
        n = np.arange(t)
        slots = rng.permutation(blocks)[n // bs] * bs + n % bs
    else:  # each token in its own block
        slots = rng.permutation(blocks)[:t] * bs + rng.integers(0, bs, t)
    return parts, qn, kn, cos, sin, jnp.asarray(slots, jnp.int32), blocks


def run(t, prefill, dtype, bs, block_tokens, reps=2 if INTERPRET else 30):
    parts, qn, kn, cos, sin, slots, blocks = inputs(t, prefill, bs, np.random.default_rng(t + prefill))

    def step(pool):
        for layer in range(L):
            _, pool = qkv_epilogue(parts, None, qn, kn, cos, sin, pool, layer % 2, slots, eps=1e-6,
                                   dtype=jnp.bfloat16, block_tokens=block_tokens, interpret=INTERPRET)
        return pool

    step = jax.jit(step, donate_argnums=0)
    pool = step(jnp.zeros(pool_shape(2, blocks, bs, HKV, D, dtype), dtype))
    jax.block_until_ready(pool)
    result = np.asarray(pool.astype(jnp.float32))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(4):
            pool = step(pool)
        jax.block_until_ready(pool)
        times.append((time.perf_counter() - t0) / 4 / L)
    return float(np.median(times)) * 1e6, result


rows = []
for t in SIZES:
    for prefill in (False, True):
        kind = "prefill" if prefill else "decode"
        bf16_us, _ = run(t, prefill, jnp.bfloat16, 16, None)
        print(f"{t:5d} {kind:8s} bf16 (default {token_block(t)}) {bf16_us:8.2f} us", flush=True)
        rows.append((t, kind, "bf16", None, bf16_us, ""))
        want = None
        for b in BLOCKS:
            us, got = run(t, prefill, jnp.float8_e4m3fn, 64, b)
            if want is None:
                want = got
            same = np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.nan_to_num(got), np.nan_to_num(want))
            print(f"{t:5d} {kind:8s} fp8 block_tokens {b:3d} {us:8.2f} us  {'equal' if same else 'DIFFERENT'}", flush=True)
            rows.append((t, kind, "fp8", b, us, "equal" if same else "DIFFERENT"))

print(f"\n{'tokens':>6s} {'slots':8s} {'pool':5s} {'tokens/program':>14s} {'us':>8s}")
for t, kind, dt, b, us, same in rows:
    print(f"{t:6d} {kind:8s} {dt:5s} {str(b if b else 'default'):>14s} {us:8.2f} {same}")
