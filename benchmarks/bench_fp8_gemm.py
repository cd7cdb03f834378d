"""fp8 weights' products against bf16's, per weight matrix of a decode step and per batch size.

For each weight of the model (``floor.gemm_shapes``: qkv, o_proj, gate_up, down) and each row count
``M`` (``--rows``), ``--layers`` copies of the matrix are multiplied in one jitted function (separate
arrays, as a step's layers are), and the median time per product is reported beside the floor of reading the weight once at the
read bandwidth measured in this process (``floor.measure_device``):

* ``bf16``: the bf16 weight by the engine's ops (the Pallas GEMV at <= 32 rows, else XLA's GEMM);
* ``fp8_xla``: the e4m3 weight converted to bf16 and multiplied by XLA (``quantization.fp8_matmul``: what
  the engine runs for fp8 weights).

A GEMV reading the e4m3 tiles itself and W8A8 on fp8 tensor cores were measured here and deleted
(docs/DECISIONS.md, "fp8 weights").

    python benchmarks/bench_fp8_gemm.py --model qwen2.5-7b --out $OUT     # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.floor import gemm_shapes, measure_device  # noqa: E402
from jaxpaged.models.ops import gemv_or_xla_matmul  # noqa: E402
from jaxpaged.models.quantization import Fp8Weight, fp8_matmul, quantize_per_channel  # noqa: E402
from jaxpaged.models.qwen import xla_matmul_unfused_input  # noqa: E402
from jaxpaged.workloads import EXPERIMENT_MODELS  # noqa: E402


def layers_time(product, x, weights: list, repeats: int) -> float:
    """Median seconds per product of ``product(x, w)`` for each of the ``weights`` (one per layer,
    separate arrays as a model's are: no slicing of a stacked array), every output folded into one sum
    so no product is dropped."""

    def run(x, weights):
        acc = jnp.zeros((x.shape[0], 1), jnp.float32)
        for w in weights:
            acc = acc + product(x, w)[:, :1].astype(jnp.float32)
        return acc

    fn = jax.jit(run)
    jax.block_until_ready(fn(x, weights))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, weights))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(weights)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b", choices=[m for m in EXPERIMENT_MODELS if m != "tiny"])
    ap.add_argument("--rows", default="1,8,32,64,256")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    cfg = types.SimpleNamespace(**EXPERIMENT_MODELS[args.model])
    device = measure_device(read_bytes=2 << 30)
    print(f"{device.name}: read {device.read_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{device.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    rng = np.random.default_rng(0)
    variants = {
        "bf16": gemv_or_xla_matmul,
        "fp8_xla": lambda x, w: fp8_matmul(x, w, matmul=xla_matmul_unfused_input),
    }
    rows = []
    for name, (k, n, _) in gemm_shapes(cfg).items():
        if name == "lm_head":
            continue
        w16 = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02, jnp.bfloat16) for _ in range(args.layers)]
        w8 = [Fp8Weight(*quantize_per_channel(w), jnp.dtype(jnp.bfloat16)) for w in w16]
        for m in [int(r) for r in args.rows.split(",")]:
            x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
            row = dict(product=name, k=k, n=n, m=m)
            for variant, fn in variants.items():
                try:
                    row[variant + "_us"] = layers_time(fn, x, w16 if variant == "bf16" else w8, args.repeats) * 1e6
                except Exception as e:  # a variant that does not lower here: reported, the others still run
                    row[variant + "_us"] = None
                    print(f"  {name} M={m} {variant}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            row["floor_bf16_us"] = k * n * 2 / device.read_bytes_per_s * 1e6
            row["floor_fp8_us"] = k * n / device.read_bytes_per_s * 1e6
            rows.append(row)
            print(json.dumps({a: (round(b, 1) if isinstance(b, float) else b) for a, b in row.items()}), flush=True)
        del w16, w8
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"fp8_gemm_{args.model}.json"), "w") as f:
        json.dump(dict(device=device.name, read_tb_s=device.read_bytes_per_s / 1e12, rows=rows), f, indent=1)
    cols = list(variants)
    print(f"\n{'product':8} {'M':>4} {'floor16':>8} {'floor8':>7} " + " ".join(f"{c:>9}" for c in cols) + "   (us)")
    for r in rows:
        vals = " ".join(f"{r.get(c + '_us') or float('nan'):9.1f}" for c in cols)
        print(f"{r['product']:8} {r['m']:4d} {r['floor_bf16_us']:8.1f} {r['floor_fp8_us']:7.1f} {vals}")
    return rows


if __name__ == "__main__":
    main()
