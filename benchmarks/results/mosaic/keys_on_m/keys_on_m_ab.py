"""Decode over bf16 pools with keys on wgmma's M (``paged_decode_mgpu``, unsplit here, two K/V slots or
one) against the query tiles (``paged_attention_mgpu`` without ``uniform_decode``, split-K by its rule)
and Triton; one token a sequence, block 16, chained wall time (``bench_attention.time_variants``: each
compiled once, two rounds in alternating order), the largest difference from the tiles' output. (It
first ran, at 74bf793, on the same kernel as an experiment of its own beside this script.)

Run from the repository root: python3 benchmarks/results/mosaic/keys_on_m/keys_on_m_ab.py
"""
import os
import sys
import warnings

sys.path[:0] = ["benchmarks", os.path.dirname(os.path.abspath(__file__))]
warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import choose_splits, kv_tile, paged_attention_mgpu  # noqa: E402

VARIANTS = {"tiles": lambda *a: paged_attention_mgpu(*a),
            "keys_on_m": lambda *a: paged_attention_mgpu(*a, uniform_decode=True, num_splits=1),
            # one K/V slot: about 49 KiB of shared memory a program, four a multiprocessor (two slots: 81 KiB, two)
            "keys_on_m_1slot": lambda *a: paged_attention_mgpu(*a, uniform_decode=True, num_splits=1, num_slots=1),
            "triton": lambda *a: triton(*a)}
CASES = [  # (sequences, context, Hq, Hkv)
    (256, 64, 16, 8), (64, 64, 16, 8), (1, 64, 16, 8), (256, 128, 16, 8), (256, 256, 16, 8),
    (256, 1024, 16, 8), (64, 1024, 16, 8), (256, 64, 28, 4), (256, 1024, 28, 4),
]
rows = []
for b, ctx, hq, hkv in CASES:
    q, pool, cu, kl, table = random_paged_batch([1] * b, [ctx - 1] * b, hq, hkv, 128, 16, b)
    splits = choose_splits(b, b, hkv, kv_tile(16), table.shape[1] * 16, True)  # the tiles' (keys on M: 1)
    label = f"{b} x {ctx}, G {hq // hkv} (tiles' splits {splits})"
    each: dict = {}
    t, outs = time_variants(VARIANTS, q, pool, cu, kl, table, rounds=2, each_round=each, where=label)
    diff = float(np.max(np.abs(outs["keys_on_m"] - outs["tiles"]))) if "keys_on_m" in outs else float("nan")
    rows.append((label, t, diff))
    print(label, {k: f"{v:.1f} ({'/'.join(f'{x:.1f}' for x in each[k])})" for k, v in t.items()},
          f"max |keys_on_m - tiles| {diff:.3g}", flush=True)
    del pool
print("\n| decode B x ctx | tiles | keys on M | one slot | Triton | best keys on M / tiles | / Triton | max diff |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for label, t, diff in rows:
    k, k1 = t.get("keys_on_m", float("nan")), t.get("keys_on_m_1slot", float("nan"))
    best = min(k, k1)
    print(f"| {label} | {t['tiles']:.1f} | {k:.1f} | {k1:.1f} | {t['triton']:.1f} | {best / t['tiles']:.2f} | "
          f"{best / t['triton']:.2f} | {diff:.3g} |")
