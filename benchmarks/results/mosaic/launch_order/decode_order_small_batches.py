"""Decode launch order at small batches: tile order, longest first by argsort, and longest first by a rank
computed without a sort, Triton beside (H200, 2026-12-03). It sets `paged_attention_mgpu.ORDER`, a switch the
module had while this ran (15f46b6 plus that switch). Output in decode_order_small_batches.log: the sort cost
2-9 us at 1-8 sequences, which is why split-K launches and launches of at most one program per SM keep tile order."""
import sys
sys.path.insert(0, "benchmarks")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import chain_time
import jaxpaged.kernels.paged_attention_mgpu as M
from jaxpaged.kernels.paged_attention import paged_attention
HQ, HKV, D, BS = 16, 8, 128, 16
V = ("natural", "sort", "rank", "triton")
rows = []
for name, B, lo, hi in (("B1 =1024", 1, 1024, 1024), ("B1 =4096", 1, 4096, 4096), ("B8 =1024", 8, 1024, 1024), ("B64 U[64,8192]", 64, 64, 8192), ("B256 U[64,2048]", 256, 64, 2048)):
    rng = np.random.default_rng(B + hi)
    kvl = rng.integers(lo, hi + 1, B).astype(np.int32)
    W = int(-(-kvl.max() // BS)); N = int(sum(-(-x // BS) for x in kvl)) + 8
    pool = jax.random.normal(jax.random.key(1), (1, N, BS, 2, HKV, D), jnp.bfloat16)
    perm = rng.permutation(N).astype(np.int32); tabs = np.zeros((B, W), np.int32); c = 0
    for i, x in enumerate(kvl):
        n = -(-int(x) // BS); tabs[i, :n] = perm[c:c + n]; c += n
    cu = jnp.arange(B + 1, dtype=jnp.int32); kl = jnp.asarray(kvl); table = jnp.asarray(tabs)
    q = jax.random.normal(jax.random.key(2), (B, HQ, D), jnp.bfloat16)
    r = {"case": name}; outs = {}
    for var in V:
        if var == "triton":
            f = paged_attention
        else:
            M.ORDER = var; jax.clear_caches(); f = M.paged_attention_mgpu
        outs[var] = f(q, pool, 0, cu, kl, table)
        _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], 0, cs[1], cs[2], tb), q, (pool, cu, kl), [table], 7, 8)
        r[var] = t * 1e6
    r["err"] = max(float(jnp.max(jnp.abs(outs[v].astype(jnp.float32) - outs["natural"].astype(jnp.float32)))) for v in ("sort", "rank"))
    print("ROW", r, flush=True); rows.append(r)
print("\ncase | " + " | ".join(V) + " | err")
for r in rows:
    print(r["case"], "|", " | ".join(f"{r[v]:.1f}" for v in V), "|", r["err"])
