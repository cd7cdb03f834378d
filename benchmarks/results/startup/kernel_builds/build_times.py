"""How long each Mosaic GPU kernel of a cold warm-up takes to build, each alone.

An engine at Qwen3-0.6B shapes (random weights, ``max_model_len`` 4096, no compilation cache) on the
Mosaic backend starts its warm-up, which traces every step and exports the Mosaic GPU kernels they
launch (in worker processes, ``lowered_once.export_traced``); the warm-up is stopped there. Each
exported kernel is then compiled alone, one at a time, in a program of its own: that compilation is the
kernel's build (Mosaic GPU's passes, LLVM, ``ptxas``), which a warm-up otherwise does inside the first
step's compilation that calls it. Printed per kernel, slowest first: the build's seconds, its name, its
static parameters (the body's), its operands' shapes and the size of its Mosaic module.

    python benchmarks/results/startup/kernel_builds/build_times.py [--kv-cache-dtype fp8] [--repeat 1]

``--repeat 2`` builds the slowest kernel a second time from a copy of its module with a new hash (its
``kernel_name`` changed), to see how much of a build repeats the same way. ``--parallel 16`` then
builds every kernel again (renamed, so none is found built) in 16 threads at once, each lowered first:
the wall time against the sum says whether a process builds Mosaic GPU kernels in parallel.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", ".."))
os.environ.setdefault("JAXPAGED_COMPILE_CACHE", tempfile.mkdtemp(prefix="jaxpaged-builds-"))

import jax  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine  # noqa: E402
from jaxpaged.kernels import lowered_once  # noqa: E402
from jaxpaged.workloads import QWEN3_0_6B, random_model  # noqa: E402


class Traced(Exception):
    """Raised once the warm-up has traced its steps and exported their kernels."""


def describe(build) -> tuple[str, str]:
    """A kernel's name and its body's static parameters, from its ``build`` (a partial of
    ``plgpu.kernel`` whose first argument is a partial of the body)."""
    body = build.args[0]
    name = build.keywords.get("kernel_name", "?")
    params = ", ".join(f"{k}={v}" for k, v in sorted(getattr(body, "keywords", {}).items())
                       if k not in ("scale_log2",))
    return name, params


def build_seconds(build, avals) -> tuple[float, float, int]:
    """(lowering s, compilation s, module characters) of ``build()``'s kernel alone at ``avals``."""
    t = time.perf_counter()
    lowered = jax.jit(build()).trace(*avals).lower()
    t_lower = time.perf_counter() - t
    text = lowered.as_text()
    t = time.perf_counter()
    lowered.compile()
    return t_lower, time.perf_counter() - t, len(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--backend", default="mosaic")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=0)
    args = ap.parse_args(argv)

    export_traced = lowered_once.export_traced

    def export_then_stop(workers=None):
        t = time.perf_counter()
        n = export_traced(workers)
        raise Traced(f"{n} kernels exported in {time.perf_counter() - t:.1f} s")

    lowered_once.export_traced = export_then_stop
    params = random_model(QWEN3_0_6B)
    engine = LLMEngine(params, EngineConfig(max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype,
                                            attention_backend=args.backend, compilation_cache=False))
    try:
        engine.warmup(use_tqdm=False)
        raise SystemExit("the warm-up finished without exporting kernels (nothing to build alone)")
    except Traced as e:
        print(f"warm-up stopped after tracing: {e}", flush=True)
    lowered_once.export_traced = export_traced

    rows = []
    for key, (build, avals) in lowered_once._kernels.items():
        name, static = describe(build)
        t_lower, t_build, size = build_seconds(build, avals)
        shapes = " ".join(f"{a.dtype}{list(a.shape)}" for a in avals)
        rows.append((t_build, t_lower, name, static, shapes, size, key, build, avals))
        print(f"{t_build:7.2f} s build  {t_lower:5.2f} s lower  {size / 1e3:8.1f} k chars  {name}  {static}  |  "
              f"{shapes}", flush=True)
    rows.sort(key=lambda r: -r[0])
    for _ in range(1, args.repeat):
        t_build, _, name, static, _, _, _, build, avals = rows[0]
        again = functools.partial(build.func, *build.args, **dict(build.keywords, kernel_name=name + "_again"))
        t_lower2, t_build2, _ = build_seconds(again, avals)
        print(f"again: {name} {static}: {t_build2:.2f} s build (first {t_build:.2f}), {t_lower2:.2f} s lower")

    if args.parallel:
        lowered = []
        for _, _, name, _, _, _, _, build, avals in rows:
            renamed = functools.partial(build.func, *build.args, **dict(build.keywords, kernel_name=name + "_p"))
            lowered.append(jax.jit(renamed()).trace(*avals).lower())

        def timed_compile(lo):
            t = time.perf_counter()
            lo.compile()
            return time.perf_counter() - t

        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            each = list(pool.map(timed_compile, lowered))
        print(f"parallel: {len(each)} kernels in {args.parallel} threads: wall {time.perf_counter() - t:.2f} s, "
              f"each {min(each):.2f}-{max(each):.2f} s, sum {sum(each):.2f} s (one at a time: "
              f"{sum(r[0] for r in rows):.2f} s)", flush=True)

    total = sum(r[0] for r in rows)
    print(f"\n{len(rows)} kernels, {total:.1f} s of builds one at a time, {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}, kv_cache_dtype {args.kv_cache_dtype}")
    print("| build s | lower s | module k chars | kernel | static parameters | operands |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t_build, t_lower, name, static, shapes, size, *_ in rows:
        print(f"| {t_build:.2f} | {t_lower:.2f} | {size / 1e3:.0f} | {name} | {static} | {shapes} |")


if __name__ == "__main__":
    main()
