"""Would stacking the weights per kind (``[L, K, N]`` arrays indexed by layer) cost copies on the GPU?

Why: a jitted step's launch costs the host ~0.5 us per array argument and more through the PJRT C API
(``bench_dispatch.py``: 226 weight arrays 103-300 us a call, 16 arrays 40 us; RESULTS.md, session 5),
and the launch is on every first token's critical path. Stacking the 8 per-layer weight kinds of a
Qwen3 model into one array each would pass ~10 arrays instead of 226 -- if XLA reads each layer's
slice in place. A custom call (cuBLAS) needs its operands as whole buffers, so XLA may copy every
slice it feeds one, every step: 1.2 GB a step for Qwen3-0.6B, far more than the launch saves.

This builds a decoder-like chain of matmuls over ``L`` layers of Qwen3-0.6B-shaped weights (qkv, o,
gate_up, down; bf16) twice -- weights as ``4L`` arrays, and stacked as 4 ``[L, K, N]`` arrays indexed
with static layer numbers -- and reports, per row count ``M``: weight slices materialised in the
compiled program (``slice_copies``: values of a per-layer weight's shape at the top level of the
stacked program, i.e. outside any fusion), the host time per call and the device time per call.

    python benchmarks/check_stacked_weights.py [--rows 1,256] [--layers 28] [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

QWEN3_0_6B = dict(hidden=1024, qkv=4096, q=2048, inter=3072)
TINY = dict(hidden=64, qkv=256, q=128, inter=96)


def weight_shapes(d: dict) -> dict[str, tuple[int, int]]:
    return dict(qkv=(d["hidden"], d["qkv"]), o=(d["q"], d["hidden"]), gate_up=(d["hidden"], 2 * d["inter"]),
                down=(d["inter"], d["hidden"]))


def chain(x: jax.Array, layer_weights, num_layers: int, d: dict) -> jax.Array:
    """``layer_weights(i) -> (qkv, o, gate_up, down)``; a decoder-like chain (no attention, no norms)."""
    h = x
    for i in range(num_layers):
        qkv, o, gate_up, down = layer_weights(i)
        t = (h @ qkv)[:, : d["q"]]
        h = h + t @ o
        u = h @ gate_up
        h = h + (jax.nn.silu(u[:, : d["inter"]]) * u[:, d["inter"]:]) @ down
    return h


def top_level_slices(hlo: str, shapes: list[tuple[int, int]], dtype: str = "bf16") -> int:
    """Instructions of the entry computation (outside fusions) whose value has a per-layer weight's
    shape: in the stacked program each is a slice of a stacked weight made into its own buffer."""
    lines = hlo.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY"))
    count = 0
    for ln in lines[start + 1:]:
        if ln.startswith("}"):
            break
        if "parameter(" in ln:
            continue
        for k, n in shapes:
            if re.search(rf"= {dtype}\[{k},{n}\]", ln):
                count += 1
    return count


def measure(fn, args, calls: int) -> tuple[float, float]:
    """(host us per call while launching back to back, device us per call: wall of ``calls`` calls
    waited for, divided)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    walls = []
    for _ in range(5):
        s = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - s)
    return (t1 - t0) / calls * 1e6, min((t2 - t0) / calls, statistics.median(walls)) * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,256")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU tests)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    d = TINY if args.tiny else QWEN3_0_6B
    shapes = weight_shapes(d)
    rng = np.random.default_rng(0)
    stacked = {k: jnp.asarray(rng.standard_normal((args.layers, *s), np.float32) * 0.02, jnp.bfloat16)
               for k, s in shapes.items()}
    separate = [stacked[k][i] for i in range(args.layers) for k in shapes]  # 4L arrays of their own

    n = args.layers
    f_sep = jax.jit(lambda x, ws: chain(x, lambda i: tuple(ws[4 * i: 4 * i + 4]), n, d))
    f_stk = jax.jit(lambda x, ws: chain(x, lambda i: tuple(ws[k][i] for k in shapes), n, d))
    rows = []
    for m in [int(r) for r in args.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((m, d["hidden"]), np.float32), jnp.bfloat16)
        hlo = f_stk.lower(x, stacked).compile().as_text()
        row = dict(rows=m, layers=args.layers, slice_copies=top_level_slices(hlo, list(shapes.values())))
        for name, fn, ws in (("separate", f_sep, separate), ("stacked", f_stk, stacked)):
            host, device = measure(fn, (x, ws), args.calls)
            row[f"{name}_host_us"], row[f"{name}_device_us"] = host, device
        diff = np.abs(np.asarray(f_sep(x, separate), np.float32) - np.asarray(f_stk(x, stacked), np.float32))
        row["max_abs_diff"] = float(diff.max())
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stacked_weights.json"), "w") as f:
        json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, shapes=shapes, rows=rows), f, indent=1)
    print(f"{jax.devices()[0]}, jax {jax.__version__}, {args.layers} layers, {'tiny' if args.tiny else 'Qwen3-0.6B'} shapes")
    print(f"{'rows':>5s} {'slice copies':>12s} {'host us sep/stk':>16s} {'device us sep/stk':>18s} {'max diff':>9s}")
    for r in rows:
        print(f"{r['rows']:5d} {r['slice_copies']:12d} {r['separate_host_us']:7.1f}/{r['stacked_host_us']:<8.1f} "
              f"{r['separate_device_us']:8.1f}/{r['stacked_device_us']:<9.1f} {r['max_abs_diff']:9.2g}")
    return rows


if __name__ == "__main__":
    main()
