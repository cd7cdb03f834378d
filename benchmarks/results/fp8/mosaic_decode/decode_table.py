"""fp8 decode attention on Mosaic GPU (kernels/paged_attention_mgpu_decode.py) against both kernels over
bf16 pools: correctness cases first (e4m3 and e5m2), then chained timings with the read ceiling
measured in the same process. From the repository root:

    python3 benchmarks/results/fp8/mosaic_decode/decode_table.py

``decode_table.log`` is its output; ``SLOTS3=1`` adds the kernel with three slots; ``ROWS=256x256,...``
times those shapes only. With ``NCU=1`` it only runs the fp8 kernel once at 256 x 1,024,
for ``ncu --clock-control none -k regex:mosaic --section LaunchStats --section Occupancy``
(``decode_table_ncu.log``: registers and occupancy).
"""
import sys, os, time, json
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "tests/kernels"); sys.path.insert(0, "tests")
import numpy as np, jax, jax.numpy as jnp
from check_fp8_kv import random_fp8_case
from bench_attention import chain_time, hbm_read_ceiling
from jaxpaged.kernels.paged_attention import paged_attention
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference as reference
import jaxpaged.kernels.paged_attention_mgpu as M
from jaxpaged.kernels.paged_attention_mgpu_decode import paged_decode_fp8_mgpu
from test_fp8 import fp8_pool, E4M3, E5M2
from test_reference import random_batch

def new(q, pool, cu, kl, tb, splits=None, slots=2):
    bs = M.block_size_of(pool)
    s = splits or M.choose_splits(q.shape[0], kl.shape[0], pool.shape[4], bs, tb.shape[1] * bs, True)
    return paged_decode_fp8_mgpu(q, pool, jnp.int32(0), cu, kl, tb, scale=q.shape[-1] ** -0.5, interpret=None, num_slots=slots, num_splits=s)

if os.environ.get("NCU"):
    fp8_64, _ = random_fp8_case(np.random.default_rng(1), 256, 1024, 64, 16, 8, 128, E4M3)
    q, p8, _, cu, kl, tb8 = fp8_64
    jax.block_until_ready(new(q, p8, cu, kl, tb8))
    sys.exit(0)

print("== correctness (rel err vs fp32-dequantised reference)", flush=True)
cases = [([1] * 6, [1, 63, 64, 65, 300, 1000], 64, 16, 8, 128, E4M3),
         ([1] * 5, [7, 64, 129, 500, 2000], 64, 28, 4, 128, E4M3),   # G = 7 (Qwen2.5-7B)
         ([1] * 4, [1, 127, 300, 900], 128, 8, 1, 128, E5M2),          # MQA, blocks of 128
         ([1] * 4, [5, 64, 200, 700], 64, 16, 2, 64, E4M3)]            # G = 8, D 64
for i, (ql, kvl, bs, hq, hkv, d, fp8) in enumerate(cases):
    rng = np.random.default_rng(10 + i)
    q, k, v, cu, kl, tables = random_batch(rng, ql, kvl, bs, hq, hkv, d)
    v = v * np.exp(2 * rng.standard_normal((k.shape[0], bs, 1, 1)))
    args = (jnp.asarray(q * 50, jnp.bfloat16), fp8_pool(k * 3, v, fp8, 1, 0), 0, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables))
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(reference(*args), np.float32)
    for name, fn in [("decode", lambda s: new(args[0], args[1], args[3], args[4], args[5], s))]:
        for s in (1, 2, 8):
            got = np.asarray(fn(s), np.float32)
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            print(f"case {i} {name} splits {s}: finite {np.all(np.isfinite(got))} rel {rel:.2e} pad0 {np.all(got[cu[-1]:] == 0)}", flush=True)

ceil = hbm_read_ceiling(False) / 1e12
print(f"ceiling {ceil:.2f} TB/s", flush=True)
rows = []
rng = np.random.default_rng(1)
shapes = [(256, 1024), (64, 1024), (64, 4096), (8, 4096), (1, 1024), (256, 256)]
if os.environ.get("ROWS"):  # e.g. ROWS=256x256,8x4096: only those timings
    shapes = [tuple(int(x) for x in r.split("x")) for r in os.environ["ROWS"].split(",")]
for s_, ctx in shapes:
    fp8_64, _ = random_fp8_case(rng, s_, ctx, 64, 16, 8, 128, E4M3)
    _, bf16_16 = random_fp8_case(rng, s_, ctx, 16, 16, 8, 128, E4M3)
    q, p8, _, cu, kl, tb8 = fp8_64
    _, p16, _, _, _, tb16 = bf16_16
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(reference(*fp8_64), np.float32)
    variants = [("triton bf16", lambda qq, p, tb: paged_attention(qq, p, 0, cu, kl, tb), p16, tb16),
                ("mosaic bf16", lambda qq, p, tb: M.paged_attention_mgpu(qq, p, 0, cu, kl, tb), p16, tb16),
                ("mosaic decode fp8", lambda qq, p, tb: new(qq, p, cu, kl, tb), p8, tb8)]
    if os.environ.get("SLOTS3"):  # the same kernel with three fp8 slots in flight
        variants.append(("mosaic decode fp8 3 slots", lambda qq, p, tb: new(qq, p, cu, kl, tb, slots=3), p8, tb8))
    for name, call, pool, tb in variants:
        try:
            _, t = chain_time(call, q, pool, [tb], reps=30, chain=8)
            err = float("nan")
            if "fp8" in name:
                got = np.asarray(call(q, pool, tb), np.float32)
                err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            byts = s_ * ctx * 2 * 8 * 128 * (65 / 64 if "fp8" in name else 2)
            rows.append((f"{s_}x{ctx}", name, t * 1e6, byts / t / 1e12 / ceil, err)); print(rows[-1], flush=True)
        except Exception as e:
            print(f"{s_}x{ctx}", name, "FAILED", str(e)[:400], flush=True)
print(f"\nceiling {ceil:.2f} TB/s")
for r in rows: print("%-9s %-24s %8.1f us  %5.0f%% of ceiling  rel err %.2g" % (r[0], r[1], r[2], 100 * r[3], r[4]))
