"""Offline throughput on nano-vllm's workload (random weights at a model's shapes, or the tiny checkpoint).

Workload (nano-vllm's bench.py): ``random.seed(0)``; ``--num-seqs`` requests (256); each prompt is
``randint(100, --max-input-len)`` token ids drawn from ``randint(0, 10000)`` (modulo the vocabulary);
then per request ``max_tokens = randint(100, --max-output-len)``, ``temperature=0.6``,
``ignore_eos=True``. Throughput = output tokens / wall seconds of the whole run, after every step
bucket is compiled ahead of time (``LLMEngine.warmup``; compile time reported separately).

``--model``: ``qwen3-0.6b`` (default), ``qwen2.5-0.5b``, ``qwen2.5-7b``, ``qwen3-30b-a3b`` (Qwen3-MoE: 128
experts, 8 a token, ~61 GB of bf16 weights) (random weights of those shapes, ``--dtype``, bfloat16 by
default; a GPU) or ``tiny`` (the packaged tiny Qwen3 checkpoint, float32: 16
requests of at most 128 + 128 tokens by default, which runs in seconds on a CPU).

Baseline, back to back in the same process (on a GPU, not for ``tiny``): Hugging Face ``generate`` (static batch, left
padding, same sampling) on the first ``--hf-requests`` requests, and jaxpaged on the same subset.

    python benchmarks/bench_throughput.py --out $OUT [--model qwen2.5-7b] [--hf-requests 32]
    python benchmarks/bench_throughput.py --model tiny --out /tmp/t        # CPU
    python benchmarks/bench_throughput.py --model qwen2.5-7b --quantization fp8 --hf-requests 0 --out $OUT

``--quantization fp8``: the random weights' linear layers quantized at load (per output channel), as
``LLM(path, quantization="fp8")`` does with a bf16 checkpoint. ``--compare-fp8``: after the run (bf16
weights), the same workload again in this process on the weights quantized at load, against the bf16 run
and its own floor (the bf16 weights are freed first).

``--trace``: the full workload runs under ``jax.profiler`` and the script adds where the run's GPU time
went (busy seconds against the wall, kernels grouped by name with their total seconds); its tok/s then
include the profiler's overhead, so measure throughput in a separate, untraced run. ``--trace-steps
a:b``: a second run traces only engine steps ``[a, b)``, against the untraced run's wall per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import jax

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
import floor
from jaxpaged.workloads import (QWEN2_5_0_5B, QWEN2_5_7B, QWEN3_0_6B, QWEN3_30B_A3B, nano_vllm_workload, params_bytes,
                                random_model)

TOOLS = Path(__file__).resolve().parent.parent / "tools"

# --model -> Hugging Face config of the shapes (random weights); None: the packaged tiny checkpoint.
MODELS = {"qwen3-0.6b": QWEN3_0_6B, "qwen2.5-0.5b": QWEN2_5_0_5B, "qwen2.5-7b": QWEN2_5_7B,
          "qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": None}
# Defaults per model: requests, prompt / output length bounds, step budget and sequences per step.
FULL_DEFAULTS = dict(num_seqs=256, max_input_len=1024, max_output_len=1024, max_num_seqs=256,
                     max_num_batched_tokens=8192)
TINY_DEFAULTS = dict(num_seqs=16, max_input_len=128, max_output_len=128, max_num_seqs=16,
                     max_num_batched_tokens=512)


def trace_tools():
    """``tools/profile_step.py`` (the profiler-trace parsing), imported from the tools folder."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    import profile_step

    return profile_step


def load_model(model: str, dtype: str | None = None, quantization: str | None = None):
    """``--model``'s weights: random at the model's shapes (``dtype``, bfloat16 by default) or the tiny
    checkpoint (float32 by default); ``quantization="fp8"``: the linear weights quantized at load."""
    if model not in MODELS:
        raise SystemExit(f"--model must be one of {sorted(MODELS)}, got {model!r}")
    if MODELS[model] is None:
        from jaxpaged import load_params
        from jaxpaged.models.tiny import tiny_checkpoint_path

        return load_params(tiny_checkpoint_path("qwen3"), dtype or "float32", use_cache=False,
                           quantization=quantization)
    return random_model(MODELS[model], dtype or "bfloat16", quantization=quantization)


def workload(args, vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's prompts and sampling params at ``args``' sizes; token ids modulo ``vocab_size`` and
    the sampling options (``--temperature``, ``--top-p``, ``--top-k``) applied to every request."""
    prompts, sps = nano_vllm_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    prompts = [[t % vocab_size for t in p] for p in prompts]
    sps = [dataclasses.replace(sp, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k) for sp in sps]
    return prompts, sps


def run_ours(params, prompts, sps, args):
    """One run of the workload on a fresh engine: warm-up (every bucket compiled), one tiny request,
    then the timed run. ``args`` needs the engine's sizes (``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``backend``, ``async_scheduling``; ``max_model_len`` 2048 and
    ``batch_invariant`` off unless given) and may ask for a trace (``trace_dir``) or traced step windows
    (``trace_windows``, ``window_trace_root``)."""
    config = EngineConfig(block_size=args.block_size, max_model_len=getattr(args, "max_model_len", 2048),
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.backend,
                          memory_fraction=0.9, async_scheduling=args.async_scheduling,
                          batch_invariant=getattr(args, "batch_invariant", False),
                          kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                          quantization=getattr(args, "quantization", None))
    engine = LLMEngine(params, config)
    compile_s = engine.warmup(use_tqdm=False)
    run_to_completion(engine, [prompts[0][:16]], SamplingParams(max_tokens=4))  # one tiny real request
    engine.metrics.host_seconds = engine.metrics.device_seconds = 0.0
    trace_dir = getattr(args, "trace_dir", None)
    windows = getattr(args, "trace_windows", None) or []
    step_times, finish_steps = time_steps(engine, windows, getattr(args, "window_trace_root", None))
    if trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    try:
        outs = run_to_completion(engine, prompts, sps)
    finally:
        seconds = time.perf_counter() - t0
        if trace_dir:
            jax.profiler.stop_trace()
        finish_steps()
    out_lens = [len(o.outputs[0].token_ids) for o in outs]
    out_tokens = sum(out_lens)
    st = engine.stats()
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    return dict(seconds=seconds, output_tokens=out_tokens, tok_per_s=out_tokens / seconds, warmup_compile_s=compile_s,
                steps=st["steps"], preemptions=st["preemptions"], num_blocks=st["num_blocks"],
                peak_kv_gib=st["peak_kv_bytes_in_use"] / 2**30, compiled_shapes=st["compiled_shapes"],
                total_compile_s=st["compile_seconds"], ttft_p50=ttft[len(ttft) // 2], ttft_max=ttft[-1],
                backend=st["attention_backend"], host_s=st["host_seconds"], device_wait_s=st["device_wait_seconds"],
                traced=bool(trace_dir or windows), step_end_s=[t - t0 for t in step_times],
                kv_dtype=str(engine.kv_pool.dtype), block_size=engine.config.block_size, output_lens=out_lens,
                weights_gib=params_bytes(params) / 2**30)


def brief(run: dict) -> dict:
    """A run's result without its per-step end times (for the log; the JSON keeps them)."""
    return {k: v for k, v in run.items() if k not in ("step_end_s", "output_lens")}


def parse_windows(text: str | None) -> list[tuple[int, int]]:
    """``"100:130,600:630"`` -> ``[(100, 130), (600, 630)]``: engine steps ``[a, b)`` of the timed run,
    ``1 <= a < b`` (the wall of step ``a`` is measured from the end of step ``a - 1``), not overlapping."""
    out = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        a, sep, b = item.partition(":")
        try:
            a, b = int(a), int(b)
        except ValueError:
            a = b = -1
        if not sep or not 1 <= a < b:
            raise SystemExit(f"--trace-steps: bad window {item!r} (want a:b with 1 <= a < b)")
        out.append((a, b))
    out.sort()
    for (_, b), (c, _) in zip(out, out[1:]):
        if c < b:
            raise SystemExit(f"--trace-steps: windows overlap ({text!r}); one trace at a time")
    return out


def time_steps(engine, windows: list[tuple[int, int]], trace_root: str | None):
    """Wraps ``engine.step`` for one run: records when each step returns (``perf_counter``) and, with
    ``trace_root``, traces engine steps ``[a, b)`` of each window into ``trace_root/w{a}_{b}``.
    Around a window the host waits for the device (the step before it finishes before the trace
    starts, its last step before the trace stops), so the trace holds exactly the window's steps'
    GPU work; the traced run's wall is not the measurement. Returns ``(times, finish)``:
    ``finish()`` stops a window the run did not reach the end of and puts the engine's own ``step``
    back."""
    times: list[float] = []
    step = engine.step
    starts = {a: (a, b) for a, b in windows} if trace_root else {}
    ends = {b for _, b in windows} if trace_root else set()
    tracing = [False]

    def timed_step():
        i = len(times)
        if i in starts:
            a, b = starts[i]
            jax.block_until_ready(engine._prev_tokens)  # the step before the window finishes untraced
            jax.profiler.start_trace(os.path.join(trace_root, f"w{a}_{b}"), create_perfetto_trace=True)
            tracing[0] = True
        out = step()
        times.append(time.perf_counter())
        if i + 1 in ends and tracing[0]:
            jax.block_until_ready(engine._prev_tokens)  # the window's last step finishes in the trace
            jax.profiler.stop_trace()
            tracing[0] = False
        return out

    def finish():
        if tracing[0]:
            jax.profiler.stop_trace()
            tracing[0] = False
        del engine.step  # the class's method again

    engine.step = timed_step
    return times, finish


def window_summaries(untraced: dict, traced: dict, windows: list[tuple[int, int]], trace_root: str) -> list[dict]:
    """Per window: the untraced run's wall per step (from its step end times) against the GPU busy
    time per step of the same steps in the traced run (the schedule is deterministic: same steps,
    checked by their count)."""
    ps = trace_tools()

    if traced["steps"] != untraced["steps"]:
        return [dict(window=[a, b], error=f"the runs took {untraced['steps']} and {traced['steps']} steps: "
                                          "not the same schedule") for a, b in windows]
    out = []
    for a, b in windows:
        ends = untraced["step_end_s"]
        if b > len(ends):
            out.append(dict(window=[a, b], error=f"the run had {len(ends)} steps (need b <= steps)"))
            continue
        wall_ms = (ends[b - 1] - ends[a - 1]) / (b - a) * 1e3
        path = ps.find_trace_file(os.path.join(trace_root, f"w{a}_{b}"))
        if path is None:
            out.append(dict(window=[a, b], untraced_wall_ms=wall_ms, error="no trace file"))
            continue
        t = ps.analyse_trace(ps.load_trace(path), steps=b - a, top=8)
        busy_ms = t["busy_us_per_step"] / 1e3
        out.append(dict(window=[a, b], untraced_wall_ms=wall_ms, gpu_busy_ms=busy_ms,
                        idle_fraction=1 - busy_ms / wall_ms, kernels_per_step=t["kernel_count_per_step"],
                        top=[dict(name=k["name"], us_per_step=k["us_per_step"], calls=k["calls_per_step"])
                             for k in t["top"]]))
    return out


def print_window_summaries(rows: list[dict]) -> None:
    print("\nsteps [a, b) of the workload: untraced wall per step vs GPU busy per step (traced run)")
    print(f"{'steps':>12s} {'wall ms':>8s} {'busy ms':>8s} {'idle':>6s} {'kernels':>8s}  top kernels (us/step)")
    for r in rows:
        if "error" in r:
            print(f"{r['window'][0]:>5d}:{r['window'][1]:<6d} {r['error']}")
            continue
        top = ", ".join(f"{k['name'][:28]} {k['us_per_step']:.0f}" for k in r["top"][:4])
        print(f"{r['window'][0]:>5d}:{r['window'][1]:<6d} {r['untraced_wall_ms']:8.3f} {r['gpu_busy_ms']:8.3f} "
              f"{r['idle_fraction']:6.1%} {r['kernels_per_step']:8.0f}  {top}")


def workload_gpu_summary(events: list[dict], wall_s: float, top: int = 15) -> dict:
    """Where a whole traced run's GPU time went: busy (union of kernels and copies) against the wall,
    and kernels grouped by normalised name with their total seconds (``tools/profile_step.py``'s
    ``analyse_trace`` over the run as one window)."""
    a = trace_tools().analyse_trace(events, steps=1, top=top)
    busy_s = a["busy_us_per_step"] / 1e6
    return dict(wall_s=wall_s, gpu_busy_s=busy_s, busy_fraction=busy_s / wall_s if wall_s else 0.0,
                kernel_s=a["kernel_us_per_step"] / 1e6, kernel_count=a["kernel_count_per_step"],
                kernels=[dict(name=k["name"], calls=k["calls_per_step"], seconds=k["us_per_step"] / 1e6,
                              us_per_call=k["us_per_call"], share=k["share"]) for k in a["top"]],
                copies={k: dict(count=v["count_per_step"], seconds=v["us_per_step"] / 1e6)
                        for k, v in a["copies"].items()})


def print_gpu_summary(g: dict) -> None:
    print(f"\nGPU over the traced run (profiler overhead in the wall): busy {g['gpu_busy_s']:.3f} s of "
          f"{g['wall_s']:.3f} s wall ({g['busy_fraction']:.0%}); {g['kernel_count']:.0f} kernels, "
          f"{g['kernel_s']:.3f} s of kernel time")
    print(f"{'kernel (normalised name)':56s} {'calls':>8s} {'seconds':>8s} {'us/call':>8s} {'share':>6s}")
    for k in g["kernels"]:
        print(f"{k['name'][:56]:56s} {k['calls']:8.0f} {k['seconds']:8.3f} {k['us_per_call']:8.1f} {k['share']:6.1%}")


def run_hf(cfg_raw, prompts, sps):
    """Hugging Face ``generate`` on a GPU: a random model of ``cfg_raw``'s shapes (bf16), one static
    left-padded batch, every request generating the batch's largest ``max_tokens`` (only each
    request's own ``max_tokens`` count as output)."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**cfg_raw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    max_new = max(sp.max_tokens for sp in sps)
    sp = sps[0]
    sampling = dict(do_sample=True, temperature=sp.temperature, top_k=max(sp.top_k, 0), top_p=sp.top_p) \
        if sp.temperature > 0 else dict(do_sample=False)
    kw = dict(attention_mask=mask.cuda(), max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0, **sampling)
    model.generate(ids[:2, -32:].cuda(), attention_mask=mask[:2, -32:].cuda(), max_new_tokens=4, pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids.cuda(), **kw)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    useful = sum(sp.max_tokens for sp in sps)
    del model
    torch.cuda.empty_cache()
    return dict(seconds=seconds, output_tokens=useful, tok_per_s=useful / seconds, max_new_tokens=max_new)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; options left unset take ``--model``'s defaults (``FULL_DEFAULTS`` or, for
    ``tiny``, ``TINY_DEFAULTS``; ``--max-model-len``: prompt + output bounds; ``--hf-requests``: 32 on a
    GPU, 0 for ``tiny`` or without one)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", choices=list(MODELS), default="qwen3-0.6b")
    ap.add_argument("--dtype", default=None, help="weights' dtype (default: bfloat16; float32 for tiny)")
    ap.add_argument("--num-seqs", type=int, default=None, help="requests (default 256; 16 for tiny)")
    ap.add_argument("--max-input-len", type=int, default=None,
                    help="prompts of randint(100, N) tokens (default 1024; 128 for tiny)")
    ap.add_argument("--max-output-len", type=int, default=None,
                    help="max_tokens = randint(100, N) (default 1024; 128 for tiny)")
    ap.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's 0.6; 0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--hf-requests", type=int, default=None,
                    help="requests of the Hugging Face baseline (default: 32 on a GPU, 0 for tiny)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--block-size", type=int, default=None, help="default: the engine's (16; 64 for fp8 KV)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="EngineConfig.max_model_len (default: --max-input-len + --max-output-len)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default 256; 16 for tiny")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192; 512 for tiny")
    ap.add_argument("--sync-scheduling", dest="async_scheduling", action="store_false",
                    help="read each step's tokens back before dispatching the next (default: async)")
    ap.add_argument("--batch-invariant", action="store_true", help="EngineConfig(batch_invariant=True)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig(kv_cache_dtype=...): auto, fp8, ...")
    ap.add_argument("--quantization", default=None, help="fp8: the weights quantized at load (EngineConfig(quantization=...))")
    ap.add_argument("--compare-async", action="store_true", help="also run the full workload the other way")
    ap.add_argument("--compare-fp8", action="store_true",
                    help="then the workload again on the weights quantized to fp8 at load (module docstring)")
    ap.add_argument("--trace-steps", default=None,
                    help="a:b[,c:d...]: after the untraced run, run the workload again tracing engine steps [a, b) "
                         "and print their GPU busy time per step against the untraced run's wall per step")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the workload's floor (benchmarks/floor.py; measures the device's bandwidth and "
                         "matmul rate after the run)")
    ap.add_argument("--trace", action="store_true",
                    help="run the full workload under jax.profiler (its tok/s then include the profiler's "
                         "overhead) and report GPU busy time and kernel totals over the whole run")
    args = ap.parse_args(argv)
    for key, value in (TINY_DEFAULTS if args.model == "tiny" else FULL_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.max_input_len, args.max_output_len) < 100:
        raise SystemExit("--max-input-len and --max-output-len must be >= 100 (nano-vllm's lengths start at 100)")
    if args.max_model_len is None:
        args.max_model_len = args.max_input_len + args.max_output_len
    if args.hf_requests is None:
        args.hf_requests = 32 if args.model != "tiny" and jax.default_backend() == "gpu" else 0
    if args.compare_fp8 and (args.quantization or args.hf_requests):
        raise SystemExit("--compare-fp8 runs bf16 weights first: without --quantization, with --hf-requests 0")
    if args.hf_requests and args.model == "tiny":
        raise SystemExit("--hf-requests: the Hugging Face baseline needs random weights of a model's shapes, not tiny")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.trace_dir = os.path.join(args.out, "trace") if args.trace else None
    windows = parse_windows(args.trace_steps)  # checked before minutes of GPU time
    if windows and args.trace:
        raise SystemExit("--trace-steps compares with an untraced run: do not combine it with --trace")
    params = load_model(args.model, args.dtype, args.quantization)
    if args.max_model_len > params.config.max_position_embeddings:
        raise SystemExit(f"--max-model-len {args.max_model_len} exceeds the model's "
                         f"{params.config.max_position_embeddings} positions")
    prompts, sps = workload(args, params.config.vocab_size)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(sp.max_tokens for sp in sps)} output tokens; model {args.model} ({params.dtype})", flush=True)
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__, "args": dict(vars(args))}
    result["ours_full"] = run_ours(params, prompts, sps, args)
    print("ours full:", json.dumps(brief(result["ours_full"])), flush=True)
    if windows:  # the same workload again, steps of each window traced (compiled steps are reused)
        root = os.path.join(args.out, "window_traces")
        traced_args = argparse.Namespace(**{**vars(args), "trace_dir": None, "trace_windows": windows,
                                            "window_trace_root": root})
        traced = run_ours(params, prompts, sps, traced_args)
        result["windows"] = window_summaries(result["ours_full"], traced, windows, root)
        print_window_summaries(result["windows"])
    if args.trace_dir:
        ps = trace_tools()
        path = ps.find_trace_file(args.trace_dir)
        if path is None:
            print("no trace file found under", args.trace_dir, flush=True)
        else:
            result["ours_full_gpu"] = workload_gpu_summary(ps.load_trace(path), result["ours_full"]["seconds"])
            print_gpu_summary(result["ours_full_gpu"])
        args.trace_dir = None  # the comparison runs below are not traced
    if args.compare_async:
        other = argparse.Namespace(**{**vars(args), "async_scheduling": not args.async_scheduling})
        result["ours_full_other"] = run_ours(params, prompts, sps, other)
        print("ours full (other scheduling):", json.dumps(brief(result["ours_full_other"])), flush=True)
    if not args.no_floor:
        result["floor"] = workload_floor(params, prompts, result["ours_full"])
    if args.compare_fp8:
        del params
        gc.collect()
        params = load_model(args.model, args.dtype, "fp8")
        fp8_args = argparse.Namespace(**{**vars(args), "quantization": "fp8"})
        run = result["ours_fp8"] = run_ours(params, prompts, sps, fp8_args)
        if not args.no_floor:
            run["floor"] = workload_floor(params, prompts, run)
        print("ours full (fp8 weights):", json.dumps(brief(run)), flush=True)
    n = args.hf_requests
    if n:
        result["ours_subset"] = run_ours(params, prompts[:n], sps[:n], args)
        print("ours subset:", json.dumps(brief(result["ours_subset"])), flush=True)
        del params
        save(result, args.out)  # what is measured so far, should the baseline fail
        try:
            result["hf_subset"] = run_hf(MODELS[args.model], prompts[:n], sps[:n])
        except (RuntimeError, MemoryError) as err:  # torch's out of memory: XLA keeps what it grew
            result["hf_subset_error"] = f"{type(err).__name__}: {err}"[:500]
        print("hf subset:", json.dumps(result.get("hf_subset", result.get("hf_subset_error"))), flush=True)
    save(result, args.out)
    print(f"\n{'run':36s} {'requests':>8s} {'out tokens':>10s} {'seconds':>8s} {'tok/s':>9s} {'weights GiB':>11s}")
    for key, label, count in (("ours_full", "jaxpaged", args.num_seqs),
                              ("ours_full_other", "jaxpaged, other scheduling", args.num_seqs),
                              ("ours_fp8", "jaxpaged, fp8 weights", args.num_seqs),
                              ("ours_subset", "jaxpaged (subset)", n),
                              ("hf_subset", "HF generate (subset)", n)):
        if key in result:
            r = result[key]
            vs = f"  {r['tok_per_s'] / result['ours_full']['tok_per_s']:.2f}x" if key.startswith("ours_fp8") else ""
            floor_pct = f", {r['floor']['pct_of_floor']:.0f}% of its floor" if "floor" in r else ""
            gib = f"{r['weights_gib']:11.2f}" if "weights_gib" in r else f"{'':11s}"
            print(f"{label:36s} {count:8d} {r['output_tokens']:10d} {r['seconds']:8.2f} {r['tok_per_s']:9.0f} {gib}"
                  f"{vs}{floor_pct}")
    r = result["ours_full"]
    print(f"compile (warm-up, {r['compiled_shapes']} shapes): {r['warmup_compile_s']:.1f} s; steps {r['steps']}; "
          f"preemptions {r['preemptions']}; peak KV {r['peak_kv_gib']:.2f} GiB; TTFT p50 {r['ttft_p50']:.2f} s; "
          f"pool {r['num_blocks']} blocks; host {r['host_s']:.2f} s")
    if "floor" in result:
        f = result["floor"]
        print(f"floor ({f['device']}: read {f['read_tb_per_s']:.2f} TB/s, bf16 matmul {f['matmul_tflops']:.0f} TFLOP/s, "
              f"measured after the run): {f['seconds']:.2f} s = {f['tok_per_s']:.0f} tok/s (prefill {f['prefill_s']:.2f} s, "
              f"decode {f['decode_s']:.2f} s); the run at {f['pct_of_floor']:.0f}% of its floor")
    return result


def save(result: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "throughput.json"), "w") as f:
        json.dump(result, f, indent=2)


def workload_floor(params, prompts, run: dict) -> dict:
    """The run's floor (``benchmarks/floor.py``: prefill at the matmul rate, every step reading the
    weights, every output token its context) on ceilings measured now; the run's seconds against it."""
    on_gpu = jax.default_backend() == "gpu"
    device = floor.measure_device(*((4 << 30, 8192) if on_gpu else (64 << 20, 512)))
    # fp8 weights: every product read at one byte a weight (the bf16 LM head too: still a lower bound)
    weight_dtype = "float8_e4m3fn" if params.quantization is not None else params.dtype
    f = floor.workload_floor(params.config, device, [len(p) for p in prompts], run["output_lens"], kv_dtype=run["kv_dtype"],
                             block_size=run["block_size"], decode_steps=run["steps"], weight_dtype=weight_dtype)
    return dict(f, device=device.name, read_tb_per_s=device.read_bytes_per_s / 1e12,
                matmul_tflops=device.matmul_flops_per_s / 1e12, tok_per_s=run["output_tokens"] / f["seconds"],
                pct_of_floor=100 * f["seconds"] / run["seconds"])


if __name__ == "__main__":
    main()
