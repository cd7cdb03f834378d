"""What launching one jitted call costs the host, by the number of array arguments and donated arrays.

The engine's step takes every weight as its own array (Qwen3-0.6B: 311) and the KV pool, which was 2
arrays per layer (56, donated) and is now one (``kernels/kv_write.py``). At batch 1 the device step is
~1.1 ms, so a launch that costs the host about as much decides the time per token. This measures, with a
trivial computation (so the device time is negligible), the host time per call for argument counts like
the engine's (Qwen3-0.6B now: 226 weights + 1 donated pool + a numpy input), before (311 + 56 donated),
and for fewer arrays (weights stacked per kind would be ~16).

    python benchmarks/bench_dispatch.py [--calls 300] [--kernels 1,64,256,512] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

CASES = ((4, 0), (4, 2), (16, 1), (64, 1), (226, 0), (226, 1), (311, 1))


def dispatch_us(num_args: int, num_donated: int, calls: int, numpy_input: bool = False) -> float:
    """Host microseconds per call of a jitted ``(args, pool, x) -> (y, pool')`` with ``pool`` donated;
    ``numpy_input``: ``x`` is a numpy array, transferred by the call (True) or by ``jax.device_put``
    before each call (``"device_put"``: measured slower on the H200, so the engine passes numpy)."""
    args = [jnp.full((8,), i, jnp.float32) for i in range(num_args)]
    pool = [jnp.full((8,), i, jnp.float32) for i in range(num_donated)]
    x = np.ones((200,), np.float32) if numpy_input else jnp.ones((200,), jnp.float32)
    put = numpy_input == "device_put"
    fn = jax.jit(lambda a, p, x: (a[0][0] + x, [q + x[:8] for q in p]), donate_argnums=(1,))
    for _ in range(5):
        _, pool = fn(args, pool, x)
    jax.block_until_ready(pool)
    t0 = time.perf_counter()
    for _ in range(calls):
        y, pool = fn(args, pool, jax.device_put(x) if put else x)
    t1 = time.perf_counter()
    jax.block_until_ready((y, pool))
    return (t1 - t0) / calls * 1e6


def launch_us(num_kernels: int, calls: int, graphs: bool = True) -> float:
    """Median host microseconds until a jitted call of ``num_kernels`` small unfused kernels returns (the
    device idle before each call: the launch alone, as ``profile_step``'s). ``graphs``: XLA's command
    buffers (CUDA graphs) as the engine's steps have them, else every kernel launched on its own.
    Why: a TTFT launch traced with command buffers kept showed ``cuGraphLaunch`` at ~0.6 ms for 268
    nodes (RESULTS.md, session 9); this asks how a launch's host time grows with a graph's nodes."""
    from jax import lax  # noqa: PLC0415

    def chain(x):
        for _ in range(num_kernels):  # the barrier keeps XLA from fusing the ops into one kernel
            x = lax.optimization_barrier(x * 1.0001 + 1.0)
        return x

    options = None if graphs else {"xla_gpu_enable_command_buffer": ""}
    fn = jax.jit(chain, compiler_options=options) if jax.default_backend() == "gpu" else jax.jit(chain)
    x = jnp.ones((1024,), jnp.float32)
    for _ in range(3):
        x = fn(x)
    jax.block_until_ready(x)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        y = fn(x)
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(y)
    times.sort()
    return times[len(times) // 2] * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--kernels", default="",
                    help="also: launch time by kernels in the call, e.g. 1,64,256,512 (CUDA graphs on and off)")
    args = ap.parse_args(argv)
    rows = [dict(args=a, donated=d, numpy_input=False, dispatch_us=dispatch_us(a, d, args.calls)) for a, d in CASES]
    rows += [dict(args=a, donated=d, numpy_input=True, dispatch_us=dispatch_us(a, d, args.calls, True))
             for a, d in ((4, 1), (226, 1))]
    rows.append(dict(args=226, donated=1, numpy_input="device_put", dispatch_us=dispatch_us(226, 1, args.calls, "device_put")))
    sizes = [int(k) for k in args.kernels.split(",") if k]
    launches = [dict(kernels=k, graphs=g, launch_us=launch_us(k, args.calls, g)) for k in sizes for g in (True, False)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dispatch.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows, launches=launches), f, indent=1)
    print(f"host time per jitted call, {jax.devices()[0]}, jax {jax.__version__}")
    print(f"{'arrays':>6s} {'donated':>7s} {'numpy x':>7s} {'us/call':>8s}")
    for r in rows:
        print(f"{r['args']:6d} {r['donated']:7d} {str(r['numpy_input']):>7s} {r['dispatch_us']:8.1f}")
    if launches:
        print("launch alone (median host us until the call returns, device idle before it)")
        print(f"{'kernels':>7s} {'graphs':>6s} {'us':>8s} {'us/kernel':>9s}")
        for r in launches:
            print(f"{r['kernels']:7d} {str(r['graphs']):>6s} {r['launch_us']:8.1f} {r['launch_us'] / r['kernels']:9.2f}")
    return rows + launches


if __name__ == "__main__":
    main()
