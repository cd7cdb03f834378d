"""fp8 pools (e4m3, block 64), Hq 16 / Hkv 8 / D 128: decode-shaped launches holding a prompt chunk, and pure
decode. auto (the fp8 decode kernel: a token a program), tiles (the one-warpgroup kernel, block_q 32),
prefill (decode=False), triton (over the same fp8 pool). Chained us (8 launches a jit); max diff vs triton.

Run from the repository root: python3 benchmarks/results/mosaic/decode_tiles/fp8_chunks.py
"""
import sys, warnings
sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import chain_time, random_paged_batch
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu
from jaxpaged.kernels.paged_attention import paged_attention as triton
from jaxpaged.kernels.fp8 import quantize_pool
V = {"auto": lambda *a: paged_attention_mgpu(*a), "tiles": lambda *a: paged_attention_mgpu(*a, block_q=32),
     "prefill": lambda *a: paged_attention_mgpu(*a, decode=False), "triton": lambda *a: triton(*a)}
CASES = [("chunk", [256] + [0] * 255, [4096] + [0] * 255, 256), ("chunk", [512] + [0] * 255, [16384] + [0] * 255, 512),
         ("decode", [1] * 64, [1023] * 64, 64), ("decode", [1] * 256, [1023] * 256, 256)]
rows = []
for fam, ql, pre, T in CASES:
    q, pool, cu, kl, tb = random_paged_batch(ql, pre, 16, 8, 128, 64, T)
    pool = jax.jit(quantize_pool, static_argnums=1)(pool, jnp.float8_e4m3fn)
    res, outs = {}, {}
    for n, fn in V.items():
        if fam == "decode" and n == "prefill":
            continue
        f = lambda qq, cs, t, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], t)
        try:
            outs[n] = np.asarray(jax.block_until_ready(jax.jit(f)(q, (pool, cu, kl), tb)), np.float32)
            res[n] = chain_time(f, q, (pool, cu, kl), [tb], 5, 8)[1] * 1e6
        except Exception as e:  # noqa: BLE001
            print("FAILED", n, type(e).__name__, str(e)[:200], flush=True)
    d = {k: float(np.max(np.abs(v - outs["triton"]))) for k, v in outs.items()}
    label = f"{fam} {ql[0]}+{pre[0]} S{len(ql)}"
    print(label, {k: f"{v:.1f}" for k, v in res.items()}, {k: f"{v:.1e}" for k, v in d.items()}, flush=True)
