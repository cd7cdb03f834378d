"""Experiment: the KV block size, at a fixed KV memory budget.

The pool always holds the same number of token slots (the same bytes): ``num_blocks = kv_tokens //
block_size``. Two workloads run at every block size:

- ``mixed``: requests of random prompt and output lengths (no sharing). Per step: how full the
  allocated blocks are (``block_utilisation``; 1 - it is internal fragmentation, on average about half
  a block per sequence), how many requests run at once, preemptions, steps, output tokens per second.
- ``shared``: requests sharing a ``--shared-prefix-len``-token system prompt, the first one alone and
  the rest after it, with prefix caching on. Only full blocks are shared, so a request hits
  ``floor(P / block_size) * block_size`` tokens of a ``P``-token prefix: bigger blocks, coarser hits.

Greedy outputs must be the same token ids at every block size (asserted): the block size changes where
K/V live, never what attention computes. Throughput on the tiny model on a CPU measures the host and
XLA-on-CPU, not the kernels: it is only meaningful from a GPU run (``--full``). Compile time stays out
of the timed run: it is rehearsed untimed first on a scratch engine of the same configuration (after
``LLMEngine.warmup()`` on the Pallas backend).

    python benchmarks/experiments/exp_block_size.py [--out DIR]     # tiny model, CPU: the trend
    python benchmarks/experiments/exp_block_size.py --full --out DIR  # the design notes' comparison at Qwen3-0.6B shapes (GPU)

``--full`` runs the design notes' comparison (block size 16 vs 32) on a long-prompt workload: 128
requests of 1,024-1,792 prompt tokens and 64-256 generated, a 64k-token KV budget, a 2,048-token
step budget; our block utilisation is printed next to the design notes' 78% -> 93%, with the
utilisation the tail-block waste alone predicts (about half a block per sequence). Compilation is
kept out of the timings by rehearsing each run first (the schedule is deterministic, so the
rehearsal compiles exactly the shapes the timed run uses). ``--tiny-override`` runs that code path
at tiny sizes (for the CPU tests).

Writes ``block_size.json`` (and ``block_size.png`` when matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import jax

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.models.attention_backends import KERNEL_BACKENDS
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import EXPERIMENT_MODELS, experiment_params, output_divergence, outputs_guaranteed_identical

DESIGN_NOTES = "block size 16 -> 32 raised block utilisation from 78% to 93% on a long-prompt workload"


def mixed_workload(n: int, max_prompt: int, max_out: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(8, max_prompt))] for _ in range(n)]
    sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(8, max_out)) for _ in range(n)]
    return prompts, sps


def long_prompt_workload(n: int, prompt: tuple[int, int], out: tuple[int, int], vocab: int, seed: int = 0):
    """The ``--full`` workload: prompts of ``prompt`` tokens, ``out`` generated (both inclusive ranges)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))] for _ in range(n)]
    sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(*out)) for _ in range(n)]
    return prompts, sps


def shared_workload(n: int, prefix_len: int, vocab: int, max_tokens: int, seed: int = 1):
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(1, vocab) for _ in range(rng.randint(8, 24))] for _ in range(n)]
    return prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def config_for(params, args, block_size: int) -> EngineConfig:
    return EngineConfig(block_size=block_size, num_blocks=args.kv_tokens // block_size,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
                        batch_invariant=args.batch_invariant)


def warm(params, cfg: EngineConfig, rehearse, use_warmup: bool = True) -> None:
    """Compiles every step shape a run will use, outside its timing. ``warmup()`` compiles each token
    bucket, which covers every step on the Pallas backend (fixed block-table width); the reference
    backend pads the table to each step's longest sequence, so only rehearsing the run covers it."""
    scratch = LLMEngine(params, cfg)
    if use_warmup and scratch.runner.attention_backend in KERNEL_BACKENDS:
        scratch.warmup(use_tqdm=False)
    rehearse(scratch)


def run_mixed(params, args, block_size: int, prompts, sps) -> dict:
    cfg = config_for(params, args, block_size)
    # --full: the rehearsal alone compiles every shape the (deterministic) run uses; warmup() would
    # also compile every unused token bucket, per block size.
    warm(params, cfg, lambda engine: run_to_completion(engine, prompts, sps), use_warmup=not args.full)
    engine = LLMEngine(params, cfg)
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sps)
    seconds = time.perf_counter() - t0
    cols = engine.metrics.as_columns()
    s = engine.stats()
    steps = len(cols["num_seqs"])
    # Steps that end holding no block report utilisation 1.0: leave them out of the mean.
    util = [u for u, b in zip(cols["block_utilisation"], cols["blocks_used"]) if b]
    # Slots allocated but not (yet) holding a token, per running sequence: the half-block-ish waste.
    waste = [b * block_size * (1 - f) / n
             for b, f, n in zip(cols["blocks_used"], cols["block_utilisation"], cols["num_seqs"]) if b]
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(block_size=block_size, num_blocks=s["num_blocks"], kv_pool_bytes=s["kv_pool_bytes"],
                seconds=seconds, steps=s["steps"], output_tokens=output_tokens, tokens_per_second=output_tokens / seconds,
                mean_block_utilisation=sum(util) / len(util), internal_fragmentation=1 - sum(util) / len(util),
                mean_wasted_slots_per_seq=sum(waste) / len(waste), peak_running=max(cols["num_seqs"]),
                mean_running=sum(cols["num_seqs"]) / steps, peak_blocks_used=s["peak_blocks_used"],
                preemptions=s["preemptions"], series={k: cols[k] for k in ("num_seqs", "block_utilisation",
                                                                          "blocks_used", "kv_bytes_in_use")},
                output_token_ids=[o.outputs[0].token_ids for o in outs])


def run_shared(params, args, block_size: int, prompts, sp) -> dict:
    engine = LLMEngine(params, config_for(params, args, block_size))
    outs = run_to_completion(engine, prompts[:1], sp) + run_to_completion(engine, prompts[1:], sp)
    s = engine.stats()
    full = args.shared_prefix_len // block_size * block_size
    return dict(block_size=block_size, prefix_hit_tokens=s["prefix_hit_tokens"], prefix_hit_rate=s["prefix_hit_rate"],
                prefill_tokens=s["prefill_tokens"], expected_hit_tokens=(len(prompts) - 1) * full,
                hit_tokens_per_request=[o.num_cached_tokens for o in outs],
                output_token_ids=[o.outputs[0].token_ids for o in outs])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--full", action="store_true", help="the design notes' long-prompt comparison (GPU)")
    ap.add_argument("--model", choices=sorted(EXPERIMENT_MODELS), default=None,
                    help="default: qwen3-0.6b with --full, else tiny")
    ap.add_argument("--tiny-override", action="store_true", help="--full's code path at tiny sizes (CPU tests)")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=None, help="default: 8 16 32 tiny; 8 16 32 64 --full")
    ap.add_argument("--kv-tokens", type=int, default=None,
                    help="KV budget in token slots, the same at every block size (default 4096 tiny, 65536 --full)")
    ap.add_argument("--requests", type=int, default=None, help="mixed workload (default 48 tiny, 512 --full)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 512 tiny, 2048 --full")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 256, 64 --full")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 1024 tiny, 8192 --full")
    ap.add_argument("--shared-requests", type=int, default=8)
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig(batch_invariant=True)")
    ap.add_argument("--shared-prefix-len", type=int, default=120,
                    help="shared system prompt; not a multiple of the larger block sizes, on purpose")
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny" if args.tiny_override or not args.full else "qwen3-0.6b")
    args.prompt_range = args.out_range = None  # --full: the long-prompt workload
    if args.full and args.tiny_override:
        defaults = dict(block_sizes=[16, 32], kv_tokens=1024, requests=8, max_model_len=128,
                        max_num_batched_tokens=128, prompt_range=(40, 90), out_range=(4, 12), max_num_seqs=8,
                        shared_requests=4, shared_prefix_len=40)
    elif args.full:
        defaults = dict(block_sizes=[16, 32], kv_tokens=65536, requests=128, max_model_len=2048,
                        max_num_batched_tokens=2048, prompt_range=(1024, 1792), out_range=(64, 256), max_num_seqs=64)
    else:
        defaults = dict(block_sizes=[8, 16, 32], kv_tokens=4096, requests=48, max_model_len=512,
                        max_num_batched_tokens=1024, max_num_seqs=256)
    for name, value in defaults.items():
        if getattr(args, name, None) is None or (args.full and args.tiny_override):
            setattr(args, name, value)
    if args.shared_prefix_len + 24 + 8 > args.max_model_len:
        ap.error("--shared-prefix-len does not fit in --max-model-len")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    params = experiment_params(args.full, args.model)
    vocab = params.config.vocab_size
    if args.full:
        prompts, sps = long_prompt_workload(args.requests, args.prompt_range, args.out_range, vocab)
    else:
        prompts, sps = mixed_workload(args.requests, args.max_model_len // 2, args.max_model_len // 2, vocab)
    shared_prompts, shared_sp = shared_workload(args.shared_requests, args.shared_prefix_len, vocab, max_tokens=8)
    mixed = [run_mixed(params, args, bs, prompts, sps) for bs in args.block_sizes]
    shared = [run_shared(params, args, bs, shared_prompts, shared_sp) for bs in args.block_sizes]
    guaranteed = outputs_guaranteed_identical(params.dtype, args.batch_invariant)
    identical = True
    for rs, name in ((mixed, "mixed"), (shared, "shared")):
        for r in rs[1:]:
            div = output_divergence(rs[0]["output_token_ids"], r["output_token_ids"])
            r["differ_from_first_block_size"] = div
            identical &= div["num_differ"] == 0
            if guaranteed:
                assert div["num_differ"] == 0, \
                    f"{name} workload: greedy outputs at block size {r['block_size']} differ from {rs[0]['block_size']}"
            elif div["num_differ"]:
                print(f"{name} workload, block size {r['block_size']}: {div['num_differ']}/{div['num_requests']} "
                      f"outputs differ from block size {rs[0]['block_size']} (bf16 without batch_invariant); "
                      f"first divergent positions {div['first_divergence']}")
    report = {"device": str(jax.devices()[0]), "args": vars(args), "outputs_identical": identical,
              "throughput_meaningful": jax.devices()[0].platform == "gpu", "mixed": mixed, "shared": shared}
    if args.full:
        report["design_notes_rows"] = [design_notes_row(mixed, prompts, sps, args)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "block_size.json"), "w") as f:
        json.dump(report, f)
    plot(mixed, shared, args)
    print(f"KV budget {args.kv_tokens} token slots at every block size; {args.requests} mixed requests, "
          f"{args.shared_requests} sharing a {args.shared_prefix_len}-token prefix")
    print(f"{'bs':>3s} {'blocks':>6s} {'KV util':>7s} {'waste/seq':>9s} {'peak batch':>10s} {'preempt':>7s} "
          f"{'steps':>5s} {'tok/s':>8s} {'prefix hit tok':>14s} {'(full blocks)':>13s} {'hit rate':>8s}")
    for m, s in zip(mixed, shared):
        print(f"{m['block_size']:3d} {m['num_blocks']:6d} {m['mean_block_utilisation']:7.1%} "
              f"{m['mean_wasted_slots_per_seq']:9.1f} {m['peak_running']:10d} {m['preemptions']:7d} {m['steps']:5d} "
              f"{m['tokens_per_second']:8.0f} {s['prefix_hit_tokens']:14d} {s['expected_hit_tokens']:13d} "
              f"{s['prefix_hit_rate']:8.1%}")
    print(f"greedy outputs identical at every block size: {'yes' if identical else 'no'}"
          f"{'' if guaranteed else ' (not guaranteed: bf16 without --batch-invariant)'}")
    if not report["throughput_meaningful"]:
        print("(not a GPU: tok/s measures the host and XLA on CPU, not the kernels; run --full on a GPU)")
    for row in report.get("design_notes_rows", []):
        print(f"[{row['experiment']}] design notes: {row['design_notes']}\n    ours ({row['model']}): {row['ours']}")
    return report


def design_notes_row(mixed: list[dict], prompts, sps, args) -> dict:
    """Our utilisation per block size next to the design notes', with what tail waste predicts: a
    sequence of ``L`` tokens wastes ``ceil(L/bs)*bs - L`` slots, about ``bs/2``, so utilisation is
    about ``1 - bs/2 / L`` for the mean length ``L`` a running sequence has (prompt + half its output)."""
    mean_len = sum(len(p) + sp.max_tokens / 2 for p, sp in zip(prompts, sps)) / len(prompts)
    parts = [f"bs {m['block_size']}: {m['mean_block_utilisation']:.1%} (tail waste predicts "
             f"{1 - m['block_size'] / 2 / mean_len:.1%}), {m['tokens_per_second']:.0f} tok/s, "
             f"peak batch {m['peak_running']}" for m in mixed]
    return dict(experiment="block_size", design_notes=DESIGN_NOTES, model=args.model,
                ours="; ".join(parts) + f"; mean sequence length {mean_len:.0f} tokens")


def plot(mixed: list[dict], shared: list[dict], args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for m in mixed:
        util = [u if b else float("nan") for u, b in zip(m["series"]["block_utilisation"], m["series"]["blocks_used"])]
        axes[0].plot(util, label=f"block size {m['block_size']}")
        axes[1].plot(m["series"]["num_seqs"], label=f"block size {m['block_size']}")
    axes[0].set(xlabel="step", ylabel="filled / allocated KV slots", ylim=(0, 1.05),
                title=f"mixed workload, {args.kv_tokens} KV slots")
    axes[1].set(xlabel="step", ylabel="requests in the batch")
    axes[0].legend()
    labels = [str(s["block_size"]) for s in shared]
    axes[2].bar(labels, [s["prefix_hit_tokens"] for s in shared])
    axes[2].set(xlabel="block size", ylabel="prefix-cache hit tokens",
                title=f"{args.shared_requests} requests, {args.shared_prefix_len}-token shared prefix")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "block_size.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
