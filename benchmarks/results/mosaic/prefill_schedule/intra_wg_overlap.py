"""Prefill A/B on the H200: the engine's warp-specialised kernel vs the same kernel with FA3's intra-warpgroup
overlap (S of tile t issued before P V of tile t-1, softmax while P V runs), cuDNN in the same process; max abs
errors vs cuDNN. (Its ragged cases ran out of memory in the reference's einsum, a fault of this script, after
the 1-16k rows.) The variant is intra_wg_overlap.patch over the kernel at 9e9c09f; from the repo root:
  git show 9e9c09f:kernels/paged_attention_mgpu_prefill.py > benchmarks/results/mosaic/prefill_schedule/intra_wg_overlap_kernel.py
  patch benchmarks/results/mosaic/prefill_schedule/intra_wg_overlap_kernel.py benchmarks/results/mosaic/prefill_schedule/intra_wg_overlap.patch
  python3 benchmarks/results/mosaic/prefill_schedule/intra_wg_overlap.py"""
import sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/results/mosaic/prefill_schedule")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import _chain_simple, chain_time, timed
from jaxpaged.kernels.paged_attention_mgpu_prefill import paged_prefill_mgpu as base_kernel
from intra_wg_overlap_kernel import paged_prefill_mgpu as overlap_kernel
HQ, HKV, D, BS = 16, 8, 128, 16
V = {"base": base_kernel, "overlap": overlap_kernel}
def mk(k):
    return lambda q, pool, cu, kl, bt: k(q, pool, jnp.int32(0), cu, kl, bt, scale=D ** -0.5, interpret=None, block_kv=128, num_slots=2)
rows = []
for T in (1024, 2048, 4096, 8192, 16384):
    kq, kk, kv = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(kq, (1, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, T, HKV, D), jnp.bfloat16)
    fn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
    ref = fn(q, k, v)
    _, t = timed(lambda qq, kc, vc: _chain_simple(fn, qq, kc, vc, 8), (q, k, v), 5)
    r = {"case": f"1x{T}", "cudnn": t / 8 * 1e6}
    nb = T // BS
    pool = jnp.full((1, nb + 8, BS, 2, HKV, D), jnp.nan, jnp.bfloat16)
    perm = np.random.default_rng(T).permutation(nb + 8)[:nb].astype(np.int32)
    pool = pool.at[0, perm].set(jnp.stack([k[0].reshape(nb, BS, HKV, D), v[0].reshape(nb, BS, HKV, D)], axis=2))
    table = jnp.asarray(perm.reshape(1, nb)); cu = jnp.array([0, T], jnp.int32); kl = jnp.array([T], jnp.int32)
    for name, kern in V.items():
        f = mk(kern)
        out = f(q[0], pool, cu, kl, table)
        r[name + "_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[0].astype(jnp.float32))))
        _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], cs[1], cs[2], tb), q[0], (pool, cu, kl), [table], 5, 8)
        r[name] = t * 1e6
    print("ROW", r, flush=True); rows.append(r)
rng = np.random.default_rng(0)
for name_, news, prefs in (("ragged8", [2048, 128, 1024, 512, 3000, 64, 1500, 800], [0, 4096, 0, 2048, 0, 8000, 512, 0]),
                           ("odd", [70, 1, 129, 333], [0, 50, 7, 1000])):
    S = len(news); kvl = [a + b for a, b in zip(news, prefs)]
    W = max(-(-x // BS) for x in kvl); N = sum(-(-x // BS) for x in kvl) + 16
    pool = jax.random.normal(jax.random.key(1), (1, N, BS, 2, HKV, D), jnp.bfloat16)
    pool = pool.at[0, -8:].set(jnp.nan)  # stale blocks
    perm = rng.permutation(N - 8).astype(np.int32); tabs = np.zeros((S, W), np.int32); c = 0
    for i, x in enumerate(kvl):
        n = -(-x // BS); tabs[i, :n] = perm[c:c + n]; c += n
    T = sum(news); cu = jnp.asarray(np.concatenate([[0], np.cumsum(news)]).astype(np.int32)); kl = jnp.asarray(np.array(kvl, np.int32))
    q = jax.random.normal(jax.random.key(2), (T, HQ, D), jnp.bfloat16); table = jnp.asarray(tabs)
    from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
    ref = paged_attention_reference(q, pool, 0, cu, kl, table)
    r = {"case": name_, "cudnn": float("nan")}
    for name, kern in V.items():
        f = mk(kern)
        out = f(q, pool, cu, kl, table)
        r[name + "_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], cs[1], cs[2], tb), q, (pool, cu, kl), [table], 5, 8)
        r[name] = t * 1e6
    print("ROW", r, flush=True); rows.append(r)
print("\ncase | cudnn us | base us | overlap us | overlap/base | overlap/cudnn | err base | err overlap")
for r in rows:
    print(r["case"], f"| {r['cudnn']:.1f} | {r['base']:.1f} | {r['overlap']:.1f} | {r['overlap']/r['base']:.3f} | {r['overlap']/r['cudnn']:.3f} | {r['base_err']:.3g} | {r['overlap_err']:.3g}")
