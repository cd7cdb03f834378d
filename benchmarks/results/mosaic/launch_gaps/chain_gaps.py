"""Where a chained decode launch's wall time goes beyond its kernel, Mosaic vs Triton.

Decode batch x context (block 16, Hq 16 / Hkv 8 / D 128), 8 launches a jit, each launch's output the
next one's queries (as ``bench_attention.chain_time`` times them). For each: the chained wall time per
launch (``timed``: groups of 4 jits, one sync a group), then 10 jits traced. From the trace's GPU
streams: the kernels a launch runs (count and GPU time), the attention kernel's own time, the GPU span
of a jit (first kernel start to last kernel end) over its 8 launches, and the idle gaps inside that
span; from the host: the events of a jit by name (all of them: thunks, CUDA API calls), per launch.
What the wall adds to the span is the jit's dispatch and the sync. Run from the repository root:

    python3 benchmarks/results/mosaic/launch_gaps/chain_gaps.py [--shapes 1x256,8x1024,64x1024]
"""
import argparse
import collections
import statistics
import sys
import tempfile
import time
import warnings

sys.path[:0] = ["benchmarks", "tools", "benchmarks/results/mosaic"]
warnings.filterwarnings("ignore")

import jax  # noqa: E402
from bench_attention import hbm_read_ceiling, timed  # noqa: E402
from decode_profile import decode_batch  # noqa: E402
from profile_step import copy_kind, find_trace_file, load_trace, normalise_kernel_name  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

HQ, HKV, D, BS = 16, 8, 128, 16
CHAIN, JITS = 8, 10


def trace_jits(fn, args, n):
    """Runs ``fn(*args)`` n times under the profiler, synchronised each time; returns the trace's GPU
    stream events and host events (lists of dicts)."""
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(n):
        jax.block_until_ready(fn(*args))
        time.sleep(0.002)  # (an idle gap on the GPU between jits: jit_spans splits there)
    jax.profiler.stop_trace()
    ev = load_trace(find_trace_file(d))
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in ev
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    x = [e for e in ev if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in x if "/device:GPU:0" in procs.get(e["pid"], "")
           and "stream" in threads.get((e["pid"], e.get("tid")), "").lower()]
    host = [e for e in x if procs.get(e["pid"], "").startswith("/host")]
    return sorted(gpu, key=lambda e: e["ts"]), host


def jit_spans(gpu, gap_us=1000.0):
    """Splits the time-sorted GPU events into jits (a jit's events are separated from the next jit's by
    the sync: more than ``gap_us`` idle); returns a list of event lists."""
    spans, cur, end = [], [], 0.0
    for e in gpu:
        if cur and e["ts"] - end > gap_us:
            spans.append(cur)
            cur = []
        end = max(end, e["ts"] + e["dur"]) if cur else e["ts"] + e["dur"]
        cur.append(e)
    if cur:
        spans.append(cur)
    return spans


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x256,1x1024,8x1024,64x256,64x1024,64x4096")
    args = ap.parse_args(argv)
    ceiling = hbm_read_ceiling(False)
    print(f"read ceiling (XLA sum over 4 GiB) {ceiling / 1e12:.2f} TB/s", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        b, ctx = (int(v) for v in shape.split("x"))
        kv_bytes = b * ctx * HKV * D * 2 * 2
        q, pool, cu, kl, table = decode_batch(b, ctx)  # (decode_profile.py's batch)
        for name, fn in (("mosaic", paged_attention_mgpu), ("triton", paged_attention)):
            def chain(q, pool, cu, kl, tb, fn=fn):
                for _ in range(CHAIN):
                    q = fn(q, pool, 0, cu, kl, tb)
                return q
            _, t = timed(chain, (q, pool, cu, kl, table), 20)
            wall = t * 1e6 / CHAIN
            f = jax.jit(chain)
            gpu, host = trace_jits(f, (q, pool, cu, kl, table), JITS)
            spans = jit_spans(gpu)
            per = CHAIN * len(spans)
            kernels = [e for e in gpu if copy_kind(e["name"]) is None]
            copies = collections.Counter(copy_kind(e["name"]) for e in gpu if copy_kind(e["name"]) is not None)
            by_name = collections.Counter()
            count = collections.Counter()
            for e in kernels:
                by_name[normalise_kernel_name(e["name"])] += e["dur"] / per
                count[normalise_kernel_name(e["name"])] += 1 / per
            attn_name = max(by_name, key=by_name.get)
            attn = [e["dur"] for e in kernels if normalise_kernel_name(e["name"]) == attn_name]
            span = statistics.median((max(e["ts"] + e["dur"] for e in s) - s[0]["ts"]) / CHAIN for s in spans)
            gaps = []  # idle time before each attention kernel inside a jit (not the first)
            for s in spans:
                end = None
                for e in s:
                    if end is not None and normalise_kernel_name(e["name"]) == attn_name:
                        gaps.append(max(0.0, e["ts"] - end))
                    end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
            host_us = collections.Counter()
            host_n = collections.Counter()
            for e in host:
                host_us[e["name"]] += e["dur"] / per
                host_n[e["name"]] += 1 / per
            k = statistics.median(attn)
            print(f"\n== {name} {b} x {ctx} ({kv_bytes / 1e6:.1f} MB): wall {wall:.1f} us/launch, GPU span "
                  f"{span:.1f}, attention kernel {k:.2f} ({100 * kv_bytes / k * 1e6 / ceiling:.0f}% of the ceiling), "
                  f"gap before it {statistics.median(gaps) if gaps else float('nan'):.2f}, {len(spans)} jits traced, "
                  f"copies per launch {dict((c, n / per) for c, n in copies.items())}", flush=True)
            for kname, us in by_name.most_common(6):
                print(f"   gpu {us:8.2f} us  x{count[kname]:.2f}  {kname[:100]}")
            for hname, us in host_us.most_common(12):
                print(f"   host {us:8.2f} us  x{host_n[hname]:.2f}  {hname[:100]}")
            rows.append((b, ctx, name, wall, span, k, statistics.median(gaps) if gaps else float("nan"),
                         sum(count.values()), kv_bytes / span * 1e6 / ceiling))
        del pool
    print(f"\nread ceiling {ceiling / 1e12:.2f} TB/s; us per launch, {CHAIN} launches a jit")
    print("| B x ctx | backend | chained wall | GPU span | attention kernel | gap before it | kernels | span % ceiling |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for b, ctx, name, wall, span, k, gap, nk, frac in rows:
        print(f"| {b} x {ctx} | {name} | {wall:.1f} | {span:.1f} | {k:.2f} | {gap:.2f} | {nk:.2f} | {100 * frac:.0f}% |")


if __name__ == "__main__":
    main()
