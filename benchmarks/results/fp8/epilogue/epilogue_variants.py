"""Where the fused qkv epilogue's time goes over an fp8 pool: one decode step's 28 launches at Qwen3-0.6B
shapes (256 tokens, Hq 16 / Hkv 8, D 128, q/k norms), each token in its own block, the pool donated
and fed back (no copies), us a launch. Variants from ``epilogue_variants_kernel.py`` (a copy of
kernels/qkv_epilogue.py with switches on its fp8 write). From the repository root, on a GPU:

    python3 benchmarks/results/fp8/epilogue/epilogue_variants.py

``TOKENS=n`` sets the tokens, ``PREFILL=1`` gives them a prefill's slots (consecutive tokens in a
block), ``ONLY=a,b`` keeps the rows whose names contain ``a`` or ``b``.
"""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np, jax, jax.numpy as jnp
import epilogue_variants_kernel as V
from jaxpaged.kernels import qkv_epilogue as E
from jaxpaged.kernels.kv_write import pool_shape
from jaxpaged.models.qwen import rope_cos_sin

T, HQ, HKV, D, L = int(os.environ.get("TOKENS", 256)), 16, 8, 128, int(os.environ.get("LAUNCHES", 28))
PREFILL = bool(os.environ.get("PREFILL"))  # the slots of one long prefill instead of a decode step's
INTERPRET = jax.default_backend() == "cpu"  # (a check of the script itself, on a CPU)
rng = np.random.default_rng(0)
parts = jnp.asarray(rng.standard_normal((1, T, (HQ + 2 * HKV) * D)), jnp.bfloat16)
qn = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.bfloat16)
kn = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.bfloat16)
positions = jnp.asarray(rng.integers(0, 1000, T), jnp.int32)
cos, sin = rope_cos_sin(positions, D, 1e6, jnp.bfloat16)


def run(name, fn, dtype, bs, reps=2 if INTERPRET else 50):
    blocks = T + 8
    if PREFILL:  # a prefill's slots: consecutive tokens fill a block, blocks in random order
        t = np.arange(T)
        slots = jnp.asarray(rng.permutation(blocks)[t // bs] * bs + t % bs, jnp.int32)
    else:  # a decode step's: each token in its own block
        slots = jnp.asarray(rng.permutation(blocks)[:T] * bs + rng.integers(0, bs, T), jnp.int32)
    pool = jnp.zeros(pool_shape(2, blocks, bs, HKV, D, dtype), dtype)

    def step(pool):
        qs = []
        for layer in range(L):
            q, pool = fn(parts, None, qn, kn, cos, sin, pool, layer % 2, slots, eps=1e-6, dtype=jnp.bfloat16,
                          interpret=INTERPRET)
            qs.append(q[0, 0, 0])
        return pool, jnp.stack(qs)

    step = jax.jit(step, donate_argnums=0)
    pool, _ = step(pool)
    jax.block_until_ready(pool)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(4):
            pool, _ = step(pool)
        jax.block_until_ready(pool)
        times.append((time.perf_counter() - t) / 4 / L)
    us = float(np.median(times)) * 1e6
    print(f"{name:40s} {us:7.2f} us a launch", flush=True)
    return us


fp8 = jnp.float8_e4m3fn
rows = [("bf16 pool, block 16", E.qkv_epilogue, jnp.bfloat16, 16, {}),
        ("fp8 pool, block 64 (the kernel)", E.qkv_epilogue, fp8, 64, {}),
        ("fp8: V stored where K goes (no scatter)", V.qkv_epilogue, fp8, 64, dict(v_contig=True)),
        ("fp8: no scale stores", V.qkv_epilogue, fp8, 64, dict(no_scales=True)),
        ("fp8: no quantisation (astype)", V.qkv_epilogue, fp8, 64, dict(no_quant=True)),
        ("fp8: all three", V.qkv_epilogue, fp8, 64, dict(v_contig=True, no_scales=True, no_quant=True)),
        ("fp8 pool, block 16", E.qkv_epilogue, fp8, 16, {}),
        ("fp8, one token a program", E.qkv_epilogue, fp8, 64, dict(block_tokens=1)),
        ("fp8: writes under pl.when (q programs skip them)", V.qkv_epilogue, fp8, 64, dict(guard=True)),
        ("fp8: separate K and V programs", V.qkv_epilogue, fp8, 64, dict(split_v=True)),
        ("fp8: separate K and V programs, one token each", V.qkv_epilogue, fp8, 64, dict(split_v=True, block_tokens=1)),
        ("fp8: separate K and V programs, 16 tokens each", V.qkv_epilogue, fp8, 64, dict(split_v=True, block_tokens=16))]
if os.environ.get("ONLY"):
    rows = [r for r in rows if any(w in r[0] for w in os.environ["ONLY"].split(","))]
def same_as_kernel(kw, bs=64):
    """Whether a variant writes the same pool and q as the kernel (one launch on a fresh pool)."""
    blocks = T + 8
    slots = jnp.asarray(rng.permutation(blocks)[:T] * bs + rng.integers(0, bs, T), jnp.int32)
    pool = jnp.full(pool_shape(2, blocks, bs, HKV, D, fp8), jnp.nan, fp8)
    args = (parts, None, qn, kn, cos, sin, pool, 1, slots)
    q0, p0 = E.qkv_epilogue(*args, eps=1e-6, dtype=jnp.bfloat16, interpret=INTERPRET)
    q1, p1 = V.qkv_epilogue(*args, eps=1e-6, dtype=jnp.bfloat16, interpret=INTERPRET, **kw)
    as_bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))  # noqa: E731
    return bool(np.array_equal(np.asarray(q0), np.asarray(q1)) and np.array_equal(as_bits(p0), as_bits(p1)))


out = []
for name, mod, dtype, bs, kw in rows:
    if "guard" in kw or "split_v" in kw:
        print(f"{name}: same pool and q as the kernel: {same_as_kernel(kw)}", flush=True)
    fn = lambda *a, **k: mod(*a, **k, **kw)  # noqa: E731
    try:
        out.append((name, run(name, fn, dtype, bs)))
    except Exception as e:
        print(name, "FAILED", str(e)[:300], flush=True)
print(f"\nqkv epilogue, {T} tokens{' (a prefill)' if PREFILL else ''}, Qwen3-0.6B shapes, us a launch (median of 50 x 4 steps of {L} launches)")
for name, us in out:
    print(f"| {name} | {us:.2f} |")
