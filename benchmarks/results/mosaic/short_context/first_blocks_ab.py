"""The first KV tile's block ids gathered with the tile metadata (``first_tile_blocks``, the kernel with
`first_blocks.patch` applied, as the working tree) against read from the block table after the
metadata (the kernel without it: `cp kernels/paged_attention_mgpu.py .gpu/mgpu_before.py`, then `git
apply benchmarks/results/mosaic/short_context/first_blocks.patch`), and the Triton kernel;
decode, one token a sequence, chained wall time (8 launches a jit, ``bench_attention.time_variants``),
Hq 16 / Hkv 8 / D 128, block 16, each case twice in alternating order; whether the two Mosaic
variants' outputs are bitwise equal and the largest difference from Triton's. ``+w``: the block tables
padded to 256 columns (split-K sized for a 4,096-token ``max_model_len``, as the engine passes them).

Run from the repository root: python3 benchmarks/results/mosaic/short_context/first_blocks_ab.py
"""
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

spec = importlib.util.spec_from_file_location("mgpu_before", ".gpu/mgpu_before.py")
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
VARIANTS = {"before": lambda *a: before.paged_attention_mgpu(*a), "first_blocks": lambda *a: paged_attention_mgpu(*a),
            "triton": lambda *a: triton(*a)}
rows = []
for b, ctx, wide in ((256, 64, 0), (64, 64, 0), (256, 1024, 0), (1, 64, 256), (256, 128, 0), (8, 1024, 0)):
    q, pool, cu, kl, table = random_paged_batch([1] * b, [ctx - 1] * b, 16, 8, 128, 16, b)
    if wide:
        table = jnp.pad(table, ((0, 0), (0, wide - table.shape[1])))
    label = f"{b} x {ctx}{' +w' if wide else ''}"
    f, o = time_variants(VARIANTS, q, pool, cu, kl, table, where=label)
    s, _ = time_variants(dict(reversed(list(VARIANTS.items()))), q, pool, cu, kl, table, where=label)
    r = {k: (f[k] + s[k]) / 2 for k in f if k in s}
    same = bool(np.array_equal(o["before"], o["first_blocks"]))
    rows.append((label, r))
    print(f"| {label} | " + " | ".join(f"{r[k]:.1f} ({f[k]:.1f}/{s[k]:.1f})" for k in r)
          + f" | {r['first_blocks'] / r['before']:.2f} | {r['first_blocks'] / r['triton']:.2f} | bitwise {same} | "
          f"vs triton {float(np.max(np.abs(o['first_blocks'] - o['triton']))):.1e} |", flush=True)
    del pool
print("| decode B x ctx | before | first blocks | Triton | first / before | first / Triton |")
