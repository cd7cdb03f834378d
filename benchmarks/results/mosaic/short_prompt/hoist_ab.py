"""The Mosaic query tile reading its first KV tiles' block ids before it issues its queries' copies (the
working tree: ``hoist.patch``) against reading each as it issues that tile's K/V copies (``--before``: a
copy of ``kernels/paged_attention_mgpu.py`` with ``hoist.patch`` reversed), and Triton. Each id is a
load from global memory that the K/V copies wait for; read first, its latency passes while the
queries' copies (one a token) issue. Decode launches and short prompts (a sequence of T new tokens,
padded to S sequences as the engine pads a step), each launch's default configuration; ``+w``: block
tables 256 columns wide (a 4,096-token ``max_model_len``: split-K sized for that). Chained wall time
(``bench_attention.time_variants``: two rounds in alternating order); outputs must equal bitwise.
Hq 16 / Hkv 8 / D 128, block 16.

Run from the repository root:
    python3 benchmarks/results/mosaic/short_prompt/hoist_ab.py --before PATH
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
VARIANTS = {"before": lambda *a: before.paged_attention_mgpu(*a), "hoisted": lambda *a: paged_attention_mgpu(*a),
            "triton": lambda *a: triton(*a)}
CASES = [  # (label, new tokens a sequence, cached before them, padded sequences, table width)
    ("decode 1 x 64", [1], [63], 1),
    ("decode 64 x 64", [1] * 64, [63] * 64, 64),
    ("decode 256 x 64", [1] * 256, [63] * 256, 256),
    ("decode 64 x 1024", [1] * 64, [1023] * 64, 64),
    ("decode 1 x 256 +w", [1], [255], 1, 256),
    ("prompt 1 x 32 (S 8)", [32], [0], 8),
    ("prompt 1 x 32 (S 32) +w", [32], [0], 32, 256),
    ("prompt 1 x 32 after 4096 (S 8) +w", [32], [4096], 8, 256),
    ("prompt 1 x 128 (S 128)", [128], [0], 128),
    ("prompt 8 x 32 (S 256)", [32] * 8, [0] * 8, 256),
]
rows = time_cases(VARIANTS, CASES, same=("hoisted", "before"))
print("\n| launch | before | hoisted | Triton | hoisted / before | hoisted / Triton | bitwise |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for label, t, same in rows:
    print(f"| {label} | {t['before']:.1f} | {t['hoisted']:.1f} | {t['triton']:.1f} | "
          f"{t['hoisted'] / t['before']:.2f} | {t['hoisted'] / t['triton']:.2f} | {same} |")
