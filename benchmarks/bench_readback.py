"""How long a step's few output tokens take to reach the host after the GPU has computed them.

Why: a traced TTFT step (``profile_step.py --ttft``, RESULTS.md session 11) showed the device-to-host
copy of the 1 KB token array starting ~270 us after the step's last kernel (on a PjRt worker
thread) and ``np.asarray`` returning ~200 us after that copy: ~0.45 ms between the GPU's answer and
the host's, on the critical path of every first token and, at batch 1, of every next step's launch.

Here one jitted function stands in for a step: ``--work-ms`` of GPU work (a chain of dependent
matrix products), then an ``int32[rows]`` result like the sampled tokens. Each readback method runs
it ``--reps`` times and records the host's wall time from the call to the values in a numpy array:

* ``async_asarray``: ``copy_to_host_async()`` right after the call, ``np.asarray`` later (the engine's way);
* ``asarray``: ``np.asarray`` only;
* ``block_asarray``: ``block_until_ready()``, then ``np.asarray``;
* ``device_get``: ``jax.device_get``;
* ``pinned_host``: the same function jitted with its output in ``pinned_host`` memory (XLA writes
  it to host memory inside the executable), then ``np.asarray`` (reported as unsupported where the
  backend has no such memory);
* ``stream``: ``jaxpaged.engine.readback.StreamReader`` (``EngineConfig(token_readback="stream")``): a
  device-to-host copy on a CUDA stream of its own that waits for the computation on the GPU (DLPack
  export with that stream), then a stream synchronise; unsupported without CUDA;
* ``ready_only``: ``block_until_ready()`` alone: the device finished, nothing copied (the floor the
  others are compared with).

The GPU work is the same for every method, so the differences between their medians are the
readback's own costs. ``--work-ms 0`` times the readback of an idle device.

    python benchmarks/bench_readback.py --out $OUT [--work-ms 1] [--reps 200]
    python benchmarks/bench_readback.py --reps 20 --work-ms 0     # CPU: the methods run, times are the CPU's
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged.engine.readback import StreamReader  # noqa: E402

METHODS = ("ready_only", "async_asarray", "asarray", "block_asarray", "device_get", "pinned_host", "stream")


def make_step(size: int, depth: int, rows: int, out_sharding=None):
    """A jitted ``(x [size, size]) -> i32[rows]``: ``depth`` dependent products of ``x``, then a row argmax."""

    def step(x):
        y = x
        for _ in range(depth):
            y = jnp.tanh(y @ x)
        return jnp.argmax(y[:rows], axis=-1).astype(jnp.int32)

    return jax.jit(step, out_shardings=out_sharding)


def calibrate_depth(x, rows: int, work_ms: float) -> int:
    """The chain length whose GPU time is about ``work_ms`` (0: no product at all)."""
    if work_ms <= 0:
        return 0
    fn = make_step(x.shape[0], 8, rows)
    fn(x).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        fn(x).block_until_ready()
    per_product = (time.perf_counter() - t0) / 5 / 8
    return max(1, round(work_ms * 1e-3 / per_product))


def time_method(method: str, fn, x, reps: int, reader=None) -> list[float]:
    """Host seconds from the call to the values on the host, ``reps`` times (after 3 untimed runs)."""
    walls = []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        out = fn(x)
        if method == "ready_only":
            out.block_until_ready()
        elif method == "async_asarray":
            out.copy_to_host_async()
            np.asarray(out)
        elif method in ("asarray", "pinned_host"):
            np.asarray(out)
        elif method == "block_asarray":
            out.block_until_ready()
            np.asarray(out)
        elif method == "device_get":
            jax.device_get(out)
        elif method == "stream":
            reader(out)
        else:
            raise ValueError(method)
        if i >= 3:
            walls.append(time.perf_counter() - t0)
    return walls


def pinned_host_sharding():
    """A single-device sharding of ``pinned_host`` memory, or None where the device has none."""
    dev = jax.devices()[0]
    try:
        kinds = {m.kind for m in dev.addressable_memories()}
    except Exception:  # noqa: BLE001  (older clients: no memory spaces)
        return None
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-ms", type=float, default=1.0, help="GPU work per call (about; 0 = none)")
    ap.add_argument("--size", type=int, default=2048, help="matrix size of the work (float32)")
    ap.add_argument("--rows", type=int, default=256, help="int32 results per call (the step's token rows)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    x = jax.random.normal(jax.random.key(0), (args.size, args.size), jnp.float32) / np.sqrt(args.size)
    depth = calibrate_depth(x, args.rows, args.work_ms)
    plain = make_step(args.size, depth, args.rows)
    want = np.asarray(plain(x))
    result = dict(device=str(jax.devices()[0]), jax=jax.__version__, work_ms=args.work_ms, depth=depth,
                  rows=args.rows, reps=args.reps, methods={})
    for method in args.methods.split(","):
        fn = plain
        if method == "pinned_host":
            sharding = pinned_host_sharding()
            if sharding is None:
                result["methods"][method] = "unsupported (no pinned_host memory on this device)"
                continue
            try:
                fn = make_step(args.size, depth, args.rows, sharding)
                np.testing.assert_array_equal(np.asarray(fn(x)), want)
            except Exception as err:  # noqa: BLE001  (reported, not fatal: the other methods still run)
                result["methods"][method] = f"unsupported ({type(err).__name__}: {str(err)[:120]})"
                continue
        reader = None
        if method == "stream":
            try:
                reader = StreamReader(jax.devices()[0], args.rows)
                np.testing.assert_array_equal(reader(fn(x)), want)
            except Exception as err:  # noqa: BLE001  (no CUDA: reported, the others still run)
                result["methods"][method] = f"unsupported ({type(err).__name__}: {str(err)[:120]})"
                continue
        walls = time_method(method, fn, x, args.reps, reader)
        result["methods"][method] = dict(median_us=statistics.median(walls) * 1e6,
                                         p10_us=float(np.percentile(walls, 10)) * 1e6,
                                         p90_us=float(np.percentile(walls, 90)) * 1e6)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "readback.json"), "w") as f:
            json.dump(result, f, indent=1)
    floor = result["methods"].get("ready_only")
    print(f"\nreadback of int32[{args.rows}] after ~{args.work_ms} ms of work ({depth} products), "
          f"{result['device']}, jax {jax.__version__}, {args.reps} reps")
    print(f"{'method':14s} {'median us':>10s} {'p10 us':>8s} {'p90 us':>8s} {'over ready_only':>16s}")
    for method, r in result["methods"].items():
        if isinstance(r, str):
            print(f"{method:14s} {r}")
            continue
        extra = f"{r['median_us'] - floor['median_us']:16.1f}" if isinstance(floor, dict) else ""
        print(f"{method:14s} {r['median_us']:10.1f} {r['p10_us']:8.1f} {r['p90_us']:8.1f} {extra}")
    return result


if __name__ == "__main__":
    main()
