"""Prefill A/B on the H200: the kernel with the softmax scale folded into exp2's argument (one FMA a score) vs
the kernel before (fa620c9), cuDNN in the same process, two alternating runs each; max abs errors vs cuDNN.
From the repo root:
  git show fa620c9:kernels/paged_attention_mgpu_prefill.py > benchmarks/results/mosaic/prefill_schedule/prefill_base.py
  python3 benchmarks/results/mosaic/prefill_schedule/softmax_fma.py"""
import os, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/results/mosaic/prefill_schedule")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import _chain_simple, chain_time, timed
from jaxpaged.kernels.paged_attention_mgpu_prefill import paged_prefill_mgpu as new_kernel
from prefill_base import paged_prefill_mgpu as base_kernel
HQ, HKV, D, BS = 16, 8, 128, 16
V = {"base": base_kernel, "fma": new_kernel}
def mk(k):
    return lambda q, pool, cu, kl, bt: k(q, pool, jnp.int32(0), cu, kl, bt, scale=D ** -0.5, interpret=None, block_kv=128, num_slots=2)
rows = []
for T in (2048, 4096, 8192, 16384):
    kq, kk, kv = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(kq, (1, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, T, HKV, D), jnp.bfloat16)
    fn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
    ref = fn(q, k, v)
    r = {"case": f"1x{T}"}
    nb = T // BS
    pool = jnp.full((1, nb + 8, BS, 2, HKV, D), jnp.nan, jnp.bfloat16)
    perm = np.random.default_rng(T).permutation(nb + 8)[:nb].astype(np.int32)
    pool = pool.at[0, perm].set(jnp.stack([k[0].reshape(nb, BS, HKV, D), v[0].reshape(nb, BS, HKV, D)], axis=2))
    table = jnp.asarray(perm.reshape(1, nb)); cu = jnp.array([0, T], jnp.int32); kl = jnp.array([T], jnp.int32)
    for rep in range(2):
        _, t = timed(lambda qq, kc, vc: _chain_simple(fn, qq, kc, vc, 8), (q, k, v), 5)
        r.setdefault("cudnn", []).append(round(t / 8 * 1e6, 1))
        for name, kern in V.items():
            f = mk(kern)
            out = f(q[0], pool, cu, kl, table)
            r[name + "_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[0].astype(jnp.float32))))
            _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], cs[1], cs[2], tb), q[0], (pool, cu, kl), [table], 5, 8)
            r.setdefault(name, []).append(round(t * 1e6, 1))
    print("ROW", r, flush=True); rows.append(r)
print("\n=== prefill us (two runs each, alternating): base | fma | cudnn | fma/base | fma/cudnn")
for r in rows:
    b, f, c = min(r["base"]), min(r["fma"]), min(r["cudnn"])
    print(f"{r['case']:>8} | {r['base']} | {r['fma']} | {r['cudnn']} | {f / b:.3f} | {f / c:.3f} | err {r['base_err']:.1e} {r['fma_err']:.1e}")
