"""Decode A/B on the H200: the Mosaic decode kernel with queries and outputs relaid into tiles (02b4a47's,
`git show 02b4a47:kernels/paged_attention_mgpu.py > .gpu/mgpu_tiles.py`) vs read and written in place
(the working tree), the same with the Triton kernel's split-K rule where it differs, and the Triton kernel;
same pool and tables, block 16, Hq 16 / Hkv 8 / D 128. Chained calls as in check_attention_mgpu's sweep;
errors vs Triton. Run from the repository root: python3 benchmarks/results/mosaic/decode_token_order/decode_ab.py"""
import sys, math
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".gpu")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import chain_time, rel_err
from jaxpaged.kernels.paged_attention import paged_attention
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu as new_k, choose_splits, kv_tile
from jaxpaged.kernels.split_k import decode_splits
from jaxpaged.kernels.shapes import num_cores
from mgpu_tiles import paged_attention_mgpu as old_k
HQ, HKV, D, BS = 16, 8, 128, 16
FNS = {"old": lambda *a: old_k(*a), "new": lambda *a: new_k(*a), "triton": lambda *a: paged_attention(*a)}
batches, ctxs = (1, 8, 64, 256), (256, 1024, 4096)
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
        fns = dict(FNS)
        r["triton_rule"] = decode_splits(b, b, HKV, kv_tile(BS), nb * BS, num_cores())
        if r["triton_rule"] != r["splits"]:
            fns["at_triton_splits"] = lambda *a, p=r["triton_rule"]: new_k(*a, num_splits=p)
        for rep in range(1):
            for name, fn in fns.items():
                outs[name] = jax.block_until_ready(fn(q, pool, 0, cu, kl, tables[0]))
                _, t = chain_time(lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb), q, (pool, cu, kl), tables, 5, 8)
                r[name] = min(r.get(name, 1e9), t * 1e6)
        r["err_new_vs_triton"] = rel_err(outs["new"], outs["triton"]); r["new_eq_old"] = bool(jnp.array_equal(outs["new"], outs["old"]))
        print("ROW", r, flush=True); rows.append(r)
print("\nB ctx splits | tiles us | token order us | token order, Triton's split rule us | triton us | token/tiles | token/triton | token at Triton's rule/triton | tiles/triton | rel err vs triton | token==tiles")
for r in rows:
    hv = r.get("at_triton_splits", float("nan"))
    print(r["B"], r["ctx"], r["splits"], f"{r['old']:.1f} {r['new']:.1f} {hv:.1f} {r['triton']:.1f} {r['new']/r['old']:.3f} {r['new']/r['triton']:.3f} {hv/r['triton']:.3f} {r['old']/r['triton']:.3f} {r['err_new_vs_triton']:.1e} {r['new_eq_old']}")
