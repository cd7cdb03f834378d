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
import sys
import warnings

sys.path[:0] = ["benchmarks", "benchmarks/results/mosaic"]
warnings.filterwarnings("ignore")
from kernel_shims import module_from, time_cases  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--before", required=True)
before = module_from(ap.parse_args().before)
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
rows = time_cases(VARIANTS, CASES, same=("loops", "unrolled"))
print("\n| launch | unrolled | loops | Triton | loops / unrolled | loops / Triton | bitwise |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for label, t, same in rows:
    print(f"| {label} | {t['unrolled']:.1f} | {t['loops']:.1f} | {t['triton']:.1f} | "
          f"{t['loops'] / t['unrolled']:.2f} | {t['loops'] / t['triton']:.2f} | {same} |")
