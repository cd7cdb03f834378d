"""Greedy token ids of Mosaic GPU engines over an fp8 pool (Qwen3-0.6B shapes, random weights, no
compilation cache: every step lowered and compiled), one engine after another in one process, each
variant named on the command line:
  tree:          each step lowers its attention kernels itself;
  lowered_once:  each attention launch (kernels and the XLA code around them) exported once and
                 embedded in every step (needs lowered_once.patch);
  kernel_once:   each Mosaic GPU kernel alone exported once and embedded in every step, the XLA code
                 around it the step's own (needs kernel_once.patch).
Each engine: ``../engine_tokens.py`` (a cold warm-up's profile, then eight 32-token prompts, two
300-token prompts, and four 32-token prompts after a shared 2,048-token prefix cached first; 16 tokens
each). The variants and patches apply to 22ee743, where they ran (kernel_once.patch is in the tree
since 6c4f5f7).

In one process the engines share XLA's GEMM autotuning results, so the same program gives the same
tokens; two processes may autotune a GEMM differently (timed candidates), so their tokens may differ
for that reason alone: ``tree`` in a second process measures that. Between engines the process's jit
caches are cleared (the kernels' inner jits would otherwise keep the first engine's traces).
The ids are written to ``$OUT/tokens_<position>_<variant>.json``; the last lines say which runs equal
the first.

Run from the repository root: python3 benchmarks/results/startup/lowered_once/greedy_tokens.py VARIANT...
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine_tokens import greedy_tokens, report  # noqa: E402
from jaxpaged.models import ops  # noqa: E402
from jaxpaged.workloads import benchmark_params  # noqa: E402

try:  # kernel_once.patch
    from jaxpaged.kernels import lowered_once as kernel_once
except ImportError:
    kernel_once = None

LOWERED_ONCE = getattr(ops, "LoweredOnce", None)  # lowered_once.patch
KERNEL_LAUNCH = getattr(kernel_once, "launch", None)


def variant_tokens(variant: str) -> list:
    if variant not in ("tree", "lowered_once", "kernel_once"):
        raise SystemExit(f"unknown variant {variant!r}")
    if (variant == "lowered_once" and LOWERED_ONCE is None) or (variant == "kernel_once" and kernel_once is None):
        raise SystemExit(f"{variant} needs {variant}.patch applied")
    if LOWERED_ONCE is not None:
        ops.LoweredOnce = LOWERED_ONCE if variant == "lowered_once" else (lambda fn: fn)
    if kernel_once is not None:
        kernel_once.launch = KERNEL_LAUNCH if variant == "kernel_once" else (lambda kernel, *a, interpret: kernel(*a))
    return greedy_tokens(params, variant)


params = benchmark_params("qwen3-0.6b")
report([(f"{i}_{variant}", variant_tokens(variant)) for i, variant in enumerate(sys.argv[1:])])
