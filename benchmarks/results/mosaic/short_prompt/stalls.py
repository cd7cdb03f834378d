"""Where a short prompt's attention launch spends its time, Mosaic GPU against Triton: one sequence of
``--tokens`` new tokens after ``--prefix`` cached ones, padded to ``--seqs`` sequences as the engine pads
a step (Hq 16 / Hkv 8 / D 128, block 16: Qwen3-0.6B's attention). Variants: the Mosaic query tiles
unsplit (``tiles``), with the decode launches' split-K (``tiles_split``: what an engine whose tables
are wide runs), and the Triton kernel. Each runs ``--runs`` times after compiling. Meant to run under
``ncu`` (each launch's speed of light, warp states and where warps stall):

    ncu --clock-control none -k regex:attention --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section LaunchStats --section Occupancy --section SourceCounters \
        python3 benchmarks/results/mosaic/short_prompt/stalls.py
"""
import argparse
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import MAX_TILE_TOKENS, paged_attention_mgpu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=32)
ap.add_argument("--prefix", type=int, default=0)
ap.add_argument("--seqs", type=int, default=8)
ap.add_argument("--runs", type=int, default=2)
args = ap.parse_args()
hq, hkv, d = 16, 8, 128
block_q = min(64 // (hq // hkv), MAX_TILE_TOKENS)
q_lens = [args.tokens] + [0] * (args.seqs - 1)
prefixes = [args.prefix] + [0] * (args.seqs - 1)
q, pool, cu, kl, table = random_paged_batch(q_lens, prefixes, hq, hkv, d, 16, args.tokens)
kernels = {"tiles": lambda *a: paged_attention_mgpu(*a, block_q=block_q, num_splits=1),
           "tiles_split": lambda *a: paged_attention_mgpu(*a, decode=True),
           "triton": triton}
fns = {name: jax.jit(lambda q, pool, cu, kl, t, k=k: k(q, pool, 0, cu, kl, t)) for name, k in kernels.items()}
outs = {name: np.asarray(jax.block_until_ready(f(q, pool, cu, kl, table)), np.float32) for name, f in fns.items()}
for name, out in outs.items():
    print(name, "max abs difference from triton", float(np.max(np.abs(out - outs["triton"]))), flush=True)
for name, f in fns.items():
    print("running", name, flush=True)
    for _ in range(args.runs):
        jax.block_until_ready(f(q, pool, cu, kl, table))
