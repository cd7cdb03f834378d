"""The host's share of an engine step, without a device: schedule, build and pack the inputs, book
the step, read its tokens back, make outputs. The jitted step is replaced by a stub that packs the
inputs (as ``ModelRunner.step`` does) and returns ready tokens, so what is timed is exactly the
Python and numpy work that must hide behind the GPU's step (async scheduling overlaps the two only
while the host is the shorter). Tiny checkpoint (the model does not matter here), greedy, every
request decoding: ``--batch`` requests of ``--prompt-len`` tokens, timed over ``--steps`` steps after
``--warmup`` steps. Reports the median and mean microseconds per step, and with ``--profile`` the
top functions by own time (cProfile inflates the absolute numbers); then the median time of
``add_request`` for prompts of ``--add-request-lens`` tokens (part of every TTFT), and for a lone
``--first-step-len``-token request its ``add_request``, first step and the steps until it finished.

    python benchmarks/bench_engine_host.py [--batches 1,64,256] [--steps 200] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params  # noqa: E402
from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.engine.transfer import pack  # noqa: E402


def stub_engine(batch: int, prompt_len: int, max_tokens: int) -> LLMEngine:
    """An engine whose jitted step is a stub: pack the inputs, return constant tokens (ready)."""
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    max_len = prompt_len + max_tokens + 16
    engine = LLMEngine(params, EngineConfig(block_size=16, num_blocks=batch * (-(-max_len // 16)) + 1,
                                            max_num_seqs=batch, max_model_len=max_len,
                                            max_num_batched_tokens=8192, compilation_cache=False))
    tokens: dict[int, object] = {}

    def step(state, kv_pool, inputs, prev_tokens, spare_tokens=None):
        pack(inputs)
        rows = inputs.logits_indices.shape[0]
        if rows not in tokens:
            tokens[rows] = jnp.full((rows,), 7, jnp.int32)
        return tokens[rows], kv_pool

    engine.runner.step = step
    return engine


def measure(batch: int, prompt_len: int, steps: int, warmup: int, profile: bool) -> dict:
    engine = stub_engine(batch, prompt_len, max_tokens=warmup + 2 * steps + 8)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=warmup + 2 * steps + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(1, 500, prompt_len).tolist(), sp)
    for _ in range(warmup):  # prefill, then decode
        engine.step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    row = dict(batch=batch, prompt_len=prompt_len, steps=steps, median_us=statistics.median(walls) * 1e6,
               mean_us=statistics.fmean(walls) * 1e6)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        stats = pstats.Stats(prof).sort_stats("tottime")
        row["top"] = [dict(function=f"{os.path.basename(f)}:{line}({name})", calls=nc, own_s=tt, cum_s=ct)
                      for (f, line, name), (_, nc, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]]
    return row


def measure_add_request(prompt_len: int, reps: int = 200) -> float:
    """Median microseconds of ``add_request`` for a ``prompt_len``-token prompt (then aborted)."""
    engine = stub_engine(1, prompt_len, 8)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(1)
    times = []
    for _ in range(reps):
        prompt = rng.integers(1, 500, prompt_len).tolist()
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, sp)
        times.append(time.perf_counter() - t0)
        engine.abort_request(rid)
        engine.step()
    return statistics.median(times) * 1e6


def measure_first_step(prompt_len: int, reps: int = 400, skip: int = 50) -> dict:
    """A request alone (``max_tokens=1``): median microseconds of ``add_request``, of the first
    ``step()`` (schedule, build, pack, dispatch of its prefill: TTFT's host part before the launch)
    and of the steps until it finished (reading its token back, its output)."""
    engine = stub_engine(1, prompt_len, 8)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(2)
    parts = []
    for i in range(reps + skip):
        prompt = rng.integers(1, 500, prompt_len).tolist()
        t0 = time.perf_counter()
        engine.add_request(prompt, sp)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if i >= skip:
            parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    med = [statistics.median(p[j] for p in parts) * 1e6 for j in range(3)]
    return dict(prompt_len=prompt_len, add_request_us=med[0], first_step_us=med[1], until_finished_us=med[2])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--add-request-lens", default="32,960", help="prompt lengths for the add_request timing ('' = none)")
    ap.add_argument("--first-step-len", type=int, default=32,
                    help="prompt length of the lone-request timing (add_request + first step); 0 = none")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    rows = [measure(int(b), args.prompt_len, args.steps, args.warmup, args.profile) for b in args.batches.split(",")]
    adds = {int(n): measure_add_request(int(n)) for n in args.add_request_lens.split(",") if n}
    first = measure_first_step(args.first_step_len) if args.first_step_len else None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_host.json"), "w") as f:
            json.dump(dict(cpu=platform.processor() or platform.machine(), rows=rows, add_request_us=adds,
                           first_step=first), f, indent=1)
    for r in rows:
        for t in r.get("top", []):
            print(f"  b{r['batch']:<4d} {t['own_s'] * 1e3:8.1f} ms own {t['cum_s'] * 1e3:8.1f} ms cum x{t['calls']:<7d} {t['function']}")
    print(f"\nhost per engine step without a device ({platform.machine()}, {os.cpu_count()} cores):")
    print(f"{'batch':>5s} {'median us':>10s} {'mean us':>9s}")
    for r in rows:
        print(f"{r['batch']:5d} {r['median_us']:10.1f} {r['mean_us']:9.1f}")
    for n, us in adds.items():
        print(f"add_request, {n}-token prompt: median {us:.1f} us")
    if first:
        print(f"a {first['prompt_len']}-token request alone: add_request {first['add_request_us']:.1f} us, first step "
              f"{first['first_step_us']:.1f} us, then until finished {first['until_finished_us']:.1f} us (medians)")
    return rows


if __name__ == "__main__":
    main()
