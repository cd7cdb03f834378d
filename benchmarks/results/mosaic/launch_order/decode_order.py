"""Launch order of the one-warpgroup (decode) kernel, tile order vs longest first, ragged and uniform decode
batches, Triton beside (H200, 2026-12-03). It sets `paged_attention_mgpu.LPT`, a switch the module had while this
ran (15f46b6 plus that switch). Output in decode_order.log."""
import sys
sys.path.insert(0, "benchmarks")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import chain_time
import jaxpaged.kernels.paged_attention_mgpu as M
from jaxpaged.kernels.paged_attention import paged_attention
HQ, HKV, D, BS = 16, 8, 128, 16
rows = []
for name, B, lo, hi in (("B256 U[64,2048]", 256, 64, 2048), ("B64 U[64,8192]", 64, 64, 8192), ("B8 U[256,16384]", 8, 256, 16384),
                        ("B32 U[64,4096]", 32, 64, 4096), ("B64 =1024", 64, 1024, 1024), ("B256 =1024", 256, 1024, 1024)):
    rng = np.random.default_rng(B + hi)
    kvl = rng.integers(lo, hi + 1, B).astype(np.int32)
    W = int(-(-kvl.max() // BS)); N = int(sum(-(-x // BS) for x in kvl)) + 8
    pool = jax.random.normal(jax.random.key(1), (1, N, BS, 2, HKV, D), jnp.bfloat16)
    perm = rng.permutation(N).astype(np.int32); tabs = np.zeros((B, W), np.int32); c = 0
    for i, x in enumerate(kvl):
        n = -(-int(x) // BS); tabs[i, :n] = perm[c:c + n]; c += n
    cu = jnp.arange(B + 1, dtype=jnp.int32); kl = jnp.asarray(kvl); table = jnp.asarray(tabs)
    q = jax.random.normal(jax.random.key(2), (B, HQ, D), jnp.bfloat16)
    r = {"case": name}
    outs = {}
    for var in ("natural", "lpt", "triton"):
        if var == "triton":
            f = paged_attention
        else:
            M.LPT = var == "lpt"; jax.clear_caches(); f = M.paged_attention_mgpu
        outs[var] = f(q, pool, 0, cu, kl, table)
        _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], 0, cs[1], cs[2], tb), q, (pool, cu, kl), [table], 7, 8)
        r[var] = t * 1e6
    r["err"] = float(jnp.max(jnp.abs(outs["lpt"].astype(jnp.float32) - outs["natural"].astype(jnp.float32))))
    r["err_tr"] = float(jnp.max(jnp.abs(outs["lpt"].astype(jnp.float32) - outs["triton"].astype(jnp.float32))))
    print("ROW", r, flush=True); rows.append(r)
M.LPT = True; jax.clear_caches()
print("\ncase | natural us | lpt us (x natural) | triton us | lpt/triton | err lpt-natural | err lpt-triton")
for r in rows:
    print(f"{r['case']} | {r['natural']:.1f} | {r['lpt']:.1f} ({r['lpt']/r['natural']:.3f}) | {r['triton']:.1f} | {r['lpt']/r['triton']:.3f} | {r['err']:.2g} | {r['err_tr']:.2g}")
