"""Where the Mosaic GPU kernel's fp8 decode time goes: the kernel with switches (``ab_switches.patch``
applied to kernels/paged_attention_mgpu.py: ``nodeq`` skips converting the fp8 tiles to f16, ``noscale``
uses scales of 1, ``u2`` loads the fp8 tiles in the UPCAST_2X layout), slots in flight, and pools of
block size 64 and 128 against the Triton kernel and both kernels over bf16 pools; decode, Hq 16 / Hkv 8
/ D 128, chained timing. From the repository root, with the patch applied:

    python3 benchmarks/results/fp8/mosaic/fp8_ab.py

``ab_switches.log`` is this harness with the switch variants and 1-3 slots (its rows name them);
``ab_block128.log`` is this file as it stands.
"""
import sys, os, json
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
from check_fp8_kv import random_fp8_case
from bench_attention import chain_time
from jaxpaged.kernels.paged_attention import paged_attention
import jaxpaged.kernels.paged_attention_mgpu as M
rng = np.random.default_rng(1)
rows = []
for s_, ctx in [(256, 1024), (64, 4096)]:
    fp8_64, _ = random_fp8_case(rng, s_, ctx, 64, 16, 8, 128, jnp.float8_e4m3fn)
    fp8_128, _ = random_fp8_case(rng, s_, ctx, 128, 16, 8, 128, jnp.float8_e4m3fn)
    _, bf16_16 = random_fp8_case(rng, s_, ctx, 16, 16, 8, 128, jnp.float8_e4m3fn)
    with jax.default_matmul_precision("highest"):
        from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
        ref = np.asarray(paged_attention_reference(*fp8_128), np.float32)
    for name, args, ab, kern in [("triton bf16", bf16_16, set(), "t"), ("mosaic bf16", bf16_16, set(), "m"),
                               ("triton fp8 bs64", fp8_64, set(), "t"), ("triton fp8 bs128", fp8_128, set(), "t"),
                               ("mosaic fp8 bs64", fp8_64, set(), "m"), ("mosaic fp8 bs128", fp8_128, set(), "m"),
                               ("mosaic fp8 bs128 noscale", fp8_128, {"noscale"}, "m"),
                               ("mosaic fp8 bs128 nodeq noscale", fp8_128, {"nodeq", "noscale"}, "m")]:
        M._AB.clear(); M._AB.update(ab); jax.clear_caches()
        q, pool, layer, cu, kl, tables = args
        try:
            if kern == "m":
                call = lambda qq, p, tb: M.paged_attention_mgpu(qq, p, 0, cu, kl, tb)
            else:
                call = lambda qq, p, tb: paged_attention(qq, p, 0, cu, kl, tb)
            out, t = chain_time(call, q, pool, [tables], reps=30, chain=8)
            err = float("nan")
            if args is fp8_128 and not ab:
                got = np.asarray(call(q, pool, tables), np.float32)
                err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            rows.append((f"{s_}x{ctx}", name, t * 1e6, err)); print(rows[-1], flush=True)
        except Exception as e:
            print(f"{s_}x{ctx}", name, "FAILED", str(e)[:300], flush=True)
for r in rows: print("%-9s %-32s %8.1f us  rel err %.2g" % r)
