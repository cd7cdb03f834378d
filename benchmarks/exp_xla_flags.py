"""Experiment: the decode step (batch 256, context ~350, Qwen3-0.6B shapes, random bf16) under XLA GPU
compiler options passed per executable (``jax.jit(..., compiler_options=...)``), not via ``XLA_FLAGS``.

The engine is brought to steady decode once (see ``profile_step.py``); one real step's inputs are captured.
Then, for each variant, the same step function is jitted with that variant's ``compiler_options`` and:

* ``compile s``: first call (compile + one run);
* ``replay ms``: the captured step re-run with device-resident inputs, blocking after each call (launch +
  device time, no scheduler) and ``pipelined ms``: N calls back to back, one block at the end;
  ``dispatch ms``: in that loop, the host time per call to enqueue it (what launching costs the host);
* ``engine ms``: real ``engine.step()`` walls with this variant installed, measured in interleaved rounds
  across variants so every variant sees the same (slowly growing) context;
* from a short profiler trace of replayed steps: kernels, device busy time and H2D / D2H copies per step
  (a D2H per step inside the step is the ``lax.cond`` predicate of the sampler).

Each variant's options replace the engine's for the replayed step: ``default`` is XLA's defaults
(Triton GEMM fusions), while the engine itself compiles decode-sized steps (33-512 tokens, e.g. the
batch-256 step) with cuBLAS GEMMs (``EngineConfig.cublas_max_tokens``), i.e. ``triton_gemm_off``.

Variants (``--variants`` picks some by name; ``--list`` prints them). Repeated enum options such as
``xla_gpu_enable_command_buffer`` take a comma-separated list of names that REPLACES the default list
("" = command buffers off); booleans are Python bools (a string must be exactly "True"/"False").

    python benchmarks/exp_xla_flags.py --out $OUT
    python benchmarks/exp_xla_flags.py --model tiny --batch 4 --ctx 24 --steps 3 --variants default,cmdbuf_off
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

import profile_step as ps  # noqa: E402

from jaxpaged.engine.transfer import pack  # noqa: E402

# XLA's default list (mid-2026): FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION.
CMDBUF_DEFAULT = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
VARIANTS: dict[str, dict] = {
    "default": {},
    "cmdbuf_off": {"xla_gpu_enable_command_buffer": ""},
    "cmdbuf_default_explicit": {"xla_gpu_enable_command_buffer": CMDBUF_DEFAULT},
    "cmdbuf_+conditional": {"xla_gpu_enable_command_buffer": CMDBUF_DEFAULT + ",CONDITIONAL,WHILE"},
    "cmdbuf_+conditional_min1": {"xla_gpu_enable_command_buffer": CMDBUF_DEFAULT + ",CONDITIONAL,WHILE",
                                 "xla_gpu_graph_min_graph_size": 1},
    "triton_gemm_off": {"xla_gpu_enable_triton_gemm": False},
    "triton_gemm_off_cublaslt": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True},
    "autotune_0": {"xla_gpu_autotune_level": 0},
    "autotune_4": {"xla_gpu_autotune_level": 4},
    "exhaustive_tiling": {"xla_gpu_exhaustive_tiling_search": True},  # slow to compile: not in the default set
}
DEFAULT_SET = ("default,cmdbuf_off,cmdbuf_default_explicit,cmdbuf_+conditional,cmdbuf_+conditional_min1,"
               "triton_gemm_off,triton_gemm_off_cublaslt,autotune_0,autotune_4")


PROBE = {"xla_gpu_enable_command_buffer": "FUSION,CONDITIONAL", "xla_gpu_graph_min_graph_size": 1,
         "xla_gpu_enable_triton_gemm": True, "xla_gpu_autotune_level": 4, "xla_gpu_enable_cublaslt": False,
         "xla_gpu_exhaustive_tiling_search": False, "legacy_command_buffer_custom_call_targets": "__gpu$xla.gpu.triton",
         "xla_gpu_experimental_enable_command_buffer_on_thunks": True, "xla_gpu_command_buffer_scheduling_mode": "LHS"}


def probe_options() -> dict[str, str]:
    """Which DebugOptions names this jaxlib accepts as ``compiler_options`` (a trivial jit per name)."""
    found = {}
    for key, value in PROBE.items():
        try:
            jax.jit(lambda x: x + 1, compiler_options={key: value})(jax.numpy.ones(2)).block_until_ready()
            found[key] = "accepted"
        except Exception as err:  # noqa: BLE001
            found[key] = str(err).split("\n")[0][:160]
    return found


def make_jitted(runner, state, compiler_options: dict):
    """The runner's step over flat weight leaves, jitted with ``compiler_options`` (pool donated)."""
    return runner.make_jitted(jax.tree.structure(state), compiler_options)


def install(runner, state, jitted) -> None:
    runner.set_jitted(state, jitted)


def capture_step_inputs(engine) -> tuple:
    """Runs one engine step and returns the ``(inputs, prev_tokens)`` it passed to the runner."""
    runner, seen = engine.runner, {}
    original = runner.step

    def spy(state, kv_pool, inputs, prev_tokens=None, spare_tokens=None):
        seen["inputs"], seen["prev"] = inputs, prev_tokens
        return original(state, kv_pool, inputs, prev_tokens, spare_tokens)

    runner.step = spy
    try:
        engine.step()
    finally:
        del runner.step  # back to the class method
    prev = seen["prev"] if seen["prev"] is not None else jax.numpy.zeros(seen["inputs"].logits_indices.shape, "int32")
    packed, layout = pack(seen["inputs"])
    return (jax.device_put(packed), layout), jax.device_put(prev)


def replay(engine, jitted, leaves, inputs, prev, n: int, pipelined: bool, annotate: bool = False) -> list[float]:
    with engine.runner._partitioner():  # the step's jit cache key includes the partitioner (tensor parallel)
        return _replay(engine, jitted, leaves, inputs, prev, n, pipelined, annotate)


def _replay(engine, jitted, leaves, inputs, prev, n: int, pipelined: bool, annotate: bool) -> list[float]:
    walls = []
    tokens = jax.numpy.zeros_like(prev)  # the donated buffer of the first call's tokens (runner.step)
    if pipelined:
        t0 = time.perf_counter()
        for _ in range(n):
            tokens, engine.kv_pool = jitted(leaves, engine.kv_pool, inputs[0], prev, tokens, inputs[1])
        dispatched = time.perf_counter()
        tokens.block_until_ready()
        return [(time.perf_counter() - t0) / n, (dispatched - t0) / n]
    for i in range(n):
        t0 = time.perf_counter()
        if annotate:
            with jax.profiler.TraceAnnotation(f"exp_xla_flags:replay #{i}"):
                tokens, engine.kv_pool = jitted(leaves, engine.kv_pool, inputs[0], prev, tokens, inputs[1])
                tokens.block_until_ready()
        else:
            tokens, engine.kv_pool = jitted(leaves, engine.kv_pool, inputs[0], prev, tokens, inputs[1])
            tokens.block_until_ready()
        walls.append(time.perf_counter() - t0)
    return walls


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=350)
    ap.add_argument("--steps", type=int, default=20, help="replayed steps per measurement")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of engine steps")
    ap.add_argument("--engine-steps", type=int, default=5, help="engine steps per variant per round")
    ap.add_argument("--trace-steps", type=int, default=5)
    ap.add_argument("--model", choices=ps.MODELS, default="qwen3-0.6b")
    ap.add_argument("--variants", default=DEFAULT_SET)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--keep-traces", action="store_true", help="keep each variant's trace under --out/traces")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.list:
        for name, opts in VARIANTS.items():
            print(f"{name:28s} {opts}")
        return {}
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    probe = probe_options()
    for key, status in probe.items():
        print(f"option {key}: {status}", flush=True)

    params = ps.load_params(args.model)
    n_engine = len(names) * (args.rounds * args.engine_steps + 2) + 8
    gen = ps.prefill_steps_estimate(args.batch, args.ctx, args.max_num_batched_tokens) + n_engine + 16
    engine = ps.build_engine(params, batch=args.batch, max_model_len=args.ctx + gen,
                             max_num_batched_tokens=args.max_num_batched_tokens, backend=args.backend)
    steady = ps.reach_steady_decode(engine, batch=args.batch, ctx=args.ctx, max_tokens=gen,
                                    temperature=args.temperature, warmup_steps=2)
    print(f"steady decode after {steady['prefill_steps']} steps ({steady['seconds']:.1f} s, "
          f"compile {steady['compile_seconds']:.1f} s)", flush=True)
    runner = engine.runner
    leaves = runner._flat(engine.params.state)[1]
    original_jitted = dict(runner._jitted)  # every variant (the engine's decode-sized steps run cuBLAS's)
    inputs, prev = capture_step_inputs(engine)

    results: dict[str, dict] = {}
    jitted_by_name = {}
    scratch = tempfile.mkdtemp(prefix="exp_xla_flags_")
    for name in names:
        opts = VARIANTS[name]
        r = results[name] = dict(options={k: v for k, v in opts.items()})
        try:
            jitted = make_jitted(runner, engine.params.state, opts)
            t0 = time.perf_counter()
            replay(engine, jitted, leaves, inputs, prev, 1, pipelined=False)
            r["compile_s"] = time.perf_counter() - t0
            replay(engine, jitted, leaves, inputs, prev, 2, pipelined=False)  # warm
            lat = replay(engine, jitted, leaves, inputs, prev, args.steps, pipelined=False)
            r["replay_ms"] = statistics.median(lat) * 1e3
            r["replay_min_ms"] = min(lat) * 1e3
            pipelined, dispatch = replay(engine, jitted, leaves, inputs, prev, args.steps, pipelined=True)
            r["pipelined_ms"], r["dispatch_ms"] = pipelined * 1e3, dispatch * 1e3
            jitted_by_name[name] = jitted
            trace_dir = os.path.join(args.out if args.keep_traces else scratch, "traces", name.replace("+", "plus_"))
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            try:
                replay(engine, jitted, leaves, inputs, prev, args.trace_steps, pipelined=False, annotate=True)
            finally:
                jax.profiler.stop_trace()
            path = ps.find_trace_file(trace_dir)
            if path:
                a = ps.analyse_trace(ps.load_trace(path), args.trace_steps, step_marker="exp_xla_flags:replay")
                r["trace"] = dict(device=a["device"], kernels_per_step=a["kernel_count_per_step"],
                                  kernel_ms=a["kernel_us_per_step"] / 1e3, busy_ms=a["busy_us_per_step"] / 1e3,
                                  copies=a["copies"], top=a["top"][:10])
            print(f"{name}: compile {r['compile_s']:.1f} s, replay {r['replay_ms']:.3f} ms, "
                  f"pipelined {r['pipelined_ms']:.3f} ms, dispatch {r['dispatch_ms']:.3f} ms", flush=True)
        except Exception as err:  # a bad option fails at compile time: record it, go on
            r["error"] = f"{type(err).__name__}: {err}"[:2000]
            print(f"{name}: FAILED {r['error'][:300]}", flush=True)

    # Engine steps in interleaved rounds (context grows by one token per step for everyone).
    shutil.rmtree(scratch, ignore_errors=True)
    for name in jitted_by_name:
        results[name]["engine_wall_s"] = []
    try:
        for _ in range(args.rounds):
            for name, jitted in jitted_by_name.items():
                install(runner, engine.params.state, jitted)
                engine.step()  # first step after a switch: not timed
                t = ps.timed_steps(engine, args.engine_steps)
                results[name]["engine_wall_s"].extend(t["wall_s"])
    finally:
        runner._jitted.clear()  # the engine's own jitted steps, every variant, back
        runner._jitted.update(original_jitted)
        runner._shapes_seen.clear()
    for name in jitted_by_name:
        w = results[name]["engine_wall_s"]
        results[name]["engine_ms"] = statistics.median(w) * 1e3 if w else None

    out = dict(model=args.model, batch=args.batch, ctx=args.ctx, device=str(jax.devices()[0]), jax=jax.__version__,
               backend=runner.attention_backend, args=vars(args), option_probe=probe, steady=steady, variants=results)
    with open(os.path.join(args.out, "exp_xla_flags.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)

    f3 = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"\nXLA options per executable: decode step, model {args.model}, batch {args.batch}, ctx ~{args.ctx}, "
          f"{out['device']}, jax {jax.__version__}, backend {runner.attention_backend}")
    print(f"{'variant':28s} {'compile s':>9s} {'replay ms':>9s} {'pipelined':>9s} {'dispatch':>8s} {'engine ms':>9s} "
          f"{'kernels':>7s} {'busy ms':>8s} {'H2D':>4s} {'D2H':>4s}")
    base = results.get("default", {}).get("replay_ms")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:28s} FAILED: {r['error'][:90]}")
            continue
        tr = r.get("trace") or {}
        cp = tr.get("copies", {})
        rel = f"  ({r['replay_ms'] / base:.2f}x)" if base else ""
        print(f"{name:28s} {r['compile_s']:9.1f} {r['replay_ms']:9.3f} {r['pipelined_ms']:9.3f} {r['dispatch_ms']:8.3f} "
              f"{f3(r.get('engine_ms')):>9s} {tr.get('kernels_per_step', 0):7.0f} {tr.get('busy_ms', 0):8.3f} "
              f"{cp.get('h2d', {}).get('count_per_step', 0):4.0f} {cp.get('d2h', {}).get('count_per_step', 0):4.0f}{rel}")
    print("replay: the captured step re-run with device inputs, blocked each call; pipelined: back to back; "
          "dispatch: host time per call to enqueue it (pipelined loop); engine: engine.step() wall (scheduling + H2D + step + readback)")
    return out


if __name__ == "__main__":
    main()
