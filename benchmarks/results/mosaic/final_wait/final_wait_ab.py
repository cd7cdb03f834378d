"""The Mosaic kernels' last wait for their output copies: for the reads of shared memory only (the
working tree: ``plgpu.wait_smem_to_gmem(0, wait_read_only=True)``) against a wait for the writes to
reach global memory too (the kernels before; here a shim that makes every ``wait_smem_to_gmem`` of the
kernel modules a full wait while they trace). A program cannot leave before its TMA stores have read
shared memory; their writes are complete when the kernel is, so the full wait only delays each
program's exit, on the critical path of every launch whose programs do little work (short contexts).

Chained wall time (8 launches a jit, ``bench_attention.time_variants``), Hq 16 / Hkv 8 / D 128, block 16,
each case timed twice in alternating order, the mean of the two; largest difference from Triton's
output and whether the two Mosaic variants agree bitwise. ``+w`` pads the block tables to 256 columns
(a 4,096-token ``max_model_len``, as the engine passes them: split-K sized for that, not the context).

Run from the repository root: python3 benchmarks/results/mosaic/final_wait/final_wait_ab.py
"""
import sys
import warnings

sys.path[:0] = ["benchmarks", "benchmarks/results/mosaic"]
warnings.filterwarnings("ignore")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from kernel_shims import PlgpuShim, patched_plgpu  # noqa: E402

from jaxpaged.kernels import paged_attention_mgpu as mgpu  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402

HQ, HKV, D = 16, 8, 128


class FullWait(PlgpuShim):
    """``plgpu`` with every ``wait_smem_to_gmem`` a wait for the writes too."""

    @staticmethod
    def wait_smem_to_gmem(n, wait_read_only=False):
        return plgpu.wait_smem_to_gmem(n, wait_read_only=False)


def full_wait(*a, **kw):
    """The kernels as before: traced with the shim in place of ``plgpu``."""
    with patched_plgpu(FullWait()):
        return mgpu.paged_attention_mgpu(*a, **kw)


VARIANTS = {"full_wait": full_wait, "read_only_wait": lambda *a: mgpu.paged_attention_mgpu(*a),
            "triton": lambda *a: triton(*a)}
CASES = [(b, c, False) for b, c in ((1, 64), (1, 1024), (8, 64), (8, 1024), (64, 64), (64, 256), (64, 1024),
                                    (256, 64), (256, 1024))]
CASES += [(1, 64, True), (64, 64, True)]
PREFILL = [(32, 0), (2048, 0)]  # one sequence of T new tokens after a prefix (8 sequences)

rows = []
for kind, case in [("decode", c) for c in CASES] + [("prefill", p) for p in PREFILL]:
    if kind == "decode":
        b, ctx, wide = case
        q, pool, cu, kl, table = random_paged_batch([1] * b, [ctx - 1] * b, HQ, HKV, D, 16, b)
        if wide:
            table = jnp.pad(table, ((0, 0), (0, 256 - table.shape[1])))
        label = f"decode {b} x {ctx}{' +w' if wide else ''}"
    else:
        t, prefix = case
        q, pool, cu, kl, table = random_paged_batch([t] + [0] * 7, [prefix] + [0] * 7, HQ, HKV, D, 16, t)
        label = f"prefill {t} + {prefix}"
    first, outs = time_variants(VARIANTS, q, pool, cu, kl, table, where=label)
    second, _ = time_variants(dict(reversed(list(VARIANTS.items()))), q, pool, cu, kl, table, where=label)
    res = {k: (first[k] + second[k]) / 2 for k in first if k in second}
    same = bool(np.array_equal(outs["full_wait"], outs["read_only_wait"]))
    diff = float(np.max(np.abs(outs["read_only_wait"] - outs["triton"])))
    rows.append((label, res, first, second, same, diff))
    print(label, {k: f"{first[k]:.1f}/{second[k]:.1f}" for k in res}, "bitwise equal:", same,
          f"max diff vs triton {diff:.1e}", flush=True)
    del pool

print("\n| case | full wait | read-only wait | Triton | read-only / full | read-only / Triton | bitwise |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for label, r, _, _, same, _ in rows:
    print(f"| {label} | {r['full_wait']:.1f} | {r['read_only_wait']:.1f} | {r['triton']:.1f} | "
          f"{r['read_only_wait'] / r['full_wait']:.2f} | {r['read_only_wait'] / r['triton']:.2f} | {same} |")
