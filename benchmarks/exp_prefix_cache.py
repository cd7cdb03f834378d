"""Experiment: how much prefill does block-level prefix caching save when requests share a system prompt?

Every request is ``system prompt (S tokens) + a distinct short question``. For each ``S`` the same
requests run with prefix caching on and off, in two arrival patterns:

- ``sequential``: one request at a time (each arrives after the previous one finished). Request 0
  fills the cache; every later one finds the system prompt's full blocks there, so its TTFT is the
  latency of prefilling only the question. This is the clean per-request speed-up.
- ``batch``: all requests arrive together. Requests admitted in the same step as the first cannot hit
  (its blocks enter the cache only once they are computed), the rest can: wall time, prefill tokens.

Compile time stays out of the timings: before each timed run, the same run is rehearsed untimed on a
scratch engine of the same configuration (after ``LLMEngine.warmup()`` on the Pallas backend), and
each timed run starts on a fresh engine with an empty cache. Greedy outputs must be identical with
caching on and off where that is guaranteed (float32, or ``--batch-invariant``: asserted); in default
bf16 the number of requests whose tokens differ and their first divergent position are reported.

Then the classic cache-miss diagnosis: a system prompt that embeds a per-request timestamp. Caching
can only share full blocks before the first differing token, which ``explain_prefix`` reports; moving
the timestamp after the system prompt restores the hits. Both hit rates are measured.

    python benchmarks/exp_prefix_cache.py [--full] [--out DIR]     # --full: Qwen3-0.6B shapes (GPU)

Writes ``prefix_cache.json`` (and ``prefix_cache.png`` when matplotlib is installed) under ``--out``.
CPU timings of the tiny model show the trend only; absolute numbers belong to a GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import jax

import jaxpaged
from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import experiment_params, output_divergence, outputs_guaranteed_identical

MODES = ("sequential", "batch")


def shared_prefix_prompts(num_requests: int, prefix_len: int, vocab: int, question_len: tuple[int, int] = (16, 32),
                          seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts: one shared ``prefix_len``-token system prompt + a distinct question each."""
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    return [system + [rng.randrange(1, vocab) for _ in range(rng.randint(*question_len))] for _ in range(num_requests)]


def timestamped_prompts(num_requests: int, prefix_len: int, vocab: int, timestamp_at: int, timestamp_len: int = 6,
                        inside: bool = True, seed: int = 1) -> list[list[int]]:
    """A system prompt whose tokens ``[timestamp_at, timestamp_at + timestamp_len)`` are a per-request
    timestamp (``inside``), or the same request with the timestamp moved after the system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(prefix_len)]
    prompts = []
    for _ in range(num_requests):
        stamp = [rng.randrange(1, vocab) for _ in range(timestamp_len)]
        question = [rng.randrange(1, vocab) for _ in range(rng.randint(16, 32))]
        if inside:
            prompts.append(system[:timestamp_at] + stamp + system[timestamp_at:] + question)
        else:
            prompts.append(system + stamp + question)
    return prompts


def config_for(params, args, caching: bool) -> EngineConfig:
    return EngineConfig(dtype=params.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching,
                        batch_invariant=args.batch_invariant)


def execute(engine: LLMEngine, prompts, sp: SamplingParams, mode: str):
    if mode == "sequential":
        return [run_to_completion(engine, [p], sp)[0] for p in prompts]
    return run_to_completion(engine, prompts, sp)


def warm(params, cfg: EngineConfig, rehearse) -> None:
    """Compiles every step shape a run will use, outside its timing. ``warmup()`` compiles each token
    bucket, which covers every step on the Pallas backend (fixed block-table width); the reference
    backend pads the table to each step's longest sequence, so only rehearsing the run covers it."""
    scratch = LLMEngine(params, cfg)
    if scratch.runner.attention_backend == "pallas":
        scratch.warmup(use_tqdm=False)
    rehearse(scratch)


def run(params, prompts, sp: SamplingParams, args, caching: bool, mode: str, prefix_len: int) -> dict:
    cfg = config_for(params, args, caching)
    warm(params, cfg, lambda engine: execute(engine, prompts, sp, mode))
    engine = LLMEngine(params, cfg)  # fresh pool, empty prefix cache
    t0 = time.perf_counter()
    outs = execute(engine, prompts, sp, mode)
    seconds = time.perf_counter() - t0
    s = engine.stats()
    ttft = [o.metrics.time_to_first_token for o in outs]
    return dict(prefix_len=prefix_len, caching=caching, mode=mode,
                seconds=seconds, steps=s["steps"], prompt_tokens=sum(len(p) for p in prompts),
                prefill_tokens=s["prefill_tokens"], prefix_hit_tokens=s["prefix_hit_tokens"],
                prefix_hit_rate=s["prefix_hit_rate"], num_cached_tokens=[o.num_cached_tokens for o in outs],
                ttft=ttft, ttft_first=ttft[0], ttft_rest_mean=statistics.fmean(ttft[1:]) if len(ttft) > 1 else ttft[0],
                output_token_ids=[o.outputs[0].token_ids for o in outs])


def timestamp_diagnosis(params, args) -> dict:
    """explain_prefix on two requests whose system prompts differ only in a timestamp; hit rates."""
    vocab, prefix_len = params.config.vocab_size, max(args.prefix_lens)
    at = min(args.timestamp_at, prefix_len)
    inside = timestamped_prompts(args.requests, prefix_len, vocab, at, inside=True)
    moved = timestamped_prompts(args.requests, prefix_len, vocab, at, inside=False)
    engine = LLMEngine(params, config_for(params, args, True))
    why = engine.explain_prefix(inside[0], inside[1])
    assert why == jaxpaged.explain_prefix(inside[0], inside[1], args.block_size)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    out = dict(block_size=args.block_size, system_prompt_len=prefix_len, timestamp_at=at,
               explain_prefix=str(why), shared_full_blocks=why.shared_full_blocks,
               first_diff_token=why.first_diff_token, first_diff_block=why.first_diff_block)
    for name, prompts in (("inside", inside), ("moved", moved)):
        engine = LLMEngine(params, config_for(params, args, True))
        execute(engine, prompts, sp, "sequential")
        s = engine.stats()
        out[f"hit_rate_{name}"] = s["prefix_hit_rate"]
        out[f"prefill_tokens_{name}"] = s["prefill_tokens"]
    out["explain_prefix_moved"] = str(engine.explain_prefix(moved[0], moved[1]))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--full", action="store_true", help="Qwen3-0.6B shapes with random weights (GPU)")
    ap.add_argument("--prefix-lens", type=int, nargs="+", default=None,
                    help="system prompt lengths S (default: 0 128 512 tiny; 0 256 1024 4096 --full)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=None, help="default: enough for every request at once")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 1024 tiny, 8192 --full")
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig(batch_invariant=True)")
    ap.add_argument("--timestamp-at", type=int, default=40, help="token where the timestamp sits in the system prompt")
    args = ap.parse_args(argv)
    if args.prefix_lens is None:
        args.prefix_lens = [0, 256, 1024, 4096] if args.full else [0, 128, 512]
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 8192 if args.full else 1024
    longest = max(args.prefix_lens) + 32 + 6 + args.max_tokens  # + question + timestamp + output
    args.max_model_len = -(-longest // args.block_size) * args.block_size
    if args.num_blocks is None:
        args.num_blocks = args.requests * (args.max_model_len // args.block_size) + 16
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    params = experiment_params(args.full)
    vocab = params.config.vocab_size
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    results = []
    for prefix_len in args.prefix_lens:
        prompts = shared_prefix_prompts(args.requests, prefix_len, vocab)
        for mode in args.modes:
            off, on = (run(params, prompts, sp, args, caching, mode, prefix_len) for caching in (False, True))
            div = output_divergence(off["output_token_ids"], on["output_token_ids"])
            on["differ_from_caching_off"] = div
            if outputs_guaranteed_identical(params.dtype, args.batch_invariant):
                assert div["num_differ"] == 0, f"S={prefix_len} {mode}: caching changed outputs: {div}"
            elif div["num_differ"]:
                print(f"S={prefix_len} {mode}: caching changed {div['num_differ']}/{div['num_requests']} outputs "
                      f"(bf16 without batch_invariant; first divergent positions {div['first_divergence']})")
            results += [off, on]
    diagnosis = timestamp_diagnosis(params, args)
    report = {"device": str(jax.devices()[0]), "args": vars(args), "results": results, "timestamp": diagnosis}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefix_cache.json"), "w") as f:
        json.dump(report, f)
    plot(results, args)
    print(f"{'S':>5s} {'mode':10s} {'cache':5s} {'prompt tok':>10s} {'prefilled':>9s} {'hit rate':>8s} "
          f"{'TTFT req0 ms':>12s} {'TTFT rest ms':>12s} {'wall s':>7s}")
    for r in results:
        print(f"{r['prefix_len']:5d} {r['mode']:10s} {'on' if r['caching'] else 'off':5s} {r['prompt_tokens']:10d} "
              f"{r['prefill_tokens']:9d} {r['prefix_hit_rate']:8.1%} {r['ttft_first'] * 1e3:12.1f} "
              f"{r['ttft_rest_mean'] * 1e3:12.1f} {r['seconds']:7.2f}")
    d = diagnosis
    print(f"timestamp at token {d['timestamp_at']} of a {d['system_prompt_len']}-token system prompt: "
          f"{d['explain_prefix']}")
    print(f"  hit rate {d['hit_rate_inside']:.1%} (prefilled {d['prefill_tokens_inside']} tokens); timestamp moved "
          f"after the system prompt: {d['hit_rate_moved']:.1%} (prefilled {d['prefill_tokens_moved']})")
    if "cpu" in report["device"].lower():
        print("(CPU run: timings show the trend only; run --full on a GPU for real TTFT numbers)")
    return report


def plot(results: list[dict], args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    mode = "sequential" if "sequential" in args.modes else args.modes[0]
    rows = [r for r in results if r["mode"] == mode]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for caching, style in ((False, "o--"), (True, "o-")):
        rs = [r for r in rows if r["caching"] == caching]
        label = f"prefix caching {'on' if caching else 'off'}"
        axes[0].plot([r["prefix_len"] for r in rs], [r["prefill_tokens"] for r in rs], style, label=label)
        axes[1].plot([r["prefix_len"] for r in rs], [r["ttft_rest_mean"] * 1e3 for r in rs], style, label=label)
        longest = max(rs, key=lambda r: r["prefix_len"])
        axes[2].plot(range(len(longest["ttft"])), [t * 1e3 for t in longest["ttft"]], style, label=label)
    axes[0].set(xlabel="shared system prompt S (tokens)", ylabel="prefill tokens computed", title=f"{mode} arrivals")
    axes[1].set(xlabel="shared system prompt S (tokens)", ylabel="mean TTFT of requests 1.. (ms)")
    axes[2].set(xlabel="request", ylabel="TTFT (ms)", title=f"S = {max(args.prefix_lens)}")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "prefix_cache.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
