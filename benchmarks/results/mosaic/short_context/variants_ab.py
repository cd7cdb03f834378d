"""Decode at short contexts, two more candidates for the Mosaic kernel's fixed cost a program, alone and
together: tiles of one token (``block_q=1``: one query barrier a program instead of ``min(64 // G, 32)``,
and no conditional copies or waits for the tile's other tokens; a launch option already, the default
before multi-token tiles), and programmatic dependent launch (``pdl_ab.pdl_kernels``: the kernel may
start while the one before it finishes). Against the default and Triton; chained wall time
(``bench_attention.time_variants``, each variant compiled once, two rounds in alternating order),
Hq 16 / Hkv 8 / D 128, block 16, one token a sequence; outputs must equal the default's bitwise.

Run from the repository root: python3 benchmarks/results/mosaic/short_context/variants_ab.py
"""
import os
import sys
import warnings

sys.path[:0] = ["benchmarks", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pdl")]
warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402
from pdl_ab import pdl_kernels  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402


def pdl(**kw):
    def call(*a):
        with pdl_kernels():
            return paged_attention_mgpu(*a, **kw)
    return call


VARIANTS = {"default": lambda *a: paged_attention_mgpu(*a), "one_token_tiles": lambda *a: paged_attention_mgpu(*a, block_q=1),
            "pdl": pdl(), "pdl_one_token_tiles": pdl(block_q=1), "triton": lambda *a: triton(*a)}
rows = []
for b, ctx in ((256, 64), (64, 64), (256, 128), (1, 64), (256, 1024)):
    q, pool, cu, kl, table = random_paged_batch([1] * b, [ctx - 1] * b, 16, 8, 128, 16, b)
    each: dict = {}
    t, outs = time_variants(VARIANTS, q, pool, cu, kl, table, rounds=2, each_round=each, where=f"{b}x{ctx}")
    same = {k: bool(np.array_equal(v, outs["default"])) for k, v in outs.items() if k not in ("default", "triton")}
    rows.append((f"{b} x {ctx}", t))
    print(f"{b} x {ctx}", {k: f"{v:.1f} ({'/'.join(f'{x:.1f}' for x in each[k])})" for k, v in t.items()},
          "bitwise equal to the default:", same, flush=True)
    del pool
print("\n| decode B x ctx | " + " | ".join(VARIANTS) + " | best Mosaic / Triton |")
print("|" + " --- |" * (len(VARIANTS) + 2))
for label, t in rows:
    best = min(v for k, v in t.items() if k != "triton")
    print(f"| {label} | " + " | ".join(f"{t[k]:.1f}" if k in t else "-" for k in VARIANTS)
          + f" | {best / t['triton']:.2f} |")
