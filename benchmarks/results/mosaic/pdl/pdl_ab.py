"""Programmatic dependent launch (PDL) for the Mosaic attention kernels: each kernel body started by
``plgpu.griddepcontrol_wait()`` (Mosaic GPU then marks the kernel ``uses_pdl`` and XLA launches it so
that it may start, and set up its barriers, while the kernel before it finishes) against the kernels
as they are, and Triton's (whose launches XLA already makes PDL launches on Hopper:
``xla_gpu_enable_pdl``). The variant is a shim: ``plgpu.kernel`` of the three kernel modules wraps
each body while that variant traces, so the kernels' code is unchanged.

Decode, one token a sequence, 8 launches a jit, each output the next launch's queries: the chained
wall time (``bench_attention.time_variants``: each compiled once, two rounds in alternating order)
and, from a trace of 10 jits, the GPU span of a jit per launch (``launch_gaps/chain_gaps.py``'s
parsing). Run from the repository root:

    python3 benchmarks/results/mosaic/pdl/pdl_ab.py [--shapes 1x64,1x1024,8x1024,64x64,64x1024,256x64]
"""
import argparse
import statistics
import sys
import warnings

sys.path[:0] = ["benchmarks", "tools", "benchmarks/results/mosaic", "benchmarks/results/mosaic/launch_gaps"]
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
from bench_attention import time_variants  # noqa: E402
from chain_gaps import jit_spans, trace_jits  # noqa: E402
from decode_profile import decode_batch  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from kernel_shims import PlgpuShim, patched_plgpu  # noqa: E402

from jaxpaged.kernels import paged_attention_mgpu as mgpu  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402

CHAIN = 8


class WithPdl(PlgpuShim):
    """``plgpu`` whose ``kernel`` starts every body with ``griddepcontrol_wait`` (on the GPU; the
    interpreter has no rule for it)."""

    @staticmethod
    def kernel(body, **kw):
        if kw.get("interpret") is not None:
            return plgpu.kernel(body, **kw)

        def waits_first(*args, **kwargs):
            plgpu.griddepcontrol_wait()
            return body(*args, **kwargs)

        return plgpu.kernel(waits_first, **kw)


def pdl_kernels():
    """Everything traced inside gets the Mosaic kernels as PDL launches."""
    return patched_plgpu(WithPdl())


def with_pdl(*a):
    with pdl_kernels():
        return mgpu.paged_attention_mgpu(*a)


VARIANTS = {"mosaic": lambda *a: mgpu.paged_attention_mgpu(*a), "mosaic_pdl": with_pdl, "triton": lambda *a: triton(*a)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x64,1x1024,8x1024,64x64,64x1024,256x64")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        b, ctx = (int(v) for v in shape.split("x"))
        q, pool, cu, kl, table = decode_batch(b, ctx)
        walls, compiled = {}, {}
        means, outs = time_variants(VARIANTS, q, pool, cu, kl, table, reps=args.reps, chain=CHAIN, where=shape,
                                    rounds=2, each_round=walls, compiled=compiled)
        row = {}
        for name, fn in compiled.items():
            gpu, _ = trace_jits(fn, (q, (pool, cu, kl), table), 10)
            spans = jit_spans(gpu)
            span = statistics.median((max(e["ts"] + e["dur"] for e in s) - s[0]["ts"]) / CHAIN for s in spans)
            row[name] = (means[name], span)
        same = bool(np.array_equal(outs["mosaic"], outs["mosaic_pdl"]))
        rows.append((shape, row, same))
        print(shape, {k: f"wall {w:.1f} ({walls[k][0]:.1f}/{walls[k][1]:.1f}) span {s:.1f}" for k, (w, s) in row.items()},
              "bitwise", same, flush=True)
        del pool
    print("\n| decode B x ctx | Mosaic wall / span | with PDL wall / span | Triton wall / span | PDL / without (span) | bitwise |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape, r, same in rows:
        print(f"| {shape} | {r['mosaic'][0]:.1f} / {r['mosaic'][1]:.1f} | {r['mosaic_pdl'][0]:.1f} / {r['mosaic_pdl'][1]:.1f} | "
              f"{r['triton'][0]:.1f} / {r['triton'][1]:.1f} | {r['mosaic_pdl'][1] / r['mosaic'][1]:.2f} | {same} |")


if __name__ == "__main__":
    main()
