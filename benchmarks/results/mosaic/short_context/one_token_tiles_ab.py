"""Whether one-token query tiles (``block_q=1``, faster at short-context decode:
``variants_ab.py``) could be the default where a launch has no more tokens than sequences (``T <= S``,
as a decode step has): the Mosaic kernel with its default tiles (``min(64 // G, 32)`` tokens), with
tiles of one token, and Triton, on the short prompts that also have ``T <= S`` in the engine (it
pads a step's sequences to ``min(T, bucket(max_num_seqs))``). Chained wall time (``bench_attention.time_variants``: each compiled
once, two rounds in alternating order); outputs compared with the default's.

Run from the repository root:
    python3 benchmarks/results/mosaic/short_context/one_token_tiles_ab.py
"""
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

VARIANTS = {"default": lambda *a: paged_attention_mgpu(*a), "one_token_tiles": lambda *a: paged_attention_mgpu(*a, block_q=1),
            "triton": lambda *a: triton(*a)}
# (label, new tokens a sequence, cached tokens before them, padded sequences S, heads Hq/Hkv)
QWEN3 = (16, 8)
QWEN7B = (28, 4)
CASES = [
    ("prompt 1 x 32 (S 32)", [32], [0], 32, QWEN3),
    ("prompt 4 x 32 (S 128)", [32] * 4, [0] * 4, 128, QWEN3),
    ("prompt 8 x 32 (S 256)", [32] * 8, [0] * 8, 256, QWEN3),
    ("prompt 1 x 128 (S 128)", [128], [0], 128, QWEN3),
    ("prompt 2 x 64 after 512 (S 128)", [64] * 2, [512] * 2, 128, QWEN3),
    ("prompt 1 x 32 (S 32), G 7", [32], [0], 32, QWEN7B),
    ("prompt 8 x 32 (S 256), G 7", [32] * 8, [0] * 8, 256, QWEN7B),
]

rows = []
for label, q_lens, prefixes, s, (hq, hkv) in CASES:
    pad = s - len(q_lens)
    q, pool, cu, kl, table = random_paged_batch(q_lens + [0] * pad, prefixes + [0] * pad, hq, hkv, 128, 16,
                                                sum(q_lens))
    each: dict = {}
    t, outs = time_variants(VARIANTS, q, pool, cu, kl, table, rounds=2, each_round=each, where=label)
    same = bool(np.array_equal(outs["one_token_tiles"], outs["default"]))
    err = float(np.max(np.abs(outs["one_token_tiles"] - outs["triton"])))
    rows.append((label, t, same, err))
    print(label, {k: f"{v:.1f} ({'/'.join(f'{x:.1f}' for x in each[k])})" for k, v in t.items()},
          "bitwise equal to the default:", same, "max |diff| vs triton:", f"{err:.3g}", flush=True)
    del pool
print("\n| launch | default | one-token tiles | Triton | one-token / default | one-token / Triton | bitwise |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for label, t, same, _ in rows:
    print(f"| {label} | {t['default']:.1f} | {t['one_token_tiles']:.1f} | {t['triton']:.1f} | "
          f"{t['one_token_tiles'] / t['default']:.2f} | {t['one_token_tiles'] / t['triton']:.2f} | {same} |")
