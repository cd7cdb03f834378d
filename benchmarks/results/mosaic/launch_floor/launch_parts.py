"""Where a Mosaic GPU launch's fixed cost comes from: the kernel's body, its prologue, or the launch path.

``launch_floor.py`` found a Mosaic GPU launch 1.2-2.5 us dearer than a Triton launch, chained. This
splits that by kernel, each chained ``N`` times in a jit on ``f32[64, 128]`` (each launch takes the last
one's output), grid 1 x 1 unless said:

* ``noop``: a body that does nothing (no copies, no TMA descriptors; the output is left unwritten),
  on both backends: what a launch costs with no work at all;
* Mosaic ``noop``, three warpgroups (the prefill kernel's 384 threads); ``noop``, 16 barriers (their
  initialisation and the fence after it, as the attention kernels have); ``noop``, grid 8 x 264;
* ``add one``: the whole array copied in and out (Mosaic GPU: two TMA copies; Triton: loads and stores).

For each: the chained wall time a launch (the median of 30 chains, and their minimum), and from a
profile of 10 chains the kernel's own GPU time (median), the idle gap before it (median), and the
chain's GPU span a launch. Then the same in a child process with XLA's command buffers (CUDA graphs)
off, where each launch is issued by the host as it comes: that wall time a launch is the host's launch
path (XLA's thunk, and for Mosaic GPU its FFI handler and the kernel's host function). Run from the
repository root:

    python3 benchmarks/results/mosaic/launch_floor/launch_parts.py [N]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "..", "..", "..", "tools")]
warnings.filterwarnings("ignore", category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from jax.experimental.pallas import triton as pltriton  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 50
CHILD = "--child" in sys.argv
VLOG = "--vlog" in sys.argv
GPU = jax.default_backend() == "gpu"
SHAPE = (64, 128)
OUT = jax.ShapeDtypeStruct(SHAPE, jnp.float32)


def mosaic(kind: str, threads: int = 1, barriers: int = 0, grid=(1, 1)):
    """A Mosaic GPU kernel: ``noop`` (nothing) or ``add one`` (TMA in, add, TMA out) by program (0, 0)."""
    def body(x_ref, o_ref, *scratch):
        if kind == "add one":
            x_smem, bar = scratch[:2]
            first = jnp.logical_and(lax.axis_index("h") == 0, lax.axis_index("p") == 0)

            @pl.when(first)
            def _():
                plgpu.copy_gmem_to_smem(x_ref, x_smem, bar.at[0])
                plgpu.barrier_wait(bar.at[0])
                x_smem[...] = x_smem[...] + 1.0
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(x_smem, o_ref)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = []
    if kind == "add one":
        scratch = [plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    elif barriers:
        scratch = [plgpu.Barrier(num_arrivals=1, num_barriers=barriers)]
    threads_kw = dict(num_threads=threads, thread_name="wg") if threads > 1 else {}
    return plgpu.kernel(body, out_type=OUT, scratch_types=scratch, grid=grid, grid_names=("h", "p"),
                        interpret=None if GPU else plgpu.InterpretGPUParams(),
                        kernel_name=f"mosaic_{kind.replace(' ', '_')}_{threads}_{barriers}_{grid[1]}", **threads_kw)


def triton(kind: str, grid=(1, 1)):
    """A Pallas-Triton kernel: ``noop`` or ``add one`` (loads, add, stores) by program 0."""
    def body(x_ref, o_ref):
        if kind == "add one":
            @pl.when(pl.program_id(0) == 0)
            def _():
                o_ref[...] = x_ref[...] + 1.0

    spec = pl.BlockSpec(SHAPE, lambda i: (0, 0))
    return pl.pallas_call(body, out_shape=OUT, grid=(grid[0] * grid[1],), in_specs=[spec], out_specs=spec,
                          compiler_params=pltriton.CompilerParams(num_warps=4),
                          interpret=None if GPU else True, name=f"triton_{kind.replace(' ', '_')}_{grid[1]}")


CASES = [
    ("noop", "mosaic", lambda: mosaic("noop")),
    ("noop", "triton", lambda: triton("noop")),
    ("noop, 3 warpgroups", "mosaic", lambda: mosaic("noop", threads=3)),
    ("noop, 16 barriers", "mosaic", lambda: mosaic("noop", barriers=16)),
    ("noop, grid 8 x 264", "mosaic", lambda: mosaic("noop", grid=(8, 264))),
    ("noop, grid 8 x 264", "triton", lambda: triton("noop", grid=(8, 264))),
    ("add one", "mosaic", lambda: mosaic("add one")),
    ("add one", "triton", lambda: triton("add one")),
    ("noop, donated", "mosaic", lambda: mosaic("noop")),
    ("noop, donated", "triton", lambda: triton("noop")),
    ("add one, donated", "mosaic", lambda: mosaic("add one")),
    ("add one, donated", "triton", lambda: triton("add one")),
]


def chain(kernel, donate: bool = False):
    """``N`` launches of ``kernel`` in a jit; ``donate``: its argument donated, so its output can take the
    argument's buffer (every buffer the chain touches then keeps its address from run to run)."""
    def run(x):
        for _ in range(N):
            x = kernel(x)
        return x
    return jax.jit(run, donate_argnums=(0,) if donate else ())


def wall(run, x, reps: int = 30, donate: bool = False) -> tuple[float, float]:
    """The chain's wall time a launch: median and minimum over ``reps`` runs, us (``donate``: each run
    fed the last one's output)."""
    x = jax.block_until_ready(run(x + 0 if donate else x))
    times = []
    for _ in range(reps if GPU else 1):
        t = time.perf_counter()
        y = jax.block_until_ready(run(x))
        times.append(time.perf_counter() - t)
        x = y if donate else x
    return statistics.median(times) * 1e6 / N, min(times) * 1e6 / N


def profile(run, x, chains: int = 10) -> tuple[float, float, float]:
    """From a trace of ``chains`` runs: the kernel's GPU time (median), the idle gap before each launch
    after a chain's first (median) and the chain's GPU span a launch (median), us."""
    from profile_step import find_trace_file, load_trace

    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(chains):
        jax.block_until_ready(run(x))
        time.sleep(0.002)
    jax.profiler.stop_trace()
    ev = load_trace(find_trace_file(d))
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in ev
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = sorted((e for e in ev if e.get("ph") == "X" and "dur" in e
                  and "/device:GPU:0" in procs.get(e["pid"], "")
                  and "stream" in threads.get((e["pid"], e.get("tid")), "").lower()
                  and "memcpy" not in e["name"].lower() and "memset" not in e["name"].lower()),
                 key=lambda e: e["ts"])
    spans, cur = [], []
    for e in gpu:  # chains: separated by the sleep
        if cur and e["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > 1000:
            spans.append(cur)
            cur = []
        cur.append(e)
    spans.append(cur)
    durs = [e["dur"] for s in spans for e in s]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for s in spans for a, b in zip(s, s[1:])]
    span = statistics.median((s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"]) / len(s) for s in spans)
    return statistics.median(durs), statistics.median(gaps), span


def measure(with_profile: bool) -> list[dict]:
    x = jnp.zeros(SHAPE, jnp.float32)
    rows = []
    for rnd in range(2 if GPU else 1):
        for name, backend, make in CASES:
            donate = name.endswith("donated")
            run = chain(make(), donate)
            if name == "add one":
                out = run(x)
                assert float(out[0, 0]) == N and float(out[-1, -1]) == N, (out[0, 0], out[-1, -1])
            med, lo = wall(run, x, donate=donate)
            row = dict(round=rnd, case=name, backend=backend, wall=med, wall_min=lo)
            if with_profile and GPU and rnd == 0 and not donate:
                row["kernel"], row["gap"], row["span"] = profile(run, x)
            rows.append(row)
            print(json.dumps(row) if CHILD else f"round {rnd} {name:22} {backend:7} wall {med:6.2f} (min {lo:6.2f})"
                  + (f" kernel {row['kernel']:5.2f} gap {row['gap']:5.2f} span {row['span']:5.2f}" if "kernel" in row else ""),
                  flush=True)
    return rows


def vlog():
    """Three runs of each no-op chain, plain and donated, each announced on stderr, for XLA's command
    buffer log (the parent sets ``TF_CPP_VMODULE``)."""
    x = jnp.zeros(SHAPE, jnp.float32)
    for name, backend, make in CASES:
        if not name.startswith("noop") or "grid" in name or "warpgroups" in name or "barriers" in name:
            continue
        donate = name.endswith("donated")
        run = chain(make(), donate)
        y = jax.block_until_ready(run(x + 0))
        for i in range(3):
            print(f"=== {name} {backend} run {i}", file=sys.stderr, flush=True)
            y2 = jax.block_until_ready(run(y if donate else x))
            y = y2 if donate else y


def main():
    if CHILD:
        measure(with_profile=False)
        return
    if VLOG:
        vlog()
        return
    rows = measure(with_profile=True)
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip())
    res = subprocess.run([sys.executable, __file__, str(N), "--child"], env=env, capture_output=True, text=True)
    no_graphs = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode:
        print("child failed:", res.stderr[-2000:])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_thunk=3")
    res = subprocess.run([sys.executable, __file__, "4", "--vlog"], env=env, capture_output=True, text=True)
    print("command buffer log (4 launches a chain):")
    for ln in res.stderr.splitlines():
        if ln.startswith("===") or "command buffer" in ln.lower():
            print("  ", ln[ln.find("]") + 1:].strip()[:240] if not ln.startswith("===") else ln)
    print(f"\n{N} chained launches a jit, f32[64, 128], {jax.devices()[0].device_kind}, jax {jax.__version__}; us a "
          "launch: wall median of two rounds (min); kernel GPU time, gap before it, GPU span a launch (profiled, "
          "first round); wall with command buffers off (host-issued launches)")
    print("| kernel | backend | wall, rounds (min) | kernel | gap | span | wall, command buffers off, rounds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, backend, _ in CASES:
        mine = [r for r in rows if r["case"] == name and r["backend"] == backend]
        off = [r for r in no_graphs if r["case"] == name and r["backend"] == backend]
        p = next((r for r in mine if "kernel" in r), None)
        prof = f"{p['kernel']:.2f} | {p['gap']:.2f} | {p['span']:.2f}" if p else "n/a | n/a | n/a"
        print(f"| {name} | {backend} | {' / '.join(f'{r['wall']:.2f}' for r in mine)} "
              f"({min(r['wall_min'] for r in mine):.2f}) | {prof} | {' / '.join(f'{r['wall']:.2f}' for r in off) or 'n/a'} |")


if __name__ == "__main__":
    main()
