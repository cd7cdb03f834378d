"""Prefill knobs on the H200 (run from the repo root): the warp-specialised kernel with 2 or 3 K/V slots, KV tiles of 128 or 192, over
pools of block size 16 or 64; cuDNN in the same process. Causal, 2k-16k tokens, Hq 16 / Hkv 8 / D 128."""
import sys
sys.path.insert(0, "benchmarks")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import _chain_simple, chain_time, timed
from jaxpaged.kernels.paged_attention_mgpu_prefill import paged_prefill_mgpu
HQ, HKV, D = 16, 8, 128
VARIANTS = [(16, 128, 2), (16, 128, 3), (64, 128, 2), (64, 128, 3), (16, 192, 2), (64, 192, 2)]  # (block size, block_kv, slots)
rows = []
for T in (2048, 4096, 8192, 16384):
    kq, kk, kv = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(kq, (1, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, T, HKV, D), jnp.bfloat16)
    fn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
    ref = fn(q, k, v)
    _, t = timed(lambda qq, kc, vc: _chain_simple(fn, qq, kc, vc, 8), (q, k, v), 5)
    r = {"T": T, "cudnn": t / 8 * 1e6}
    for bs, bkv, slots in VARIANTS:
        name = f"bs{bs}_kv{bkv}_s{slots}"
        try:
            nb = T // bs
            pool = jnp.full((1, nb + 8, bs, 2, HKV, D), jnp.nan, jnp.bfloat16)
            perm = np.random.default_rng(T).permutation(nb + 8)[:nb].astype(np.int32)
            pool = pool.at[0, perm].set(jnp.stack([k[0].reshape(nb, bs, HKV, D), v[0].reshape(nb, bs, HKV, D)], axis=2))
            table = jnp.asarray(perm.reshape(1, nb)); cu = jnp.array([0, T], jnp.int32); kl = jnp.array([T], jnp.int32)
            f = lambda qq, pl_, cu_, kl_, tb, bkv=bkv, slots=slots: paged_prefill_mgpu(
                qq, pl_, jnp.int32(0), cu_, kl_, tb, scale=D ** -0.5, interpret=None, block_kv=bkv, num_slots=slots)
            out = f(q[0], pool, cu, kl, table)
            r[name + "_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[0].astype(jnp.float32))))
            _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], cs[1], cs[2], tb), q[0], (pool, cu, kl), [table], 5, 8)
            r[name] = t * 1e6
        except Exception as ex:
            print(name, T, "FAILED", type(ex).__name__, str(ex)[:300], flush=True)
    print("ROW", r, flush=True); rows.append(r)
names = [f"bs{bs}_kv{bkv}_s{s}" for bs, bkv, s in VARIANTS]
print("\nT | cudnn us | " + " | ".join(names) + "   (us, x cuDNN, max err)")
for r in rows:
    print(r["T"], f"{r['cudnn']:.1f}", " ".join(f"{n}={r.get(n, float('nan')):.1f}({r.get(n, float('nan')) / r['cudnn']:.3f}x,{r.get(n + '_err', float('nan')):.4f})" for n in names))
