"""Greedy token ids of one Mosaic GPU engine over an fp8 pool (Qwen3-0.6B shapes, random weights, no
compilation cache: every step traced, lowered and compiled), for the start-up variants' token checks
(``lowered_once/greedy_tokens.py``, ``export_workers/greedy_tokens.py``): a cold warm-up, then eight
32-token prompts, two 300-token prompts, and four 32-token prompts after a shared 2,048-token prefix
cached first; 16 tokens each.

In one process engines share XLA's GEMM autotuning results, so the same program gives the same tokens;
two processes may autotune a GEMM differently (timed candidates), so their tokens may differ for that
reason alone. Before each engine the process's jit caches are cleared (the kernels' inner jits would
otherwise keep the first engine's traces).
"""
import gc
import json
import os

import jax
import numpy as np

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.models import ops


def greedy_tokens(params, variant: str) -> list:
    """A fresh engine's tokens (prints its cold warm-up's profile under ``variant``)."""
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


def report(runs: list[tuple[str, list]]) -> None:
    """Writes each run's ids to ``$OUT/tokens_<name>.json`` and says which runs equal the first."""
    for name, tokens in runs:
        json.dump(tokens, open(os.path.join(os.environ.get("OUT", "."), f"tokens_{name}.json"), "w"))
        differ = [(b, r, next(i for i, (x, y) in enumerate(zip(t, t0)) if x != y))
                  for b, (batch, batch0) in enumerate(zip(tokens, runs[0][1]))
                  for r, (t, t0) in enumerate(zip(batch, batch0)) if t != t0]
        print(f"{name}: greedy token ids equal to {runs[0][0]}'s: "
              + ("yes" if not differ else f"NO ((batch, request, first differing position): {differ})"))
