"""Greedy token ids of Mosaic GPU engines over an fp8 pool (Qwen3-0.6B shapes, random weights, no
compilation cache: every step lowered and compiled), one engine after another in one process, each
variant named on the command line:
  tree:          each step lowers its attention kernels itself;
  lowered_once:  each attention launch (kernels and the XLA code around them) exported once and
                 embedded in every step (needs lowered_once.patch);
  kernel_once:   each Mosaic GPU kernel alone exported once and embedded in every step, the XLA code
                 around it the step's own (needs kernel_once.patch).
Each engine: a cold warm-up's profile, then eight 32-token prompts, two 300-token prompts, and four
32-token prompts after a shared 2,048-token prefix cached first; 16 tokens each.

In one process the engines share XLA's GEMM autotuning results, so the same program gives the same
tokens; two processes may autotune a GEMM differently (timed candidates), so their tokens may differ
for that reason alone: ``tree`` in a second process measures that. Between engines the process's jit
caches are cleared (the kernels' inner jits would otherwise keep the first engine's traces).
The ids are written to ``$OUT/tokens_<position>_<variant>.json``; the last lines say which runs equal
the first.

Run from the repository root: python3 benchmarks/results/startup/lowered_once/greedy_tokens.py VARIANT...
"""
import gc
import json
import os
import sys

import jax
import numpy as np

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.models import ops
from jaxpaged.workloads import benchmark_params

try:  # kernel_once.patch
    from jaxpaged.kernels import lowered_once as kernel_once
except ImportError:
    kernel_once = None

LOWERED_ONCE = getattr(ops, "LoweredOnce", None)  # lowered_once.patch
KERNEL_LAUNCH = getattr(kernel_once, "launch", None)


def greedy_tokens(variant: str) -> list:
    if variant not in ("tree", "lowered_once", "kernel_once"):
        raise SystemExit(f"unknown variant {variant!r}")
    if (variant == "lowered_once" and LOWERED_ONCE is None) or (variant == "kernel_once" and kernel_once is None):
        raise SystemExit(f"{variant} needs {variant}.patch applied")
    if LOWERED_ONCE is not None:
        ops.LoweredOnce = LOWERED_ONCE if variant == "lowered_once" else (lambda fn: fn)
    if kernel_once is not None:
        kernel_once.launch = KERNEL_LAUNCH if variant == "kernel_once" else (lambda kernel, *a, interpret: kernel(*a))
    jax.clear_caches()
    # Each engine its own compiled steps: the attention function is cached per backend, and the runner
    # (the jitted step and its executables) per weights object.
    ops.get_attention_fn.cache_clear()
    for key in [k for k in params.derived if isinstance(k, tuple) and k[0] == "runner"]:
        del params.derived[key]
    engine = LLMEngine(params, EngineConfig(kv_cache_dtype="fp8", attention_backend="mosaic", max_model_len=4096,
                                            num_blocks=512, compilation_cache=False))
    engine.warmup(use_tqdm=False)
    print(variant, "warm-up:", {k: round(v, 1) if isinstance(v, float) else v
                                for k, v in engine.warmup_profile.items() if k != "slowest_compile"})
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prefix = rng.integers(0, 10_000, 2048).tolist()
    batches = [rng.integers(0, 10_000, (8, 32)).tolist(), rng.integers(0, 10_000, (2, 300)).tolist()]
    run_to_completion(engine, [prefix], SamplingParams(temperature=0.0, max_tokens=1))
    batches.append([prefix + p for p in rng.integers(0, 10_000, (4, 32)).tolist()])
    tokens = [[list(o.outputs[0].token_ids) for o in run_to_completion(engine, b, sp)] for b in batches]
    engine.close()
    del engine
    gc.collect()
    return tokens


params = benchmark_params("qwen3-0.6b")
runs = [(f"{i}_{variant}", greedy_tokens(variant)) for i, variant in enumerate(sys.argv[1:])]
for name, tokens in runs:
    json.dump(tokens, open(os.path.join(os.environ.get("OUT", "."), f"tokens_{name}.json"), "w"))
    differ = [(b, r, next(i for i, (x, y) in enumerate(zip(t, t0)) if x != y))
              for b, (batch, batch0) in enumerate(zip(tokens, runs[0][1]))
              for r, (t, t0) in enumerate(zip(batch, batch0)) if t != t0]
    print(f"{name}: greedy token ids equal to {runs[0][0]}'s: "
          + ("yes" if not differ else f"NO ((batch, request, first differing position): {differ})"))
