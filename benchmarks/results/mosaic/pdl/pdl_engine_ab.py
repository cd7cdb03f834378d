"""The engine with the Mosaic kernels as programmatic dependent launches (``pdl_ab.pdl_kernels``: each
kernel body started by ``griddepcontrol_wait``) against the engine on the kernels as they are and on
Triton's, in one process, measured in turn on the same prompts (``bench_latency.py``'s runs: TTFT and
ITL p50, greedy, 64 output tokens; each engine settles before each of its runs). The PDL engine
compiles its steps inside ``pdl_kernels()``; no engine reads or writes the compiled-step cache (its
key holds the sources, which the shim leaves as they are). Qwen3-0.6B shapes, random bf16 weights
(``--model tiny``: the tiny shapes at head_dim 64, for a CPU, where the shim changes nothing: the
interpreter runs the kernels).

    python3 benchmarks/results/mosaic/pdl/pdl_engine_ab.py [--batches 1,64,256] [--prompts 32]
"""
import argparse
import contextlib
import dataclasses
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), "benchmarks"]

import numpy as np  # noqa: E402
from bench_latency import repeats_for, run_batch, summarise  # noqa: E402
from pdl_ab import pdl_kernels  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jaxpaged.workloads import benchmark_params  # noqa: E402

VARIANTS = {"triton": ("triton", contextlib.nullcontext), "mosaic": ("mosaic", contextlib.nullcontext),
            "mosaic_pdl": ("mosaic", pdl_kernels)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompts", default="32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.prompts.split(",")]
    names = args.variants.split(",")
    if args.model == "tiny":  # (the tiny shapes at head_dim 64, which the Mosaic kernels read)
        from jaxpaged.models.checkpoint import random_params
        from jaxpaged.models.config import QwenConfig
        from jaxpaged.models.tiny import tiny_config

        params = random_params(QwenConfig.from_dict({**tiny_config("qwen3", 512), "head_dim": 64}), "bfloat16")
    else:
        params = benchmark_params(args.model)
    max_model_len = -(-(max(lengths) + args.max_tokens) // 16) * 16
    config = EngineConfig(block_size=16, num_blocks=max(batches) * (max_model_len // 16) + 1,
                          max_num_seqs=max(batches), max_model_len=max_model_len, compilation_cache=False)
    engines = {n: LLMEngine(params, dataclasses.replace(config, attention_backend=VARIANTS[n][0])) for n in names}
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = min(params.config.vocab_size, 10_000)
    rows = []
    for length in lengths:
        for batch in batches:
            for name, engine in engines.items():
                with VARIANTS[name][1]():  # every shape this row needs, compiled in the variant's context
                    for _ in range(engine.runner.step_executables):
                        run_batch(engine, rng.integers(0, vocab, (batch, length)).tolist(), sp)
                        engine.settle(1)
            compiled = {n: e.runner.num_compiled_executables for n, e in engines.items()}
            runs = {n: [] for n in engines}
            for _ in range(repeats_for(batch, args.repeats)):
                prompts = rng.integers(0, vocab, (batch, length)).tolist()
                for name, engine in engines.items():
                    engine.settle(1)
                    runs[name].append(run_batch(engine, prompts, sp))
            for name, engine in engines.items():
                row = dict(variant=name, batch=batch, prompt_len=length, **summarise(runs[name]),
                           recompiles_while_measuring=engine.runner.num_compiled_executables - compiled[name],
                           tokens_equal_to_first=float(np.mean([a["token_ids"] == b["token_ids"] for a, b in
                                                                zip(runs[names[0]], runs[name])])))
                rows.append(row)
                print(f"{name:11s} batch {batch:3d} prompt {length:5d}: TTFT p50 {row['ttft_p50_ms']:.2f} ms, "
                      f"ITL p50 {row['itl_p50_ms']:.3f} ms, runs {row['runs']}, recompiles "
                      f"{row['recompiles_while_measuring']}, runs with {names[0]}'s tokens "
                      f"{row['tokens_equal_to_first']:.0%}", flush=True)
    print(f"\n| batch, prompt | {' | '.join(f'{n} TTFT / ITL p50, ms' for n in names)} | ITL {names[-1]} / {names[1] if len(names) > 2 else names[0]} |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for i in range(0, len(rows), len(names)):
        group = rows[i:i + len(names)]
        base = group[1] if len(group) > 2 else group[0]
        print(f"| {group[0]['batch']}, {group[0]['prompt_len']} | "
              + " | ".join(f"{r['ttft_p50_ms']:.2f} / {r['itl_p50_ms']:.3f}" for r in group)
              + f" | {group[-1]['itl_p50_ms'] / base['itl_p50_ms']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
