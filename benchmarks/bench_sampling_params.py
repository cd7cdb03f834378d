"""What vLLM's sampling parameters cost: nano-vllm's throughput workload with each one turned on.

Variants (the same prompts and max_tokens; temperature 0.6, ignore_eos, as nano-vllm's bench.py):
  baseline     no new parameter: the default step (must match bench_throughput.py's number)
  logprobs=5   top-5 logprobs of every generated token (step variant with log_softmax + top_k)
  penalties    presence 0.5, frequency 0.5, repetition 1.1 (token histories sent with the step)
  min_p=0.05   min-p filter
  baseline2    the default step again, after the variants (noise / nothing leaked into it)
Throughput = output tokens / (wall - compile seconds of the steps first seen in that run): each variant
compiles its own step shapes once (reported separately); JAX's persistent cache makes a rerun faster.

    python benchmarks/bench_sampling_params.py --out $OUT                # H200: Qwen3-0.6B shapes, random bf16
    python benchmarks/bench_sampling_params.py --model tiny --out /tmp   # CPU smoke run (tiny checkpoint)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import QWEN3_0_6B, nano_vllm_workload, random_model

VARIANTS = {
    "baseline": {},
    "logprobs=5": dict(logprobs=5),
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "min_p=0.05": dict(min_p=0.05),
    "baseline2": {},
}


def setup(args):
    if args.model == "tiny":
        from jaxpaged import load_params
        from jaxpaged.models.tiny import tiny_checkpoint_path

        params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
        prompts, sps = nano_vllm_workload(args.num_seqs or 6, max_input_len=100, max_output_len=100)
        prompts = [[t % params.config.vocab_size for t in p[:40]] for p in prompts]  # short, in the tiny vocab
        sps = [dataclasses.replace(sp, max_tokens=8 + i % 5) for i, sp in enumerate(sps)]
        config = EngineConfig(block_size=8, num_blocks=128, max_model_len=128, max_num_seqs=8,
                              max_num_batched_tokens=128, attention_backend="reference")
        return params, prompts, sps, config
    params = random_model(QWEN3_0_6B)
    prompts, sps = nano_vllm_workload(args.num_seqs or 256, max_output_len=args.max_output_len)
    config = EngineConfig(block_size=args.block_size, max_model_len=2048, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, memory_fraction=0.9)
    return params, prompts, sps, config


def run_variant(engine: LLMEngine, prompts, sps, extra: dict) -> dict:
    """One pass of the workload with ``extra`` sampling params on a fresh engine (empty prefix cache)."""
    sps = [dataclasses.replace(sp, **extra) for sp in sps]
    compile0, shapes0 = engine.runner.compile_seconds, engine.runner.num_compiled_shapes
    steps0 = engine.scheduler.counters.steps
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sps)
    wall = time.perf_counter() - t0
    compile_s = engine.runner.compile_seconds - compile0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if "logprobs" in extra:
        assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)
    return dict(output_tokens=tokens, wall_s=wall, compile_s=compile_s, run_s=wall - compile_s,
                tok_per_s=tokens / max(wall - compile_s, 1e-9), new_shapes=engine.runner.num_compiled_shapes - shapes0,
                steps=engine.scheduler.counters.steps - steps0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("full", "tiny"), default="full")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--num-seqs", type=int, default=None)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--variants", default="baseline,logprobs=5,penalties,baseline2",
                    help="comma-separated, from " + ", ".join(VARIANTS) + " (min_p=0.05 is off by default: time)")
    args = ap.parse_args(argv)
    params, prompts, sps, config = setup(args)
    engine = LLMEngine(params, config)
    warm = engine.warmup(use_tqdm=False)  # the default step's buckets
    results = {}
    for name in args.variants.split(","):
        # A fresh engine per variant (compiled steps are shared through the weights): every variant
        # starts from an empty prefix cache, so none gets the previous one's prompts for free.
        del engine
        gc.collect()
        engine = LLMEngine(params, config)
        run_to_completion(engine, [[1] * 16], SamplingParams(max_tokens=4))
        results[name] = run_variant(engine, prompts, sps, VARIANTS[name])
        engine.kv.check_invariants()
    base = results.get("baseline", next(iter(results.values())))["tok_per_s"]
    report = dict(model=args.model, num_seqs=len(prompts), warmup_compile_s=warm, variants=results,
                  backend=engine.stats()["attention_backend"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sampling_params.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'variant':<12} {'tok/s':>10} {'vs base':>8} {'run s':>8} {'compile s':>10} {'shapes':>7} {'steps':>6}")
    for name, r in results.items():
        print(f"{name:<12} {r['tok_per_s']:>10.1f} {r['tok_per_s'] / base:>8.3f} {r['run_s']:>8.2f} "
              f"{r['compile_s']:>10.2f} {r['new_shapes']:>7d} {r['steps']:>6d}")
    return report


if __name__ == "__main__":
    main()
