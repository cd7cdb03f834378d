"""Latency: time to first token (TTFT) and inter-token latency (ITL) at batch 1, 8, 64 and prompts of 32 and
1,536 tokens; Qwen3-0.6B shapes with random bf16 weights (``--model qwen2.5-7b``: Qwen2.5-7B's; ``--model
qwen3-30b-a3b``: Qwen3-30B-A3B's, a mixture of experts; ``--model tiny``: the packaged tiny checkpoint, for a
CPU; ``--quantization fp8``: the linear weights quantized at load), greedy, ``ignore_eos``, 64 output tokens
per request.

For each (batch, prompt length): first one run per copy of the step (``StepTuning.step_executables``:
2 on a GPU) compiles every shape and copy that configuration needs (compile seconds reported
separately; ``first_run_s`` covers those runs together), then ``--repeats`` measured runs (default:
enough for >= 30 first tokens, at least 3), each with fresh random prompts (so the prefix cache never
hits). All requests of a run arrive at once; the engine is stepped here and every
request's output tokens are timestamped after each step.

``--prefix-len P``: each run's prompts start with one fresh shared prefix of ``P`` tokens, which a
one-token request (not timed) puts in the prefix cache first; the prompts' own tokens (``--prompts``)
then follow a cached prefix (the step of a turn in a conversation), and TTFT is that step's.

* TTFT: from ``add_request`` to the first generated token (``RequestOutput.metrics``: ``arrival_time``,
  ``first_token_time``), queueing and chunked prefill included.
* ITL: the gaps between consecutive output tokens of a request (all gaps of all requests), so a decode
  step slowed by other requests' prefill chunks shows in the tail. A request of ``n`` tokens gives
  ``n - 1`` gaps, one per decode step it took part in. TPOT: per request,
  ``(finished_time - first_token_time) / (tokens - 1)``.
* ITL floor: the decode step's floor (``benchmarks/floor.py``: its weights read once, a Qwen3-MoE layer's
  ``k`` experts a token, and the batch's KV at its mean context) on the read bandwidth measured in this
  process after the runs, and the ITL p50 as a percentage of it (``--no-floor`` skips it). fp8 weights
  count one byte a weight, the bf16 LM head too: a lower bound.

Variants compared (``--backend triton,mosaic``, ``--quantization none,fp8``: an engine for each backend and
weights) in this process, compiled first, then measured in turn
run by run on the same prompts, each row with its TTFT and ITL p50 as a ratio to the first variant's, and
the share of requests whose greedy tokens equal the first variant's. Before each
of its runs an engine settles (``LLMEngine.settle``: one throwaway request, its traces undone), so what
the other engine's run left (a CUDA graph to re-record where a buffer moved, cold caches) is not timed.
Process to process, batch-1 ITL of one configuration moves by up to a quarter, more than the differences
measured; runs in turn in one process share whatever causes that.

    python benchmarks/bench_latency.py --out $OUT
    python benchmarks/bench_latency.py --backend triton,mosaic --batches 1 --prompts 32 --out $OUT
    python benchmarks/bench_latency.py --backend mosaic,triton --kv-cache-dtype fp8 --batches 1 --prompts 32,256 \
        --prefix-len 4096 --max-num-seqs 256 --max-tokens 16 --out $OUT
    python benchmarks/bench_latency.py --model tiny --batches 1,2 --prompts 8,24 --max-tokens 4 --out /tmp/l
    python benchmarks/bench_latency.py --model qwen2.5-7b --quantization none,fp8 --batches 1 --prompts 32 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.floor import measure_device, step_floor  # noqa: E402
from jaxpaged.engine.metrics import percentile  # noqa: E402
from jaxpaged.engine.heap import freeze_long_lived_heap  # noqa: E402
from jaxpaged import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jaxpaged.workloads import BENCHMARK_MODELS, benchmark_params  # noqa: E402

MODELS = BENCHMARK_MODELS


load_params = benchmark_params


def run_batch(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> dict:
    """Queues all prompts at once, steps to completion, timestamps every output token. Returns the
    TTFTs, ITL gaps and TPOTs (seconds), the wall, the engine steps, ``decode_steps`` (steps that gave
    some request a token after its first) and each request's ``token_ids`` in prompt order."""
    rids = [engine.add_request(p, sp) for p in prompts]
    ours = set(rids)
    last_n = dict.fromkeys(rids, 0)
    last_t: dict[str, float] = {}
    gaps: list[float] = []
    outs = {}
    steps = decode_steps = 0
    t0 = time.monotonic()

    def see(rid: str, n: int, now: float) -> bool:
        """Records request ``rid``'s tokens up to ``n``; True when one after its first arrived."""
        decoded = False
        if n > last_n[rid]:
            if last_n[rid] >= 1:  # one gap per new token (a step may add at most one per request here)
                gaps.extend([(now - last_t[rid]) / (n - last_n[rid])] * (n - last_n[rid]))
                decoded = True
            last_n[rid], last_t[rid] = n, now
        return decoded

    while engine.has_unfinished_requests():
        finished = engine.step()
        now = time.monotonic()
        steps += 1
        decoded = False
        for seq in engine.scheduler.running:
            if seq.request_id in ours:
                decoded |= see(seq.request_id, seq.num_output_tokens, now)
        for out in finished:
            decoded |= see(out.request_id, len(out.outputs[0].token_ids), now)
            outs[out.request_id] = out
        decode_steps += decoded
    wall = time.monotonic() - t0
    ttft = [outs[r].metrics.time_to_first_token for r in rids]
    tpot = []
    for r in rids:
        m, n = outs[r].metrics, len(outs[r].outputs[0].token_ids)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    out_tokens = sum(len(outs[r].outputs[0].token_ids) for r in rids)
    return dict(ttft=ttft, itl=gaps, tpot=tpot, wall=wall, steps=steps, decode_steps=decode_steps,
                output_tokens=out_tokens, cached_tokens=sum(outs[r].num_cached_tokens for r in rids), token_ids=[list(outs[r].outputs[0].token_ids) for r in rids])


MIN_TTFT_SAMPLES = 30


def repeats_for(batch: int, repeats: int | None) -> int:
    """Measured runs of a configuration: ``repeats`` if given, else enough runs for at least
    ``MIN_TTFT_SAMPLES`` first tokens (one per request), and never fewer than 3 (a batch-1 TTFT p50 of
    only 5 samples varies by 20% between identical runs)."""
    return repeats if repeats is not None else max(3, -(-MIN_TTFT_SAMPLES // batch))


def summarise(runs: list[dict]) -> dict:
    ttft = [x for r in runs for x in r["ttft"]]
    itl = [x for r in runs for x in r["itl"]]
    tpot = [x for r in runs for x in r["tpot"]]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return dict(ttft_p50_ms=ms(percentile(ttft, 50)), ttft_p90_ms=ms(percentile(ttft, 90)),
                itl_p50_ms=ms(percentile(itl, 50)), itl_p90_ms=ms(percentile(itl, 90)),
                tpot_p50_ms=ms(percentile(tpot, 50)),
                out_tok_per_s=sum(r["output_tokens"] for r in runs) / sum(r["wall"] for r in runs),
                steps_per_run=sum(r["steps"] for r in runs) / len(runs), runs=len(runs),
                cached_per_request=sum(r["cached_tokens"] for r in runs) / sum(len(r["ttft"]) for r in runs))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=MODELS, default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompts", default="32,1536", help="prompt lengths in tokens")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measured runs per configuration (default: enough for >= 30 TTFT samples, at least 3)")
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="tokens of a shared prefix cached before each run (0: none; module docstring)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig(kv_cache_dtype=...): auto, fp8, ...")
    ap.add_argument("--quantization", default=None,
                    help="fp8: the weights quantized at load (EngineConfig(quantization=...)); a comma list "
                         "(none,fp8) compares them in turn in this process")
    ap.add_argument("--block-size", type=int, default=None, help="default: the engine's (16; 64 for fp8 KV)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--backend", default="auto",
                    help="attention backend; a comma list (e.g. triton,mosaic) builds an engine each and measures "
                         "them in turn on the same prompts, run by run, with the ratios to the first")
    ap.add_argument("--sync-scheduling", dest="async_scheduling", action="store_false",
                    help="read each step's tokens back before dispatching the next (default: async)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="EngineConfig.max_num_seqs (default: the largest batch). The engine's default is 256: "
                         "a step then pads its rows to min(tokens, 256), and steps of <= 2x that many tokens "
                         "run attention's decode configuration (a 32-token prompt alone: decode tiles at 256, "
                         "prefill tiles at 1)")
    ap.add_argument("--no-floor", action="store_true", help="skip the ITL floor (measures the read bandwidth)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.max_num_seqs is not None and args.max_num_seqs < max(int(x) for x in args.batches.split(",")):
        raise SystemExit(f"--max-num-seqs {args.max_num_seqs} is smaller than the largest batch")
    backends = args.backend.split(",")
    if len(set(backends)) != len(backends):
        raise SystemExit(f"--backend names a backend twice: {args.backend}")
    quantizations = [None if q == "none" else q for q in (args.quantization or "none").split(",")]
    variants = [(b, q) for b in backends for q in quantizations]
    several = len(variants) > 1
    batches = [int(x) for x in args.batches.split(",")]
    prompt_lens = [int(x) for x in args.prompts.split(",")]

    os.makedirs(args.out, exist_ok=True)
    t_load = time.perf_counter()
    weights = {q: load_params(args.model, q) for q in quantizations}
    params = weights[quantizations[0]]
    config = EngineConfig(block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
    bs = config.resolved_block_size(params.config.head_dim)
    longest = args.prefix_len + max(prompt_lens) + args.max_tokens
    max_model_len = -(-longest // bs) * bs
    if max_model_len > params.config.max_position_embeddings:
        raise SystemExit(f"prefix + prompt + max_tokens ({longest}) exceeds the model's "
                         f"{params.config.max_position_embeddings} positions: use shorter --prompts")
    config = dataclasses.replace(config, block_size=bs, num_blocks=max(batches) * (max_model_len // bs) + 1,
                          max_num_seqs=args.max_num_seqs or max(batches),
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=max_model_len, async_scheduling=args.async_scheduling)
    engines, quantization_of = {}, {}
    for b, q in variants:
        engine = LLMEngine(weights[q], dataclasses.replace(config, attention_backend=b, quantization=q))
        label = engine.runner.attention_backend  # as resolved ("auto" -> what it picked)
        if len(quantizations) > 1 or q:
            label += f" {q or jax.numpy.dtype(weights[q].dtype).name}"
        if label in engines:
            raise SystemExit(f"--backend {args.backend} resolves to {label} twice: name each backend once")
        engines[label], quantization_of[label] = engine, q
    names = list(engines)
    first_name = names[0]
    setup_s = time.perf_counter() - t_load
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = min(params.config.vocab_size, 10_000)

    def new_prompts(batch: int, length: int) -> list[list[int]]:
        """Fresh random prompts, each after one fresh shared prefix of ``--prefix-len`` tokens."""
        prefix = rng.integers(0, vocab, args.prefix_len).tolist()
        return [prefix + p for p in rng.integers(0, vocab, (batch, length)).tolist()]

    def cache_prefix(engine: LLMEngine, prompts: list[list[int]]) -> None:
        """Puts the prompts' shared prefix in ``engine``'s prefix cache (a one-token request, untimed)."""
        if args.prefix_len:
            run_batch(engine, [prompts[0][:args.prefix_len]], dataclasses.replace(sp, max_tokens=1))

    rows, agreement = [], {}
    for length in prompt_lens:
        for batch in batches:
            first = {}
            for name, engine in engines.items():
                c0, s0 = engine.runner.compile_seconds, engine.runner.num_compiled_shapes
                t0 = time.perf_counter()
                for _ in range(engine.runner.step_executables):  # compiles its shapes, every copy of them
                    prompts = new_prompts(batch, length)
                    cache_prefix(engine, prompts)
                    run_batch(engine, prompts, sp)
                    if several:  # and the settling request's (a shorter prompt: maybe another bucket)
                        engine.settle(1)
                first[name] = dict(compile_s=engine.runner.compile_seconds - c0,
                                   new_shapes=engine.runner.num_compiled_shapes - s0,
                                   first_run_s=time.perf_counter() - t0,
                                   executables=engine.runner.num_compiled_executables)
            freeze_long_lived_heap()  # as LLMEngine.warmup does: no full GC walking the compiled steps mid-run
            runs = {name: [] for name in engines}
            for _ in range(repeats_for(batch, args.repeats)):  # the backends in turn, on the same prompts
                prompts = new_prompts(batch, length)
                for name, engine in engines.items():
                    cache_prefix(engine, prompts)
                    if several:  # a throwaway request first, its traces undone: LLMEngine.settle
                        engine.settle(1)
                    runs[name].append(run_batch(engine, prompts, sp))
            for name, engine in engines.items():
                f = first[name]
                row = dict(batch=batch, prompt_len=length, variant=name, backend=engine.runner.attention_backend,
                           quantization=quantization_of[name],
                           compile_s=f["compile_s"], new_shapes=f["new_shapes"], first_run_s=f["first_run_s"],
                           recompiles_while_measuring=engine.runner.num_compiled_executables - f["executables"],
                           **summarise(runs[name]), raw=runs[name])
                rows.append(row)
                cached = f", {row['cached_per_request']:.0f} cached tokens a request" if args.prefix_len else ""
                print(f"{name + ': ' if several else ''}batch {batch:3d} prompt {length:5d}: "
                      f"TTFT p50 {row['ttft_p50_ms']:.2f} ms, "
                      f"ITL p50 {row['itl_p50_ms'] if row['itl_p50_ms'] is not None else float('nan'):.2f} ms "
                      f"(compile {row['compile_s']:.1f} s, {row['new_shapes']} shapes{cached})", flush=True)
            ref = runs[first_name]
            for name in names[1:]:  # greedy tokens equal to the first variant's, request by request
                pairs = [(a, b) for ra, rb in zip(ref, runs[name]) for a, b in zip(ra["token_ids"], rb["token_ids"])]
                agreement.setdefault(name, []).extend(a == b for a, b in pairs)

    engine = engines[first_name]
    if not args.no_floor:
        on_gpu = jax.default_backend() == "gpu"
        device = measure_device(*((4 << 30, 8192) if on_gpu else (64 << 20, 512)))
        for r in rows:
            weight_dtype = "float8_e4m3fn" if r["quantization"] else params.dtype
            ctx = args.prefix_len + r["prompt_len"] + args.max_tokens // 2
            f = step_floor(params.config, device, num_tokens=r["batch"], context_lens=[ctx] * r["batch"],
                           kv_dtype=engine.kv_dtype, block_size=bs, weight_dtype=weight_dtype)
            r["itl_floor_ms"] = f.seconds * 1e3
            r["itl_pct_of_floor"] = None if not r["itl_p50_ms"] else 100 * r["itl_floor_ms"] / r["itl_p50_ms"]
        print(f"floor: {device.name}, read {device.read_bytes_per_s / 1e12:.2f} TB/s (measured after the runs)")
    result = dict(model=args.model, device=str(jax.devices()[0]), jax=jax.__version__,
                  backend=engine.runner.attention_backend, args=vars(args), setup_s=setup_s,
                  max_num_seqs=engine.config.max_num_seqs,
                  compile_s_total=sum(e.runner.compile_seconds for e in engines.values()),
                  compiled_shapes=sum(e.runner.num_compiled_shapes for e in engines.values()), rows=rows)
    if several:
        result["variants"] = names
        result["greedy_agreement"] = {n: sum(v) / len(v) for n, v in agreement.items()}
    with open(os.path.join(args.out, "latency.json"), "w") as f:  # (runs without the per-token lists: megabytes)
        saved = [dict(r, raw=[{k: v for k, v in run.items() if k not in ("token_ids", "itl", "tpot")} for run in r["raw"]])
                 for r in rows]
        json.dump(dict(result, rows=saved), f, indent=1)

    f2 = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    in_turn = " (in turn, on the same prompts)" if several else ""
    print(f"\nlatency: model {args.model}, {result['device']}, {' / '.join(names)}{in_turn}, greedy, "
          f"KV {jax.numpy.dtype(engine.kv_dtype).name}, block {bs}, max_num_seqs {engine.config.max_num_seqs}"
          f"{f', prompts after a cached {args.prefix_len}-token prefix' if args.prefix_len else ''}, "
          f"{args.max_tokens} output tokens, runs per row: {[r['runs'] for r in rows]}; "
          f"compile {result['compile_s_total']:.1f} s total ({result['compiled_shapes']} shapes), setup {setup_s:.1f} s")
    width = max(map(len, names)) + 1
    print(f"{'variant'.ljust(width) if several else ''}{'batch':>5s} {'prompt':>6s} {'TTFT p50':>9s} {'TTFT p90':>9s} "
          f"{'ITL p50':>8s} {'ITL p90':>8s} {'TPOT p50':>9s} {'out tok/s':>9s} {'compile s':>9s}"
          f"{'' if args.no_floor else ' ITL floor  % floor'}"
          f"{'  TTFT / ITL p50 vs ' + first_name if several else ''}")
    base = {(r["batch"], r["prompt_len"]): r for r in rows if r["variant"] == first_name}

    def floor_cols(r: dict) -> str:
        if args.no_floor:
            return ""
        pct = "-" if r["itl_pct_of_floor"] is None else f"{r['itl_pct_of_floor']:.0f}"
        return f" {f2(r['itl_floor_ms']):>9s} {pct:>8s}"

    ratio = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}"  # noqa: E731
    for r in rows:
        warn = "  (recompiled while measuring)" if r["recompiles_while_measuring"] else ""
        b = base[(r["batch"], r["prompt_len"])]
        vs = f"  {ratio(r['ttft_p50_ms'], b['ttft_p50_ms'])} / {ratio(r['itl_p50_ms'], b['itl_p50_ms'])}"
        print(f"{r['variant'].ljust(width) if several else ''}{r['batch']:5d} {r['prompt_len']:6d} "
              f"{f2(r['ttft_p50_ms']):>9s} {f2(r['ttft_p90_ms']):>9s} {f2(r['itl_p50_ms']):>8s} "
              f"{f2(r['itl_p90_ms']):>8s} {f2(r['tpot_p50_ms']):>9s} {r['out_tok_per_s']:9.0f} "
              f"{r['compile_s']:9.1f}{floor_cols(r)}{vs if several else ''}{warn}")
    for name, frac in result.get("greedy_agreement", {}).items():
        print(f"greedy tokens equal to {first_name}'s: {name} {frac:.1%} of requests")
    print("(times in ms; TTFT includes queueing behind the other requests of the batch)")
    return result


if __name__ == "__main__":
    main()
