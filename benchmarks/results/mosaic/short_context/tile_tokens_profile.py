"""Where a multi-token query tile's fixed cost goes at short-context decode: the Mosaic kernel's
decode launch (one token a sequence, Hq 16 / Hkv 8 / D 128, block 16) with tiles of ``block_q``
tokens for each of ``--block-q``, run ``--runs`` times each after compiling, and Triton's. Meant to
run under ``ncu`` (hardware counters of each launch) or with ``MOSAIC_GPU_DUMP_PTXAS=1`` (registers
and spills of each kernel as compiled).

    python3 benchmarks/results/mosaic/short_context/tile_tokens_profile.py --batch 256 --context 64
"""
import argparse
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import jax  # noqa: E402
from bench_attention import random_paged_batch  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--context", type=int, default=64)
ap.add_argument("--block-q", default="32,1")
ap.add_argument("--runs", type=int, default=2)
args = ap.parse_args()
b = args.batch
q, pool, cu, kl, table = random_paged_batch([1] * b, [args.context - 1] * b, 16, 8, 128, 16, b)
fns = {f"block_q={n}": jax.jit(lambda q, pool, cu, kl, t, n=int(n): paged_attention_mgpu(q, pool, 0, cu, kl, t, block_q=n))
       for n in args.block_q.split(",")}
fns["triton"] = jax.jit(lambda q, pool, cu, kl, t: triton(q, pool, 0, cu, kl, t))
for name, f in fns.items():
    jax.block_until_ready(f(q, pool, cu, kl, table))  # compile
for name, f in fns.items():
    print("running", name, flush=True)
    for _ in range(args.runs):
        jax.block_until_ready(f(q, pool, cu, kl, table))
