"""Decode A/B on the H200: the one-warpgroup Mosaic kernel with its shared-memory P tile (dead on the GPU, where P
goes to wgmma from registers) vs without it, and the Triton kernel; same pool and tables, block 16, Hq 16 / Hkv 8
/ D 128, chained calls as in check_attention_mgpu's sweep. From the repo root:
  git show 9e9c09f:kernels/paged_attention_mgpu.py > benchmarks/results/mosaic/decode_p_smem/mgpu_old.py
  python3 benchmarks/results/mosaic/decode_p_smem/decode_p_smem.py"""
import sys, math
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/results/mosaic/decode_p_smem")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import chain_time, rel_err
from jaxpaged.kernels.paged_attention import paged_attention
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu as new_k, choose_splits, kv_tile
from mgpu_old import paged_attention_mgpu as old_k
HQ, HKV, D, BS = 16, 8, 128, 16
FNS = {"old": lambda *a: old_k(*a), "new": lambda *a: new_k(*a), "triton": lambda *a: paged_attention(*a)}
batches, ctxs = (1, 8), (1024,)
need = max(b * c for b in batches for c in ctxs) // BS
pool_blocks = need + 1024
pool = jax.random.normal(jax.random.key(7), (1, pool_blocks, BS, 2, HKV, D), jnp.bfloat16)
rows = []
for b in batches:
    for ctx in ctxs:
        nb = ctx // BS
        kv_bytes = b * ctx * HKV * D * 2 * 2
        rot = max(1, min(8, pool_blocks // (b * nb), math.ceil(256e6 / kv_bytes)))
        perm = np.random.default_rng(b * 31 + ctx).permutation(pool_blocks)
        tables = [jnp.asarray(perm[r * b * nb:(r + 1) * b * nb].reshape(b, nb).astype(np.int32)) for r in range(rot)]
        q = jax.random.normal(jax.random.key(b + ctx), (b, HQ, D), jnp.bfloat16)
        cu = jnp.arange(b + 1, dtype=jnp.int32); kl = jnp.full((b,), ctx, jnp.int32)
        r = {"B": b, "ctx": ctx, "splits": choose_splits(b, b, HKV, kv_tile(BS), nb * BS, decode=True)}
        outs = {}
        for rep in range(1):
            for name, fn in FNS.items():
                outs[name] = jax.block_until_ready(fn(q, pool, 0, cu, kl, tables[0]))
                _, t = chain_time(lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb), q, (pool, cu, kl), tables, 5, 8)
                r[name] = min(r.get(name, 1e9), t * 1e6)
        r["err_new_vs_triton"] = rel_err(outs["new"], outs["triton"]); r["new_eq_old"] = bool(jnp.array_equal(outs["new"], outs["old"]))
        print("ROW", r, flush=True); rows.append(r)
print("\nB ctx splits | old us | new us | triton us | new/old | new/triton | old/triton | rel err vs triton | new==old")
for r in rows:
    print(r["B"], r["ctx"], r["splits"], f"{r['old']:.1f} {r['new']:.1f} {r['triton']:.1f} {r['new']/r['old']:.3f} {r['new']/r['triton']:.3f} {r['old']/r['triton']:.3f} {r['err_new_vs_triton']:.1e} {r['new_eq_old']}")
