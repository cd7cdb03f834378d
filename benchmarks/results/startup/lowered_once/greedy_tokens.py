"""A cold warm-up's profile and the greedy token ids of a Mosaic GPU engine over an fp8 pool (Qwen3-0.6B
shapes, random weights, no compilation cache: every step lowered and compiled): eight 32-token prompts,
two 300-token prompts, and four 32-token prompts after a shared 2,048-token prefix cached first; 16
tokens each. The ids are written to ``$OUT/tokens_<name>.json`` so two trees' outputs can be compared
token for token (equal where both run the same kernels).

Run from the repository root: python3 benchmarks/results/startup/lowered_once/greedy_tokens.py NAME
"""
import json
import os
import sys

import numpy as np

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import benchmark_params

params = benchmark_params("qwen3-0.6b")
engine = LLMEngine(params, EngineConfig(kv_cache_dtype="fp8", attention_backend="mosaic", max_model_len=4096,
                                             compilation_cache=False))
engine.warmup(use_tqdm=False)
print(sys.argv[1], "warm-up:", {k: round(v, 1) if isinstance(v, float) else v for k, v in engine.warmup_profile.items()})
rng = np.random.default_rng(0)
sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
prefix = rng.integers(0, 10_000, 2048).tolist()
batches = [rng.integers(0, 10_000, (8, 32)).tolist(), rng.integers(0, 10_000, (2, 300)).tolist()]
run_to_completion(engine, [prefix], SamplingParams(temperature=0.0, max_tokens=1))
batches.append([prefix + p for p in rng.integers(0, 10_000, (4, 32)).tolist()])
tokens = [[list(o.outputs[0].token_ids) for o in run_to_completion(engine, b, sp)] for b in batches]
json.dump(tokens, open(os.path.join(os.environ.get("OUT", "."), f"tokens_{sys.argv[1]}.json"), "w"))
print(sys.argv[1], "first tokens of each batch's first request:", [t[0][:4] for t in tokens])
