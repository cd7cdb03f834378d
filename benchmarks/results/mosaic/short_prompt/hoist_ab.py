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
import importlib.util
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import jax.numpy as jnp  # noqa: E402
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
VARIANTS = {"before": lambda *a: before.paged_attention_mgpu(*a), "hoisted": lambda *a: paged_attention_mgpu(*a),
            "triton": lambda *a: triton(*a)}
CASES = [  # (label, new tokens a sequence, cached before them, padded sequences, wide table)
    ("decode 1 x 64", [1], [63], 1, False),
    ("decode 64 x 64", [1] * 64, [63] * 64, 64, False),
    ("decode 256 x 64", [1] * 256, [63] * 256, 256, False),
    ("decode 64 x 1024", [1] * 64, [1023] * 64, 64, False),
    ("decode 1 x 256 +w", [1], [255], 1, True),
    ("prompt 1 x 32 (S 8)", [32], [0], 8, False),
    ("prompt 1 x 32 (S 32) +w", [32], [0], 32, True),
    ("prompt 1 x 32 after 4096 (S 8) +w", [32], [4096], 8, True),
    ("prompt 1 x 128 (S 128)", [128], [0], 128, False),
    ("prompt 8 x 32 (S 256)", [32] * 8, [0] * 8, 256, False),
]
rows = []
for label, q_lens, prefixes, s, wide in CASES:
    pad = s - len(q_lens)
    q, pool, cu, kl, table = random_paged_batch(q_lens + [0] * pad, prefixes + [0] * pad, 16, 8, 128, 16, sum(q_lens))
    if wide:
        table = jnp.pad(table, ((0, 0), (0, max(0, 256 - table.shape[1]))))
    each: dict = {}
    t, outs = time_variants(VARIANTS, q, pool, cu, kl, table, rounds=2, each_round=each, where=label)
    same = bool(np.array_equal(outs["hoisted"], outs["before"]))
    rows.append((label, t, same))
    print(label, {k: f"{v:.1f} ({'/'.join(f'{x:.1f}' for x in each[k])})" for k, v in t.items()},
          "bitwise equal:", same, flush=True)
    del pool
print("\n| launch | before | hoisted | Triton | hoisted / before | hoisted / Triton | bitwise |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for label, t, same in rows:
    print(f"| {label} | {t['before']:.1f} | {t['hoisted']:.1f} | {t['triton']:.1f} | "
          f"{t['hoisted'] / t['before']:.2f} | {t['hoisted'] / t['triton']:.2f} | {same} |")
