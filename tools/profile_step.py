"""Where a decode step's time goes: wall time, GPU kernel time by kernel, idle gap, host<->device copies.

Builds an engine at Qwen3-0.6B shapes with random bf16 weights (``--model tiny``: the packaged tiny
checkpoint, for a CPU), adds ``--batch`` requests with ``--ctx``-token random prompts (greedy by
default, ``ignore_eos``, enough ``max_tokens`` never to finish), steps until every request decodes,
then:

1. times ``--steps`` engine steps without the profiler (``time.perf_counter`` around ``step()``);
2. traces ``--steps`` more with ``jax.profiler.start_trace(..., create_perfetto_trace=True)``, each
   step wrapped in a ``TraceAnnotation`` so its window is in the trace;
3. parses the ``*.trace.json.gz`` the profiler writes: the device process ("/device:GPU:0"), its
   stream lines, kernels grouped by a normalised name (numeric suffixes stripped), memcpys by kind,
   the busy time (union of intervals) and the idle gap (wall - busy).

Only the shapes the run needs are compiled (one or two prefill buckets and the decode bucket), so a
cold GPU run stays well under two minutes. JSON with everything goes to ``--out``/profile_step.json,
the trace itself stays under ``--out``/trace for Perfetto (ui.perfetto.dev) or TensorBoard.
``--min-token-bucket``, ``--step-executables``, ``--cublas-max-tokens`` and ``--copies-max-tokens`` set
the step's ``StepTuning`` (``jaxpaged/engine/tuning.py``; unset: the device's defaults).

The trace parsing (:func:`find_trace_file`, :func:`load_trace`, :func:`analyse_trace`) is also what
``benchmarks/bench_throughput.py --trace`` / ``--trace-steps`` use.

    python tools/profile_step.py --out $OUT [--batch 256] [--ctx 350] [--steps 20]
    python tools/profile_step.py --model tiny --batch 4 --ctx 32 --steps 4 --out /tmp/p   # CPU
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import dataclasses
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jaxpaged.engine.heap import freeze_long_lived_heap  # noqa: E402
from jaxpaged.engine.tuning import StepTuning  # noqa: E402
from jaxpaged.config import FP8_DTYPES  # noqa: E402
from jaxpaged.workloads import BENCHMARK_MODELS, benchmark_params  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import floor  # noqa: E402  (benchmarks/floor.py: the step's floor)

MODELS = BENCHMARK_MODELS
# Lines the profiler derives from the streams (or from the host): never counted as device work.
DERIVED_LINES = ("xla ops", "xla modules", "steps", "framework", "tensorflow", "source", "name scope",
                 "launch", "xla traceme", "host threads")


# ---- the engine in steady decode ---------------------------------------------------------------
load_params = benchmark_params


def build_engine(params, *, batch: int, max_model_len: int, block_size: int | None = None,
                 max_num_batched_tokens: int = 8192, backend: str = "auto", kv_cache_dtype: str = "auto",
                 async_scheduling: bool = True, prefix_caching: bool = True,
                 tuning: StepTuning | None = None) -> LLMEngine:
    """An engine whose pool holds exactly ``batch`` sequences of ``max_model_len`` tokens (+1 block);
    ``block_size`` ``None``: the engine's default for ``kv_cache_dtype``; ``tuning``: the step's
    bucketing and compilation (``None``: the device's defaults)."""
    config = EngineConfig(block_size=block_size, max_num_seqs=batch, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
                          async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    blocks_per_seq = -(-max_model_len // config.resolved_block_size(params.config.head_dim))
    config = dataclasses.replace(config, num_blocks=batch * blocks_per_seq + 1)
    return LLMEngine(params, config, tuning=tuning)


def tuning_from_args(args) -> StepTuning:
    """The device's default ``StepTuning`` with the command line's ``--min-token-bucket``,
    ``--step-executables``, ``--cublas-max-tokens`` and ``--copies-max-tokens`` where given."""
    given = {k: getattr(args, k) for k in ("min_token_bucket", "step_executables", "cublas_max_tokens",
                                           "copies_max_tokens") if getattr(args, k, None) is not None}
    return dataclasses.replace(StepTuning.default(), **given)


def random_prompts(rng: np.random.Generator, vocab: int, num: int, length: int) -> list[list[int]]:
    return rng.integers(0, min(vocab, 10_000), (num, length)).tolist()


def prefill_steps_estimate(batch: int, ctx: int, max_num_batched_tokens: int) -> int:
    return -(-batch * ctx // max_num_batched_tokens) + 2


def all_decoding(engine: LLMEngine, batch: int) -> bool:
    sched = engine.scheduler
    return (not sched.waiting and len(sched.running) == batch
            and all(s.num_output_tokens > 0 and s.num_uncomputed_tokens <= 1 for s in sched.running))


def reach_steady_decode(engine: LLMEngine, *, batch: int, ctx: int, max_tokens: int, temperature: float,
                        warmup_steps: int, seed: int = 0) -> dict:
    """Adds the requests and steps until all decode, then ``warmup_steps`` more (compiles the decode
    shape). Returns the number of steps and seconds it took and the compile seconds in it."""
    rng = np.random.default_rng(seed)
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    for prompt in random_prompts(rng, engine.params.config.vocab_size, batch, ctx):
        engine.add_request(prompt, sp)
    c0, t0, steps = engine.runner.compile_seconds, time.perf_counter(), 0
    while not all_decoding(engine, batch):
        if engine.step():
            raise RuntimeError("a request finished before steady decode: raise max_tokens")
        steps += 1
        if steps > 10 * prefill_steps_estimate(batch, ctx, engine.config.max_num_batched_tokens) + 50:
            raise RuntimeError("the batch never reached steady decode (pool too small?)")
    for _ in range(warmup_steps):
        engine.step()
    return dict(prefill_steps=steps, warmup_steps=warmup_steps, seconds=time.perf_counter() - t0,
                compile_seconds=engine.runner.compile_seconds - c0)


def timed_steps(engine: LLMEngine, n: int, annotate: bool = False) -> dict:
    """Runs ``n`` engine steps; per-step wall (perf_counter) and the engine's host/device split."""
    walls, launches = [], []
    m = engine.metrics
    h0, d0, c0 = m.host_seconds, m.device_seconds, engine.runner.compile_seconds
    shapes0 = engine.runner.num_compiled_executables
    runner_step = engine.runner.step

    def timed_launch(*args, **kwargs):  # the jitted call alone: argument handling, transfer, launch
        t = time.perf_counter()
        out = runner_step(*args, **kwargs)
        launches.append(time.perf_counter() - t)
        return out

    engine.runner.step = timed_launch
    try:
        for i in range(n):
            t0 = time.perf_counter()
            if annotate:
                with jax.profiler.TraceAnnotation(f"profile_step:engine.step #{i}"):
                    finished = engine.step()
            else:
                finished = engine.step()
            walls.append(time.perf_counter() - t0)
            if finished:
                raise RuntimeError("a request finished while timing: raise max_tokens")
    finally:
        del engine.runner.step  # back to the class's method
    return dict(wall_s=walls, wall_median_s=statistics.median(walls), wall_min_s=min(walls),
                launch_median_s=statistics.median(launches) if launches else float("nan"),
                host_s_per_step=(m.host_seconds - h0) / n, device_wait_s_per_step=(m.device_seconds - d0) / n,
                recompiles=engine.runner.num_compiled_executables - shapes0,
                compile_s=engine.runner.compile_seconds - c0)


def first_token_requests(engine: LLMEngine, n: int, ctx: int, rng: np.random.Generator,
                         annotate: bool = False) -> dict:
    """``--ttft``: ``n`` requests one after the other, each a fresh random ``ctx``-token prompt (no
    prefix-cache hit) with ``max_tokens=1``: the window from ``add_request`` to its finished output
    is the prefill step plus everything around it (scheduling, input build, launch, read-back)."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    walls, parts, steps = [], [], 0
    c0, shapes0 = engine.runner.compile_seconds, engine.runner.num_compiled_executables
    for i, prompt in enumerate(random_prompts(rng, engine.params.config.vocab_size, n, ctx)):
        t0 = time.perf_counter()
        ctx_mgr = jax.profiler.TraceAnnotation(f"profile_step:engine.step #{i}") if annotate else None
        if ctx_mgr:
            ctx_mgr.__enter__()
        engine.add_request(prompt, sp)
        t1 = time.perf_counter()
        h0 = engine.metrics.host_seconds
        done = engine.step()  # schedules, builds and dispatches the prefill
        t2 = time.perf_counter()
        first_host = engine.metrics.host_seconds - h0
        steps += 1
        while not done:
            done = engine.step()
            steps += 1
        if ctx_mgr:
            ctx_mgr.__exit__(None, None, None)
        t3 = time.perf_counter()
        walls.append(t3 - t0)
        parts.append((t1 - t0, first_host, t2 - t1 - first_host, t3 - t2))
    med = [statistics.median(p[j] for p in parts) for j in range(4)]
    return dict(wall_s=walls, wall_median_s=statistics.median(walls), wall_min_s=min(walls),
                add_request_median_s=med[0], first_step_host_median_s=med[1], first_step_launch_median_s=med[2],
                until_output_median_s=med[3], steps_per_request=steps / n, host_s_per_step=float("nan"), device_wait_s_per_step=float("nan"),
                recompiles=engine.runner.num_compiled_executables - shapes0, compile_s=engine.runner.compile_seconds - c0)


# ---- trace parsing ----------------------------------------------------------------------------
def find_trace_file(trace_dir: str) -> str | None:
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def load_trace(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def normalise_kernel_name(name: str) -> str:
    """``loop_add_fusion_12`` -> ``loop_add_fusion``; ``fusion.3`` -> ``fusion``; ``gemm_fusion_dot.27.0``
    -> ``gemm_fusion_dot``. Only trailing numeric parts go; template arguments etc. stay."""
    prev = None
    name = name.strip()
    while prev != name:
        prev = name
        name = re.sub(r"[._]\d+$", "", name)
    return name


def copy_kind(name: str) -> str | None:
    """``h2d`` / ``d2h`` / ``d2d`` / ``memset`` for memory operations, None for kernels."""
    n = name.lower()
    if "memcpyh2d" in n or "htod" in n or "memcpy h2d" in n:
        return "h2d"
    if "memcpyd2h" in n or "dtoh" in n or "memcpy d2h" in n:
        return "d2h"
    if "memcpyd2d" in n or "dtod" in n or "memcpy d2d" in n or "memcpyp2p" in n:
        return "d2d"
    if "memset" in n:
        return "memset"
    if "memcpy" in n:
        return "other_copy"
    return None


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def analyse_trace(events: list[dict], steps: int, step_marker: str = "profile_step:engine.step",
                  top: int = 25, all_host: bool = False) -> dict:
    """Device-side numbers per step from a profiler trace (times in microseconds, as in the trace).
    ``all_host``: the host table lists every host event (CUDA API calls included), not only launch-related ones."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu_pids = [p for p, n in procs.items() if "/device:GPU:0" in n]
    dev_pids = gpu_pids or [p for p, n in procs.items() if "/device:" in n and "/device:CPU" not in n]
    device_name = procs[dev_pids[0]] if dev_pids else None
    host_pids = [p for p, n in procs.items() if n.startswith("/host")]

    # Step windows from the host annotations.
    markers = sorted((e for e in complete if e.get("name", "").startswith(step_marker)), key=lambda e: e["ts"])
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in markers]

    lines_seen: dict[str, int] = collections.Counter()
    dev_events = []
    for e in complete:
        if e["pid"] not in dev_pids:
            continue
        tname = threads.get((e["pid"], e.get("tid")), "")
        lines_seen[tname] += 1
        dev_events.append((tname, e))
    stream_lines = {t for t in lines_seen if "stream" in t.lower()}
    if not stream_lines:  # unknown naming: every line that is not a derived one
        stream_lines = {t for t in lines_seen if not any(d in t.lower() for d in DERIVED_LINES)}
    work = [e for t, e in dev_events if t in stream_lines]

    kernels = [e for e in work if copy_kind(e["name"]) is None]
    copies = collections.defaultdict(list)
    for e in work:
        kind = copy_kind(e["name"])
        if kind is not None:
            copies[kind].append(e)

    per_step = max(steps, 1)
    groups: dict[str, dict] = {}
    for e in kernels:
        key = normalise_kernel_name(e["name"])
        g = groups.setdefault(key, dict(name=key, calls=0, total_us=0.0, example=e["name"], hlo_ops=collections.Counter()))
        g["calls"] += 1
        g["total_us"] += e["dur"]
        args = e.get("args") or {}
        hlo = args.get("hlo_op") or args.get("long_name") or ""
        if hlo:
            g["hlo_ops"][normalise_kernel_name(str(hlo).split(" ")[0])] += 1
    kernel_us = sum(e["dur"] for e in kernels)
    table = []
    for g in sorted(groups.values(), key=lambda g: -g["total_us"]):
        table.append(dict(name=g["name"], calls_per_step=g["calls"] / per_step, us_per_step=g["total_us"] / per_step,
                          us_per_call=g["total_us"] / g["calls"], share=g["total_us"] / kernel_us if kernel_us else 0.0,
                          example=g["example"], hlo_ops=[h for h, _ in g["hlo_ops"].most_common(3)]))

    busy_us = union_length([(e["ts"], e["ts"] + e["dur"]) for e in work])
    kernel_busy_us = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])

    # Per step window: device busy inside it, and when its first device work started.
    step_rows = []
    for s, t in windows:
        inside = [(max(e["ts"], s), min(e["ts"] + e["dur"], t)) for e in work if e["ts"] < t and e["ts"] + e["dur"] > s]
        first = min((e["ts"] for e in work if s <= e["ts"] < t), default=None)
        step_rows.append(dict(wall_us=t - s, busy_us=union_length(inside),
                              first_device_work_after_us=None if first is None else first - s,
                              h2d=sum(1 for e in copies.get("h2d", []) if s <= e["ts"] < t),
                              d2h=sum(1 for e in copies.get("d2h", []) if s <= e["ts"] < t)))

    host_calls = collections.Counter()
    host_us = collections.Counter()
    for e in complete:
        if e["pid"] in host_pids:
            n = e.get("name", "")
            if all_host or n.startswith(("PjitFunction", "PjRtStreamExecutorLoadedExecutable", "ExecuteHelper",
                             "CommonPjRtLoadedExecutable::Execute", "TfrtGpuExecutable", "Thunk", "BlockHostUntilDone")) \
                    or "Execute" in n or "Memcpy" in n or "TransferToDevice" in n or "BufferFromPyval" in n:
                host_calls[n] += 1
                host_us[n] += e["dur"]
    host_table = [dict(name=n, calls_per_step=c / per_step, us_per_step=host_us[n] / per_step)
                  for n, c in host_calls.most_common()]
    host_table.sort(key=lambda r: -r["us_per_step"])

    copy_summary = {k: dict(count_per_step=len(v) / per_step, us_per_step=sum(e["dur"] for e in v) / per_step,
                            bytes_per_step=sum(_bytes(e) for e in v) / per_step)
                    for k, v in sorted(copies.items())}
    return dict(device=device_name, processes=sorted(set(procs.values())),
                device_lines={t: n for t, n in lines_seen.items()}, stream_lines=sorted(stream_lines),
                steps=steps, marked_steps=len(windows), kernel_count_per_step=len(kernels) / per_step,
                kernel_us_per_step=kernel_us / per_step, kernel_busy_us_per_step=kernel_busy_us / per_step,
                busy_us_per_step=busy_us / per_step, copies=copy_summary, kernels=table, top=table[:top],
                step_windows=step_rows, host_ops=host_table[:40])


def _bytes(e: dict) -> int:
    args = e.get("args") or {}
    for key in ("num_bytes", "bytes", "size"):
        if key in args:
            try:
                return int(args[key])
            except (TypeError, ValueError):
                pass
    details = str(args.get("memcpy_details", ""))
    m = re.search(r"(?:size|bytes)[:=]\s*(\d+)", details)
    return int(m.group(1)) if m else 0


# ---- report -----------------------------------------------------------------------------------
def print_report(r: dict, top: int) -> None:
    a, u, t = r["trace"], r["untraced"], r["traced"]
    ms = 1e3
    print(f"\n== {r.get('mode', 'decode')} step: model {r['model']}, batch {r['batch']}, ctx ~{r['ctx']}, {r['steps']} steps, "
          f"backend {r['backend']}, device {r['device']} ==")
    print(f"steady state after {r['steady']['prefill_steps']} prefill/mixed steps "
          f"({r['steady']['seconds']:.1f} s, compile {r['steady']['compile_seconds']:.1f} s)")
    print(f"wall per step, untraced: median {u['wall_median_s'] * ms:.3f} ms (min {u['wall_min_s'] * ms:.3f}); "
          f"host (schedule/build/book) {u['host_s_per_step'] * ms:.3f} ms, "
          f"launch+wait for tokens {u['device_wait_s_per_step'] * ms:.3f} ms (the launch alone: median "
          f"{u.get('launch_median_s', float('nan')) * ms:.3f} ms)")
    print(f"wall per step, traced:   median {t['wall_median_s'] * ms:.3f} ms (profiler overhead included)")
    if u["recompiles"] or t["recompiles"]:
        print(f"WARNING: {u['recompiles'] + t['recompiles']} new shapes compiled while timing: numbers include compiles")
    if a is None:
        print("no trace file found")
        return
    if not a["device"]:
        print(f"no device process in the trace (processes: {a['processes']}): host-side numbers only")
    else:
        busy = a["busy_us_per_step"] / 1e3
        wall = u["wall_median_s"] * ms
        print(f"device {a['device']}; stream lines: {', '.join(a['stream_lines']) or '-'}")
        print(f"GPU kernel time per step: {a['kernel_us_per_step'] / 1e3:.3f} ms in {a['kernel_count_per_step']:.0f} kernels "
              f"(union {a['kernel_busy_us_per_step'] / 1e3:.3f} ms); busy incl. copies {busy:.3f} ms")
        print(f"idle gap per step (untraced wall - busy): {wall - busy:.3f} ms = {100 * (wall - busy) / wall:.0f}% of the step")
    for kind, c in a["copies"].items():
        print(f"  {kind:10s} {c['count_per_step']:6.1f} per step, {c['us_per_step']:8.1f} us/step"
              + (f", {c['bytes_per_step']:.0f} B/step" if c["bytes_per_step"] else ""))
    if not a["copies"]:
        print("  no memcpy events in the trace")
    if a["step_windows"] and a["device"]:
        sw = a["step_windows"]
        firsts = [s["first_device_work_after_us"] for s in sw if s["first_device_work_after_us"] is not None]
        print(f"per traced step (median of {len(sw)}): wall {statistics.median(s['wall_us'] for s in sw) / 1e3:.3f} ms, "
              f"device busy {statistics.median(s['busy_us'] for s in sw) / 1e3:.3f} ms"
              + (f", first device work {statistics.median(firsts) / 1e3:.3f} ms after step() began" if firsts else "")
              + f", H2D {statistics.median(s['h2d'] for s in sw):.0f}, D2H {statistics.median(s['d2h'] for s in sw):.0f}")
    if a["host_ops"]:
        n = 30 if r.get("args", {}).get("all_host_events") else 8
        print(f"host ops per step (top {n}):")
        for h in a["host_ops"][:n]:
            print(f"  {h['us_per_step']:9.1f} us  x{h['calls_per_step']:5.1f}  {h['name'][:90]}")
    if a["kernels"]:
        print(f"\n{'kernel (normalised name)':60s} {'calls/step':>10s} {'us/step':>9s} {'us/call':>8s} {'share':>6s}")
        for k in a["top"][:top]:
            print(f"{k['name'][:60]:60s} {k['calls_per_step']:10.1f} {k['us_per_step']:9.1f} "
                  f"{k['us_per_call']:8.1f} {100 * k['share']:5.1f}%")
        rest = a["kernels"][top:]
        if rest:
            print(f"{'(' + str(len(rest)) + ' more groups)':60s} {sum(k['calls_per_step'] for k in rest):10.1f} "
                  f"{sum(k['us_per_step'] for k in rest):9.1f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=350, help="prompt tokens per request (context at the trace)")
    ap.add_argument("--steps", type=int, default=20, help="steps timed untraced, then the same number traced")
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--model", choices=MODELS, default="qwen3-0.6b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--block-size", type=int, default=None, help="default: the engine's for --kv-cache-dtype")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *FP8_DTYPES))
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="prefill budget per step (one or two prefill buckets get compiled)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; >0 samples (the workload uses 0.6)")
    ap.add_argument("--sync-scheduling", dest="async_scheduling", action="store_false",
                    help="read each step's tokens back before dispatching the next (default: async)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--trace-dir", default=None, help="where the profiler writes (default: --out/trace)")
    ap.add_argument("--min-token-bucket", type=int, default=None,
                    help="StepTuning.min_token_bucket: the smallest padded token count of a step")
    ap.add_argument("--step-executables", type=int, default=None,
                    help="StepTuning.step_executables: copies of each small compiled step, used in turn")
    ap.add_argument("--cublas-max-tokens", type=int, default=None,
                    help="StepTuning.cublas_max_tokens: steps of 33..N padded tokens use cuBLAS GEMMs (0: never)")
    ap.add_argument("--copies-max-tokens", type=int, default=None,
                    help="StepTuning.copies_max_tokens: the largest padded step that uses every copy")
    ap.add_argument("--all-host-events", action="store_true",
                    help="list every host event of the trace (CUDA API calls too), top 30")
    ap.add_argument("--ttft", action="store_true",
                    help="profile first tokens instead of decode steps: --steps requests of --ctx tokens, one "
                         "at a time, max_tokens=1; a 'step' is then a request's add_request..finished window")
    ap.add_argument("--max-num-seqs", type=int, default=1,
                    help="--ttft: the engine's sequence slots (bench_latency's engines have 256: a lone prompt "
                         "shorter than that is then padded to as many sequences as tokens, a decode-shaped step)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="--ttft: the engine's max_model_len (default --ctx + 8). The block tables' width follows "
                         "it, and with it the split-K of Mosaic's decode-shaped launches: bench_latency's engine "
                         "fits its longest prompt")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the floor (benchmarks/floor.py: measures the device's bandwidth and matmul rate)")
    args = ap.parse_args(argv)
    if args.ttft:
        return main_ttft(args)

    os.makedirs(args.out, exist_ok=True)
    params = load_params(args.model)
    gen = prefill_steps_estimate(args.batch, args.ctx, args.max_num_batched_tokens) + args.warmup_steps \
        + 2 * args.steps + 16
    max_model_len = args.ctx + gen
    if max_model_len > params.config.max_position_embeddings:
        raise SystemExit(f"ctx + generated tokens ({max_model_len}) exceeds the model's "
                         f"{params.config.max_position_embeddings} positions")
    engine = build_engine(params, batch=args.batch, max_model_len=max_model_len, block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens, backend=args.backend,
                          kv_cache_dtype=args.kv_cache_dtype,
                          async_scheduling=args.async_scheduling, tuning=tuning_from_args(args))
    steady = reach_steady_decode(engine, batch=args.batch, ctx=args.ctx, max_tokens=gen,
                                 temperature=args.temperature,
                                 warmup_steps=max(args.warmup_steps, engine.runner.step_executables))  # every copy
    freeze_long_lived_heap()  # as LLMEngine.warmup does
    context_before = [s.num_tokens for s in engine.scheduler.running]
    untraced = timed_steps(engine, args.steps)

    trace_dir = args.trace_dir or os.path.join(args.out, "trace")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        traced = timed_steps(engine, args.steps, annotate=True)
    finally:
        jax.profiler.stop_trace()
    path = find_trace_file(trace_dir)
    analysis = analyse_trace(load_trace(path), args.steps, top=args.top,
                             all_host=args.all_host_events) if path else None

    result = dict(model=args.model, batch=args.batch, ctx=args.ctx, steps=args.steps, args=vars(args),
                  device=str(jax.devices()[0]), jax=jax.__version__, backend=engine.runner.attention_backend,
                  compiled_shapes=engine.runner.num_compiled_shapes, compile_seconds=engine.runner.compile_seconds,
                  compiled_executables=engine.runner.num_compiled_executables,
                  tuning=dataclasses.asdict(engine.runner.tuning),
                  steady=steady, untraced=untraced, traced=traced, trace_file=path, trace=analysis)
    if analysis and analysis["device"]:
        result["summary"] = dict(
            wall_ms=untraced["wall_median_s"] * 1e3, kernel_ms=analysis["kernel_us_per_step"] / 1e3,
            busy_ms=analysis["busy_us_per_step"] / 1e3,
            idle_ms=untraced["wall_median_s"] * 1e3 - analysis["busy_us_per_step"] / 1e3,
            kernels_per_step=analysis["kernel_count_per_step"],
            h2d_per_step=analysis["copies"].get("h2d", {}).get("count_per_step", 0.0),
            d2h_per_step=analysis["copies"].get("d2h", {}).get("count_per_step", 0.0))
        if not args.no_floor:
            result["floor"] = step_floor_rows(engine, context_before, analysis, untraced["wall_median_s"])
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print_report(result, args.top)
    if result.get("floor"):
        print()
        floor.print_floor_table(result["floor"]["rows"], floor.Device(**result["floor"]["device"]))
    return result


def step_floor_rows(engine: LLMEngine, context_before: list[int], analysis: dict, wall_s: float) -> dict:
    """The decode step's floor (``benchmarks/floor.py``) at the traced steps' mean context, against the
    kernels' time per group and the untraced wall per step; the device's ceilings measured now."""
    mean_ctx = np.asarray(context_before, np.float64) + analysis["steps"]  # the middle of the timed steps
    device = floor.measure_device()
    cfg = engine.params.config
    f = floor.step_floor(cfg, device, num_tokens=len(context_before), context_lens=mean_ctx,
                         kv_dtype=engine.kv_pool.dtype, block_size=engine.config.block_size)
    measured = floor.group_times(analysis["kernels"])
    return dict(device=dataclasses.asdict(device), rows=floor.floor_table(f, measured, wall_s),
                kernel_rows=floor.floor_table(f, measured, analysis["kernel_us_per_step"] / 1e6),
                bytes=dict(kv_read=f.kv_read_bytes, kv_write=f.kv_write_bytes, weights=f.weight_bytes),
                flops=dict(gemm=f.gemm_flops, attention=f.attention_flops))


def main_ttft(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    params = load_params(args.model)
    engine = build_engine(params, batch=args.max_num_seqs, max_model_len=args.max_model_len or args.ctx + 8,
                          block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens, backend=args.backend,
                          kv_cache_dtype=args.kv_cache_dtype,
                          async_scheduling=args.async_scheduling, tuning=tuning_from_args(args))
    rng = np.random.default_rng(0)
    t0, c0 = time.perf_counter(), engine.runner.compile_seconds
    first_token_requests(engine, args.warmup_steps, args.ctx, rng)  # compiles the prefill shape
    freeze_long_lived_heap()  # as LLMEngine.warmup does
    steady = dict(prefill_steps=0, seconds=time.perf_counter() - t0, compile_seconds=engine.runner.compile_seconds - c0)
    untraced = first_token_requests(engine, args.steps, args.ctx, rng)
    trace_dir = args.trace_dir or os.path.join(args.out, "trace")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
        traced = first_token_requests(engine, args.steps, args.ctx, rng, annotate=True)
    finally:
        jax.profiler.stop_trace()
    path = find_trace_file(trace_dir)
    analysis = analyse_trace(load_trace(path), args.steps, top=args.top,
                             all_host=args.all_host_events) if path else None
    result = dict(model=args.model, batch=1, ctx=args.ctx, steps=args.steps, args=vars(args), mode="ttft",
                  device=str(jax.devices()[0]), jax=jax.__version__, backend=engine.runner.attention_backend,
                  compiled_shapes=engine.runner.num_compiled_shapes, compile_seconds=engine.runner.compile_seconds,
                  steady=steady, untraced=untraced, traced=traced, trace_file=path, trace=analysis)
    with open(os.path.join(args.out, "profile_step.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\n== first token: {args.ctx}-token prompt alone, max_tokens=1, {args.steps} requests; "
          f"{untraced['steps_per_request']:.1f} engine steps per request ==")
    print(f"add_request -> finished output, untraced: median {untraced['wall_median_s'] * 1e3:.3f} ms "
          f"(min {untraced['wall_min_s'] * 1e3:.3f}): add_request {untraced['add_request_median_s'] * 1e3:.3f}, "
          f"first step's host work {untraced['first_step_host_median_s'] * 1e3:.3f} + launch "
          f"{untraced['first_step_launch_median_s'] * 1e3:.3f}, then until the output "
          f"{untraced['until_output_median_s'] * 1e3:.3f} ms (medians)")
    print_report(result, args.top)
    return result


if __name__ == "__main__":
    main()
