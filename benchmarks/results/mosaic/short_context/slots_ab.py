"""Decode at short contexts, where each program reads one or two KV tiles: is the launch bound by how many
programs fit an SM? The default (2 K/V slots: 80 KiB of shared memory a program, two an SM) against one
slot (48 KiB, four an SM) and the Triton kernel; chained wall time (8 launches a jit,
``bench_attention.time_variants``), Hq 16 / Hkv 8 / D 128, block 16, each case timed twice in
alternating order (the mean; both runs printed).

Run from the repository root: python3 benchmarks/results/mosaic/short_context/slots_ab.py
"""
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
from bench_attention import random_paged_batch, time_variants  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

HQ, HKV, D = 16, 8, 128
VARIANTS = {"slots2": lambda *a: paged_attention_mgpu(*a), "slots1": lambda *a: paged_attention_mgpu(*a, num_slots=1),
            "triton": lambda *a: triton(*a)}
rows = []
for b, ctx in ((256, 64), (256, 128), (64, 64), (256, 1024)):
    q, pool, cu, kl, table = random_paged_batch([1] * b, [ctx - 1] * b, HQ, HKV, D, 16, b)
    first, _ = time_variants(VARIANTS, q, pool, cu, kl, table, where=f"{b}x{ctx}")
    second, _ = time_variants(dict(reversed(list(VARIANTS.items()))), q, pool, cu, kl, table, where=f"{b}x{ctx}")
    res = {k: (first[k] + second[k]) / 2 for k in first if k in second}
    rows.append((f"{b} x {ctx}", res))
    print(b, ctx, {k: f"{first[k]:.1f}/{second[k]:.1f}" for k in res}, flush=True)
    del pool
print("\n| decode B x ctx | 2 slots | 1 slot | Triton | 1 slot / 2 | 2 slots / Triton |")
print("| --- | --- | --- | --- | --- | --- |")
for label, r in rows:
    print(f"| {label} | {r['slots2']:.1f} | {r['slots1']:.1f} | {r['triton']:.1f} | {r['slots1'] / r['slots2']:.2f} | "
          f"{r['slots2'] / r['triton']:.2f} |")
