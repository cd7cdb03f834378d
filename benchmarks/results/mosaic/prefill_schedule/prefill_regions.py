"""Where the prefill kernel's time goes inside a program, by phase, from Mosaic GPU's own profiler.

The kernel names its phases with ``jax.named_scope`` (compute warpgroups: ``wait_k``, ``qk``,
``softmax``, ``wait_v``, ``pv``; the memory warpgroup: ``wait_free``); with ``profile_space`` set,
Mosaic GPU records each phase's start and end per warpgroup in a buffer and writes a trace after the
call. One causal sequence of ``TOKENS`` new tokens (block 16, Hq 16 / Hkv 8 / D 128, bf16), the profiled
kernel run once after an unprofiled warm-up; per warpgroup role, each phase's share of the
warpgroup's time from its first event to its last (summed over programs), and the spans. The trace's
times are microseconds (the profiler reads the GPU's global timer); the logs beside this script, run
before that was read right, label them "thousand cycles". Also per step: each phase's mean time, the
step period, and how the two compute warpgroups of a program line up (``TRACE_COPY=path`` keeps the
raw trace).
From the repository root, on a Hopper GPU:

    python3 benchmarks/results/mosaic/prefill_schedule/prefill_regions.py [TOKENS, default 4096]

Run on an H100 (2026-12-05, the kernel before its warpgroups took turns, a program an item): ``prefill_regions_4096.log``,
``prefill_regions_8192.log``. Recording the phases slows the kernel (a program's span in the trace is
~1.4x its share of the unprofiled launch), so the shares, not the times, are the result.
"""
import collections
import glob
import json
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from jaxpaged.kernels import paged_attention_mgpu_prefill as prefill  # noqa: E402

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
HQ, HKV, D, BS, BLOCK_KV = 16, 8, 128, 16, 128
# Ranges a warpgroup records: 5 a KV tile, over the items of a persistent program (at most ceil(items /
# SMs), each of at most TOKENS / BLOCK_KV tiles), and slack.
ITEMS = TOKENS // (2 * 64 // (HQ // HKV)) * HKV
SPACE = 5 * -(-ITEMS // prefill.num_cores()) * (TOKENS // BLOCK_KV) + 64


def run(profile_dir: str | None):
    """The prefill kernel on a fresh paged pool; ``profile_dir``: record a trace there."""
    kernel = plgpu.kernel
    jax.clear_caches()  # paged_prefill_mgpu is a jit of its own: trace it again, with or without the profiler
    if profile_dir:
        def profiled(*a, **k):
            return kernel(*a, compiler_params=plgpu.CompilerParams(profile_space=SPACE, profile_dir=profile_dir), **k)

        prefill.plgpu.kernel = profiled
    try:
        kq, kk = jax.random.split(jax.random.key(TOKENS))
        nb = TOKENS // BS
        q = jax.random.normal(kq, (TOKENS, HQ, D), jnp.bfloat16)
        pool = jax.random.normal(kk, (1, nb, BS, 2, HKV, D), jnp.bfloat16)
        table = jnp.asarray(np.random.default_rng(0).permutation(nb).reshape(1, nb).astype(np.int32))
        cu, kl = jnp.array([0, TOKENS], jnp.int32), jnp.array([TOKENS], jnp.int32)
        f = jax.jit(lambda q, pool, cu, kl, table: prefill.paged_prefill_mgpu(
            q, pool, jnp.int32(0), cu, kl, table, scale=D ** -0.5, interpret=None, block_kv=BLOCK_KV, num_slots=2))
        out = jax.block_until_ready(f(q, pool, cu, kl, table))
        t0 = time.perf_counter()
        for _ in range(5):
            out = f(q, pool, cu, kl, table)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / 5 * 1e6
    finally:
        prefill.plgpu.kernel = kernel


def main():
    plain_us = run(None)
    d = tempfile.mkdtemp()
    profiled_us = run(d)
    print(f"{TOKENS} tokens: unprofiled {plain_us:.1f} us a call, profiled {profiled_us:.1f} us (the profile "
          f"written after the first call)", flush=True)
    files = glob.glob(os.path.join(d, "*.json"))
    events = json.load(open(files[0]))["traceEvents"]
    if os.environ.get("TRACE_COPY"):  # keep the raw trace (for reading it again off the GPU)
        import shutil
        shutil.copy(files[0], os.environ["TRACE_COPY"])
    by_trace = collections.defaultdict(list)
    for e in events:
        by_trace[e["tid"]].append(e)
    totals = {role: collections.Counter() for role in ("compute", "memory")}
    spans = {"compute": [], "memory": []}
    phases = {"compute": ("wait_k", "qk", "softmax", "wait_v", "pv"), "memory": ("wait_free",)}
    for tid, evs in by_trace.items():
        role = "memory" if (tid - 1) % 3 == 2 else "compute"  # warpgroup 2 of a program issues the copies
        open_at = {}
        for e in evs:
            if e["ph"] == "B":
                open_at[e["name"]] = e["ts"]
            elif e["name"] in open_at:  # (other scopes, a loop's, are counted but not in the sum below)
                totals[role][e["name"]] += e["ts"] - open_at.pop(e["name"])
        spans[role].append(evs[-1]["ts"] - evs[0]["ts"])
    print(f"traces {len(by_trace)}; events {len(events)}")
    for role in ("compute", "memory"):
        whole = sum(spans[role])
        if not whole:
            continue
        n = len(spans[role])
        print(f"\n{role} warpgroups: {n}, first-to-last event span per warpgroup mean "
              f"{np.mean(spans[role]):.1f}, max {np.max(spans[role]):.1f} us")
        print("| phase | share of the span | us per warpgroup |")
        print("| --- | --- | --- |")
        for name, c in totals[role].most_common():
            print(f"| {name}{'' if name in phases[role] else ' (not a phase)'} | {100 * c / whole:.1f}% | {c / n:.1f} |")
        rest = whole - sum(totals[role][name] for name in phases[role])
        print(f"| (outside the phases) | {100 * rest / whole:.1f}% | {rest / n:.1f} |")
    pairing(events)


def pairing(events):
    """Per compute step: each phase's mean time, the step period (one ``qk`` start to the next), and
    how a program's two compute warpgroups line up: the share of a ``qk`` (``softmax``) phase that the
    partner's ``qk`` (``softmax``) overlaps, and the offset between their ``qk`` starts. Traces
    ``3p + 1`` and ``3p + 2`` are program ``p``'s compute warpgroups."""
    intervals = collections.defaultdict(lambda: collections.defaultdict(list))
    open_at = {}
    for e in events:
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"]
        elif key in open_at:
            intervals[e["tid"]][e["name"]].append((open_at.pop(key), e["ts"]))
    print("\ncompute steps, mean us:", ", ".join(
        f"{ph} {np.mean([b - a for iv in intervals.values() for a, b in iv.get(ph, [])]):.3f}"
        for ph in ("wait_k", "qk", "softmax", "wait_v", "pv")),
          f"; step period {np.mean([d for iv in intervals.values() for d in np.diff([a for a, _ in iv.get('qk', [])])]):.3f}")
    overlap = {"qk": [], "softmax": []}
    offsets = []
    for tid, a in intervals.items():
        b = intervals.get(tid + 1, {})
        if tid % 3 != 1 or "qk" not in a or "qk" not in b:
            continue
        for i in range(min(len(a["qk"]), len(b["qk"]))):
            offsets.append(b["qk"][i][0] - a["qk"][i][0])
            for ph, shares in overlap.items():
                (x0, x1), (y0, y1) = a[ph][i], b[ph][i]
                shares.append(max(0.0, min(x1, y1) - max(x0, y0)) / max(x1 - x0, 1e-9))
    print(f"partner overlap: qk {np.mean(overlap['qk']):.2f}, softmax {np.mean(overlap['softmax']):.2f}; "
          f"partner's qk start minus this one's, us: median {np.median(offsets):.3f}, "
          f"p10 {np.percentile(offsets, 10):.3f}, p90 {np.percentile(offsets, 90):.3f}")


if __name__ == "__main__":
    main()
