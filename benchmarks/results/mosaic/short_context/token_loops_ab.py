"""The Mosaic kernel's query tile with its tokens' copies and waits in loops to the tile's token count
against the same kernel with them unrolled to ``max_tokens`` under conditions (``--before``: a copy of
``kernels/paged_attention_mgpu.py`` without ``token_loops.patch``), and Triton, on decode launches
(one token a sequence) and short prompts the decode path takes. Chained wall time
(``bench_attention.time_variants``: each compiled once, two rounds in alternating order); outputs
must equal the unrolled kernel's bitwise. Hq 16 / Hkv 8 / D 128, block 16.

Run from the repository root:
    python3 benchmarks/results/mosaic/short_context/token_loops_ab.py --before PATH
"""
import argparse
import importlib.util
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--before", required=True)
args = ap.parse_args()
spec = importlib.util.spec_from_file_location("mgpu_before", args.before)
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
VARIANTS = {"unrolled": lambda *a: before.paged_attention_mgpu(*a), "loops": lambda *a: paged_attention_mgpu(*a),
            "triton": lambda *a: triton(*a)}
CASES = [  # (label, new tokens a sequence, cached before them, padded sequences)
    ("decode 256 x 64", [1] * 256, [63] * 256, 256),
    ("decode 64 x 64", [1] * 64, [63] * 64, 64),
    ("decode 256 x 128", [1] * 256, [127] * 256, 256),
    ("decode 1 x 64", [1], [63], 1),
    ("decode 64 x 1536", [1] * 64, [1535] * 64, 64),
    ("decode 256 x 1024", [1] * 256, [1023] * 256, 256),
    ("prompt 1 x 32 (S 32)", [32], [0], 32),
    ("prompt 8 x 32 (S 256)", [32] * 8, [0] * 8, 256),
    ("prompt 1 x 128 (S 128)", [128], [0], 128),
    ("prompt 2 x 64 after 512 (S 128)", [64] * 2, [512] * 2, 128),
]
rows = []
for label, q_lens, prefixes, s in CASES:
    pad = s - len(q_lens)
    q, pool, cu, kl, table = random_paged_batch(q_lens + [0] * pad, prefixes + [0] * pad, 16, 8, 128, 16, sum(q_lens))
    each: dict = {}
    t, outs = time_variants(VARIANTS, q, pool, cu, kl, table, rounds=2, each_round=each, where=label)
    same = bool(np.array_equal(outs["loops"], outs["unrolled"]))
    rows.append((label, t, same))
    print(label, {k: f"{v:.1f} ({'/'.join(f'{x:.1f}' for x in each[k])})" for k, v in t.items()},
          "bitwise equal:", same, flush=True)
    del pool
print("\n| launch | unrolled | loops | Triton | loops / unrolled | loops / Triton | bitwise |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for label, t, same in rows:
    print(f"| {label} | {t['unrolled']:.1f} | {t['loops']:.1f} | {t['triton']:.1f} | "
          f"{t['loops'] / t['unrolled']:.2f} | {t['loops'] / t['triton']:.2f} | {same} |")
