"""Launch order of the warp-specialised prefill kernel, A/B in one process (H200, 2026-12-03): tile order
(KV-head-major grid, short causal tiles first), tiles reversed, reversed with a tile-major grid, and longest first
(argsort of kv_end). It passes `tile_order=`, an option `paged_prefill_mgpu` had while this ran (the engine at
9bf1282 plus that option); longest first with a tile-major grid is what the kernel now always does.
`python3 benchmarks/results/mosaic/launch_order/prefill_order.py`; output in prefill_order.log."""
import sys, functools
sys.path.insert(0, "benchmarks")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import _chain_simple, chain_time, timed, prefill_flops
from jaxpaged.kernels.paged_attention_mgpu_prefill import paged_prefill_mgpu

HQ, HKV, D, BS = 16, 8, 128, 16
ORDERS = ("natural", "reversed", "swap_reversed", "lpt")
def mk(order):
    return lambda q, pool, cu, kl, bt: paged_prefill_mgpu(q, pool, jnp.int32(0), cu, kl, bt, scale=D ** -0.5, interpret=None, block_kv=128, num_slots=2, tile_order=order)
table_rows = []
# single-sequence causal prefills
for T in (1024, 2048, 4096, 8192, 16384):
    kq, kk, kv = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(kq, (1, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, T, HKV, D), jnp.bfloat16)
    r = {"case": f"1x{T}"}
    fn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
    ref = fn(q, k, v)
    _, t = timed(lambda qq, kc, vc: _chain_simple(fn, qq, kc, vc, 8), (q, k, v), 5); r["cudnn"] = t / 8 * 1e6
    nb = T // BS
    pool = jnp.full((1, nb + 8, BS, 2, HKV, D), jnp.nan, jnp.bfloat16)
    perm = np.random.default_rng(T).permutation(nb + 8)[:nb].astype(np.int32)
    pool = pool.at[0, perm].set(jnp.stack([k[0].reshape(nb, BS, HKV, D), v[0].reshape(nb, BS, HKV, D)], axis=2))
    table = jnp.asarray(perm.reshape(1, nb))
    cu = jnp.array([0, T], jnp.int32); kl = jnp.array([T], jnp.int32)
    for o in ORDERS:
        f = mk(o)
        out = f(q[0], pool, cu, kl, table)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[0].astype(jnp.float32))))
        _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], cs[1], cs[2], tb), q[0], (pool, cu, kl), [table], 5, 8)
        r[o] = t * 1e6; r[o + "_err"] = err
    print("ROW", r, flush=True); table_rows.append(r)
# ragged: 8 sequences, mixed new lengths and cached prefixes (a chunked-prefill-like step)
rng = np.random.default_rng(0)
for name, news, prefs in (("ragged8", [2048, 128, 1024, 512, 3000, 64, 1500, 800], [0, 4096, 0, 2048, 0, 8000, 512, 0]),
                          ("ragged16x512", [512] * 16, [0] * 16)):
    S = len(news); kvl = [a + b for a, b in zip(news, prefs)]
    W = max(-(-x // BS) for x in kvl); N = sum(-(-x // BS) for x in kvl) + 16
    pool = jax.random.normal(jax.random.key(1), (1, N, BS, 2, HKV, D), jnp.bfloat16)
    perm = rng.permutation(N).astype(np.int32); tabs = np.zeros((S, W), np.int32); c = 0
    for i, x in enumerate(kvl):
        n = -(-x // BS); tabs[i, :n] = perm[c:c + n]; c += n
    T = sum(news); cu = jnp.asarray(np.concatenate([[0], np.cumsum(news)]).astype(np.int32)); kl = jnp.asarray(np.array(kvl, np.int32))
    q = jax.random.normal(jax.random.key(2), (T, HQ, D), jnp.bfloat16)
    table = jnp.asarray(tabs); r = {"case": name, "cudnn": float("nan")}
    base = None
    for o in ORDERS:
        f = mk(o)
        out = f(q, pool, cu, kl, table)
        if base is None: base = out
        r[o + "_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - base.astype(jnp.float32))))
        _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], cs[1], cs[2], tb), q, (pool, cu, kl), [table], 5, 8)
        r[o] = t * 1e6
    print("ROW", r, flush=True); table_rows.append(r)
print("\ncase | cudnn us | " + " | ".join(ORDERS) + " (us, x natural) | max err")
for r in table_rows:
    print(r["case"], f"{r['cudnn']:.1f}", " | ".join(f"{r[o]:.1f} ({r[o]/r['natural']:.3f})" for o in ORDERS), max(r[o + '_err'] for o in ORDERS))
