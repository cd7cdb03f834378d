"""Experiment: how much prefill does block-level prefix caching save when requests share a system prompt?

Every request is ``system prompt (S tokens) + a distinct short question``. For each ``S`` the same
requests run with prefix caching on and off, in two arrival patterns:

- ``sequential``: one request at a time (each arrives after the previous one finished). Request 0
  fills the cache; every later one finds the system prompt's full blocks there, so its TTFT is the
  latency of prefilling only the question. This is the clean per-request speed-up.
- ``batch``: all requests arrive together. Requests admitted in the same step as the first cannot hit
  (its blocks enter the cache only once they are computed), the rest can: wall time, prefill tokens.

Compile time stays out of the timings: before each timed run, its workload is rehearsed untimed on a
scratch engine of the same configuration (after ``LLMEngine.warmup()`` on the Pallas backend), and
each timed run starts on a fresh engine with an empty cache. Greedy outputs must be identical with
caching on and off where that is guaranteed (float32, or ``--batch-invariant``: asserted); in default
bf16 the number of requests whose tokens differ and their first divergent position are reported.

Then the classic cache-miss diagnosis: a system prompt that embeds a per-request timestamp. Caching
can only share full blocks before the first differing token, which ``explain_prefix`` reports; moving
the timestamp after the system prompt restores the hits. Both hit rates are measured.

    python benchmarks/experiments/exp_prefix_cache.py [--out DIR]                        # tiny model, CPU: the trend
    python benchmarks/experiments/exp_prefix_cache.py --full [--model qwen2.5-7b] --out DIR  # the design notes' workload (GPU)

``--full`` runs the design notes' workload instead (``run_full``): a ~1,500-token system prompt and
100 different user questions, caching off and on, served by closed-loop clients (each sends its
next question when its answer is complete) at concurrency 1, 4, 16 and 64, with one engine
configuration throughout (so compiled steps are shared). Concurrency 1 gives the per-request
prefill latency (TTFT of requests 1.., uncached vs cached) and the decode latency (ITL); the sweep
gives throughput and TTFT p50/p99. Then the timestamp diagnosis at the same sizes (a timestamp
after the 10th block of the system prompt). Our numbers are printed next to the design notes'.
Last, cached prefixes at the same memory (``prefix_capacity``): several system prompts asked in turn
through a pool that holds about 60% of them in the model's dtype, and through an fp8 pool
(``kv_cache_dtype="fp8"``) of the same bytes.
``--tiny-override`` runs that code path at tiny sizes (for the CPU tests).

Writes ``prefix_cache.json`` (and ``prefix_cache.png`` when matplotlib is installed) under ``--out``.
CPU timings of the tiny model show the trend only; absolute numbers belong to a GPU run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time

import jax

import jaxpaged
from jaxpaged.engine.metrics import percentile
from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.models.attention_backends import KERNEL_BACKENDS
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import EXPERIMENT_MODELS, experiment_params, output_divergence, outputs_guaranteed_identical

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
    return EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=caching,
                        batch_invariant=args.batch_invariant)


def execute(engine: LLMEngine, prompts, sp: SamplingParams, mode: str):
    if mode == "sequential":
        return [run_to_completion(engine, [p], sp)[0] for p in prompts]
    return run_to_completion(engine, prompts, sp)


def warm(params, cfg: EngineConfig, rehearse, rehearse_on_pallas: bool = True) -> None:
    """Compiles every step shape a run will use, outside its timing. ``warmup()`` compiles each token
    bucket, which covers every step on the Pallas backend (fixed block-table width); the reference
    backend pads the table to each step's longest sequence, so only rehearsing the run covers it."""
    scratch = LLMEngine(params, cfg)
    if scratch.runner.attention_backend in KERNEL_BACKENDS:
        scratch.warmup(use_tqdm=False)
        if not rehearse_on_pallas:  # warmup() compiled every shape the Pallas backend uses
            return
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
    ap.add_argument("--full", action="store_true", help="the design notes' workload at --model shapes (GPU)")
    ap.add_argument("--model", choices=sorted(EXPERIMENT_MODELS), default=None,
                    help="default: qwen3-0.6b with --full, else tiny")
    ap.add_argument("--tiny-override", action="store_true", help="--full's code path at tiny sizes (CPU tests)")
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
    args.model = args.model or ("tiny" if args.tiny_override or not args.full else "qwen3-0.6b")
    if args.full:
        return full_settings(args)
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
    params = experiment_params(args.full, args.model)
    if args.full:
        report = {"device": str(jax.devices()[0]), "args": vars(args), "model": args.model, **run_full(params, args)}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "prefix_cache.json"), "w") as f:
            json.dump(report, f)
        print_full(report)
        plot_full(report, args.out)
        return report
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


# ---- --full: the design notes' workload ------------------------------------------------------------
DESIGN_NOTES = {
    "prefix_ttft": "~1,500-token system prompt + 100 questions: prefill ~280 ms uncached -> ~12 ms cached "
                   "(23x), decode unchanged",
    "prefix_concurrency": "concurrency 1 -> 16 shows the throughput gain of caching + paging",
    "timestamp_miss": "hit rate 0 from a timestamp in the system prompt (first 10 blocks matched, the 11th "
                      "did not); removing it gave > 90%",
}


def full_settings(args: argparse.Namespace) -> argparse.Namespace:
    """The design notes' sizes (or tiny ones with ``--tiny-override``), set on ``args``; one engine
    shape (pool, token budget, batch) serves every run, the timestamp diagnosis included."""
    if args.tiny_override:
        sizes = dict(system_len=100, questions=8, max_tokens=4, concurrency=[1, 4], c1_requests=4,
                     max_num_seqs=4, max_num_batched_tokens=64, timestamp_at=32, requests=4,
                     capacity_prefixes=4, capacity_rounds=2)
    else:
        sizes = dict(system_len=1500, questions=100, max_tokens=16, concurrency=[1, 4, 16, 64], c1_requests=24,
                     max_num_seqs=64, max_num_batched_tokens=2048, timestamp_at=160, requests=8,
                     capacity_prefixes=8, capacity_rounds=3)
    for k, v in sizes.items():
        setattr(args, k, v)
    args.prefix_lens = [args.system_len]
    longest = args.system_len + 32 + 6 + args.max_tokens  # + question + timestamp + output
    args.max_model_len = -(-longest // args.block_size) * args.block_size
    if args.num_blocks is None:  # every client's request at once, caching off: no preemption
        args.num_blocks = args.max_num_seqs * (args.max_model_len // args.block_size) + 16
    return args


def closed_loop(engine: LLMEngine, prompts, sp: SamplingParams, concurrency: int):
    """``concurrency`` clients, each sending its next prompt when its previous answer is complete
    (TTFT counts from the moment a prompt is sent). Returns the outputs in prompt order."""
    todo = list(enumerate(prompts))[::-1]
    rid_index, outs = {}, {}
    for _ in range(min(concurrency, len(todo))):
        i, p = todo.pop()
        rid_index[engine.add_request(p, sp)] = i
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[rid_index[out.request_id]] = out
            if todo:
                i, p = todo.pop()
                rid_index[engine.add_request(p, sp)] = i
    return [outs[i] for i in range(len(prompts))]


def sweep_point(params, cfg: EngineConfig, prompts, sp, concurrency: int) -> dict:
    engine = LLMEngine(params, cfg)  # fresh pool, empty prefix cache
    t0 = time.perf_counter()
    outs = closed_loop(engine, prompts, sp, concurrency)
    seconds = time.perf_counter() - t0
    s = engine.stats()
    ttft = [o.metrics.time_to_first_token for o in outs]
    itl = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
           for o in outs if len(o.outputs[0].token_ids) > 1]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(caching=cfg.enable_prefix_caching, concurrency=concurrency, requests=len(prompts), seconds=seconds,
                output_tokens=out_tokens, output_tokens_per_second=out_tokens / seconds,
                requests_per_second=len(prompts) / seconds, ttft_ms=[t * 1e3 for t in ttft],
                ttft_first_ms=ttft[0] * 1e3, ttft_rest_mean_ms=statistics.fmean(ttft[1:]) * 1e3 if len(ttft) > 1 else None,
                ttft_p50_ms=percentile(ttft, 50) * 1e3, ttft_p99_ms=percentile(ttft, 99) * 1e3,
                itl_mean_ms=statistics.fmean(itl) * 1e3 if itl else None, prefill_tokens=s["prefill_tokens"],
                prefix_hit_rate=s["prefix_hit_rate"], steps=s["steps"], preemptions=s["preemptions"],
                compiled_shapes_during_run=s["compiled_shapes"],
                output_token_ids=[o.outputs[0].token_ids for o in outs])


def run_full(params, args) -> dict:
    """Caching off/on x concurrency, closed-loop clients; then the timestamp diagnosis."""
    vocab = params.config.vocab_size
    prompts = shared_prefix_prompts(args.questions, args.system_len, vocab)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    points = []
    for caching in (False, True):
        cfg = config_for(params, args, caching)
        # Compile outside the timings: every token bucket (Pallas: the only varying shape), or a
        # reduced rehearsal of the sweep (reference backend: block-table widths vary too).
        warm(params, cfg, lambda engine: [closed_loop(engine, prompts[:2 * c + 1], sp, c) for c in args.concurrency],
             rehearse_on_pallas=False)
        for c in args.concurrency:
            n = args.c1_requests if c == 1 else args.questions
            points.append(sweep_point(params, cfg, prompts[:n], sp, c))
    by = {(p["caching"], p["concurrency"]): p for p in points}
    for c in args.concurrency:
        off, on = by[(False, c)], by[(True, c)]
        on["differ_from_caching_off"] = div = output_divergence(off["output_token_ids"], on["output_token_ids"])
        if outputs_guaranteed_identical(params.dtype, args.batch_invariant):
            assert div["num_differ"] == 0, f"concurrency {c}: caching changed outputs: {div}"
    diagnosis = timestamp_diagnosis(params, args)
    capacity = prefix_capacity(params, args)
    off1, on1 = by[(False, 1)], by[(True, 1)]
    speedup = off1["ttft_rest_mean_ms"] / on1["ttft_rest_mean_ms"]
    rows = [
        dict(experiment="prefix_ttft", design_notes=DESIGN_NOTES["prefix_ttft"], model=args.model,
             ours=f"TTFT of requests 1.. at concurrency 1: {off1['ttft_rest_mean_ms']:.1f} ms uncached -> "
                  f"{on1['ttft_rest_mean_ms']:.1f} ms cached ({speedup:.1f}x); ITL {off1['itl_mean_ms']:.2f} vs "
                  f"{on1['itl_mean_ms']:.2f} ms"),
        dict(experiment="prefix_concurrency", design_notes=DESIGN_NOTES["prefix_concurrency"], model=args.model,
             ours="output tok/s off/on: " + ", ".join(
                 f"c={c} {by[(False, c)]['output_tokens_per_second']:.0f}/{by[(True, c)]['output_tokens_per_second']:.0f}"
                 for c in args.concurrency)),
        dict(experiment="timestamp_miss", design_notes=DESIGN_NOTES["timestamp_miss"], model=args.model,
             ours=f"{diagnosis['shared_full_blocks']} blocks shared, first difference in block "
                  f"{diagnosis['first_diff_block']}; hit rate {diagnosis['hit_rate_inside']:.1%} -> "
                  f"{diagnosis['hit_rate_moved']:.1%} with the timestamp moved after the system prompt"),
    ]
    return dict(sweep=points, timestamp=diagnosis, capacity=capacity, design_notes_rows=rows)


def prefix_capacity(params, args) -> dict:
    """Cached prefixes at the same memory. ``capacity_prefixes`` distinct system prompts of ``system_len``
    tokens are asked in turn (round robin, one request at a time, ``capacity_rounds`` rounds) through
    a pool of one running request plus 60% of the prefixes' blocks in the model's dtype: the cache
    evicts the least recently used blocks, so each prefix is gone before its next turn and hits
    nothing. An fp8 pool of the same bytes has about twice the blocks (four times against float32)
    and keeps every prefix: every turn after the first round hits."""
    vocab, bs, count = params.config.vocab_size, args.block_size, args.capacity_prefixes
    rng = random.Random(1)
    systems = [[rng.randrange(vocab) for _ in range(args.system_len)] for _ in range(count)]
    prompts = [systems[i % count] + [rng.randrange(vocab) for _ in range(16)]
               for i in range(count * args.capacity_rounds)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    prefix_blocks = args.system_len // bs
    rows = []
    for kv_cache_dtype in ("auto", "fp8"):
        if kv_cache_dtype == "auto":
            num_blocks = int(0.6 * count * prefix_blocks) + args.max_model_len // bs
        else:  # the same bytes: one byte an element plus a scale row a block (jaxpaged/kernels/fp8.py)
            block_bytes = params.config.kv_bytes_per_token(1) * (bs + 1)
            num_blocks = rows[0]["kv_pool_bytes"] // block_bytes
        cfg = dataclasses.replace(config_for(params, args, True), num_blocks=num_blocks,
                                  kv_cache_dtype=kv_cache_dtype)
        engine = LLMEngine(params, cfg)
        closed_loop(engine, prompts, sp, 1)
        s = engine.stats()
        rows.append(dict(kv_dtype=s["kv_dtype"], num_blocks=s["num_blocks"], kv_pool_bytes=s["kv_pool_bytes"],
                         prefix_hit_rate=s["prefix_hit_rate"], prefill_tokens=s["prefill_tokens"],
                         prompt_tokens=sum(len(p) for p in prompts), blocks_cached=s["blocks_cached"],
                         prefixes_cached=s["blocks_cached"] // prefix_blocks))
    return dict(prefixes=count, rounds=args.capacity_rounds, prefix_len=args.system_len, block_size=bs, runs=rows)


def print_full(report: dict) -> None:
    a = report["args"]
    print(f"{a['system_len']}-token system prompt + {a['questions']} questions, {a['max_tokens']} tokens each; "
          f"closed-loop clients; model {report['model']}")
    print(f"{'cache':5s} {'conc':>4s} {'reqs':>4s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
          f"{'TTFT 1.. mean':>13s} {'ITL ms':>7s} {'prefilled':>9s} {'hit rate':>8s} {'differ':>6s} {'compiles':>8s}")
    for p in report["sweep"]:
        rest = "-" if p["ttft_rest_mean_ms"] is None else f"{p['ttft_rest_mean_ms']:.1f}"
        itl = "-" if p["itl_mean_ms"] is None else f"{p['itl_mean_ms']:.2f}"
        differ = p.get("differ_from_caching_off", {}).get("num_differ", "-")
        print(f"{'on' if p['caching'] else 'off':5s} {p['concurrency']:4d} {p['requests']:4d} "
              f"{p['output_tokens_per_second']:8.0f} {p['ttft_p50_ms']:9.1f} {p['ttft_p99_ms']:9.1f} {rest:>13s} "
              f"{itl:>7s} {p['prefill_tokens']:9d} {p['prefix_hit_rate']:8.1%} {differ!s:>6s} "
              f"{p['compiled_shapes_during_run']:8d}")
    print("(differ: requests whose greedy tokens differ from caching off; expected 0 in float32 or with "
          "--batch-invariant, possible in bf16: docs/NUMERICS.md)")
    c = report["capacity"]
    print(f"cached prefixes at the same memory: {c['prefixes']} system prompts of {c['prefix_len']} tokens asked in "
          f"turn, {c['rounds']} rounds, one request at a time")
    print(f"{'KV dtype':14s} {'blocks':>7s} {'pool MiB':>9s} {'hit rate':>8s} {'prefilled':>9s} {'prefixes cached':>15s}")
    for r in c["runs"]:
        print(f"{r['kv_dtype']:14s} {r['num_blocks']:7d} {r['kv_pool_bytes'] / 2**20:9.1f} {r['prefix_hit_rate']:8.1%} "
              f"{r['prefill_tokens']:9d} {r['prefixes_cached']:15d}")
    for row in report["design_notes_rows"]:
        print(f"[{row['experiment']}] design notes: {row['design_notes']}\n    ours ({row['model']}): {row['ours']}")


def plot_full(report: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for caching, style in ((False, "o--"), (True, "o-")):
        ps = [p for p in report["sweep"] if p["caching"] == caching]
        label = f"prefix caching {'on' if caching else 'off'}"
        axes[0].plot([p["concurrency"] for p in ps], [p["output_tokens_per_second"] for p in ps], style, label=label)
        axes[1].plot([p["concurrency"] for p in ps], [p["ttft_p50_ms"] for p in ps], style, label=label)
    axes[0].set(xscale="log", xlabel="concurrent clients", ylabel="output tokens / s", title=report["model"])
    axes[1].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="TTFT p50 (ms)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"prefix_cache_{report['model']}.png"), dpi=120)
    plt.close(fig)


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
