"""Experiment: paged KV blocks vs. max-length reservation, same model, same kernel, same requests.

Only the allocator differs: ``paged`` hands out a block when the last one fills; ``max_len`` reserves
``ceil(max_model_len / block_size)`` contiguous blocks per request at admission, as a contiguous KV
cache does. With the pool fixed, the question is how many requests run at once, how many steps the
workload takes, and how much of the allocated KV memory holds tokens.

    python benchmarks/exp_memory.py [--full] [--out DIR]     # --full: Qwen3-0.6B shapes (GPU)

Writes ``memory.json`` (and ``memory.png`` when matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import jax

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import experiment_params


def workload(n: int, max_prompt: int, max_out: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, max_prompt))] for _ in range(n)]
    sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(16, max_out)) for _ in range(n)]
    return prompts, sps


def run(params, policy: str, prompts, sps, args) -> dict:
    cfg = EngineConfig(dtype=params.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
                       max_model_len=args.max_model_len, max_num_seqs=256, reservation=policy,
                       enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(params, cfg)
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sps)
    seconds = time.perf_counter() - t0
    cols = engine.metrics.as_columns()
    s = engine.stats()
    return dict(policy=policy, seconds=seconds, steps=s["steps"], output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                peak_running=max(cols["num_seqs"]), mean_running=sum(cols["num_seqs"]) / len(cols["num_seqs"]),
                mean_block_utilisation=sum(cols["block_utilisation"]) / len(cols["block_utilisation"]),
                peak_blocks_used=s["peak_blocks_used"], preemptions=s["preemptions"],
                admission_refusals=s["max_len_admission_failures"], series=cols)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--full", action="store_true", help="Qwen3-0.6B shapes with random weights (GPU)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    params = experiment_params(args.full)
    prompts, sps = workload(args.requests, args.max_model_len // 2, args.max_model_len // 2, params.config.vocab_size)
    results = [run(params, policy, prompts, sps, args) for policy in ("paged", "max_len")]
    report = {"device": str(jax.devices()[0]), "args": vars(args), "results": results}
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump(report, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
        for r in results:
            axes[0].plot(r["series"]["num_seqs"], label=r["policy"])
            axes[1].plot(r["series"]["block_utilisation"], label=r["policy"])
        axes[0].set(xlabel="step", ylabel="requests in the batch", title=f"pool of {args.num_blocks} blocks")
        axes[1].set(xlabel="step", ylabel="filled / allocated KV slots", ylim=(0, 1.05))
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "memory.png"), dpi=120)
    except ImportError:
        pass
    print(f"{'policy':8s} {'steps':>6s} {'seconds':>8s} {'peak batch':>10s} {'mean batch':>10s} {'KV utilisation':>14s} {'refusals':>8s}")
    for r in results:
        print(f"{r['policy']:8s} {r['steps']:6d} {r['seconds']:8.2f} {r['peak_running']:10d} {r['mean_running']:10.1f} "
              f"{r['mean_block_utilisation']:14.1%} {r['admission_refusals']:8d}")
    return report


if __name__ == "__main__":
    main()
