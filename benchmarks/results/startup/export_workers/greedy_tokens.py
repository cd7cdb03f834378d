"""Greedy token ids of Mosaic GPU engines over an fp8 pool (``../engine_tokens.py``: Qwen3-0.6B
shapes, random weights, a cold warm-up, 14 requests of 16 tokens, a cached 2,048-token prefix among
them), one engine after another in one process, each variant named on the command line:
  in_process: each kernel exported in this process, when the first step that launches it is lowered;
  workers:    the warm-up's kernels exported in worker processes at once (lowered_once.export_traced),
              after every step is traced and before any is lowered.
Between engines the kernel exports are cleared too. The ids are written to
``$OUT/tokens_<position>_<variant>.json``; the last lines say which runs equal the first.

Run from the repository root: python3 benchmarks/results/startup/export_workers/greedy_tokens.py VARIANT...
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine_tokens import greedy_tokens, report  # noqa: E402
from jaxpaged.kernels import lowered_once  # noqa: E402
from jaxpaged.workloads import benchmark_params  # noqa: E402

EXPORT_TRACED = lowered_once.export_traced


def variant_tokens(variant: str) -> list:
    if variant not in ("in_process", "workers"):
        raise SystemExit(f"unknown variant {variant!r}")
    lowered_once.export_traced = EXPORT_TRACED if variant == "workers" else (lambda workers=None: 0)
    lowered_once._exports.clear()
    lowered_once._kernels.clear()
    tokens = greedy_tokens(params, variant)
    print(variant, "kernels exported:", lowered_once.exports())
    return tokens


params = benchmark_params("qwen3-0.6b")
report([(f"{i}_{variant}", variant_tokens(variant)) for i, variant in enumerate(sys.argv[1:])])
