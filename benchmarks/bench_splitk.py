"""A decode-sized step's o_proj / down GEMM plus its residual add and RMSNorm: cuBLAS (as the engine's
33-512-token steps run them) vs the split-K Pallas GEMM (``kernels.matmul.matmul_partials``) whose
partials the add + RMSNorm kernel sums (as the engine's GEMV partials are summed).

Why: in the batch-256 step on the H200, cuBLAS ran o_proj and down at 7.2 us a call (56 calls, 0.40 ms
of a 4.3 ms step) against a ~1-1.5 us weight-read floor. A chain of ``L`` layers, each with its own
input and weight (distinct operands, so XLA cannot merge the dots into one GEMM, as it did in
``bench_gemv.py --layouts``), times per layer the GPU kernels of ``r += x_l @ w_l; rms_norm(r)``: the
GEMM(s) and the add/norm, from one ``jax.profiler`` trace per way. Every split-K result is checked
against the cuBLAS way's (fp32 sums of bf16 products: they differ in the last bits only).

Measured on the H200 (session 12): cuBLAS 7.96 us a layer at M = 256 (o_proj), the best split-K
configuration 8.98; down 9.41 vs 10.76. An engine option that ran o_proj, down and gate_up this way
(commit 4c77edd) cost the batch-256 step 0.6 ms and nano-vllm's workload 3% (24,121-24,248 vs 24,950
tok/s): it was removed, the kernel and this benchmark kept for the next attempt (docs/DECISIONS.md).

    python benchmarks/bench_splitk.py --out $OUT [--rows 64,128,256,512]
    python benchmarks/bench_splitk.py --smoke        # tiny shapes, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged.kernels import add_rms_norm  # noqa: E402
from jaxpaged.kernels.matmul import MatmulConfig, matmul_partials, splitk_config  # noqa: E402
from jaxpaged.models.qwen import DEFAULT_OPS, xla_matmul_unfused_input  # noqa: E402
from profile_step import trace_kernels  # noqa: E402

CUBLAS = {"xla_gpu_enable_triton_gemm": False}  # the engine's option for 33-512-token steps


def chain(gemm, interpret: bool, options=None):
    """``r += gemm(x_l, w_l)`` then add + RMSNorm per layer; returns every normed output and ``r``."""
    def run(r, norm_w, xs, ws):
        outs = []
        for x, w in zip(xs, ws):
            parts = gemm(x, w)
            if parts.shape[0] == 1:
                normed, r = add_rms_norm.add_rms_norm_ops(parts, r, norm_w, 1e-6, DEFAULT_OPS.rms_norm)
            else:
                normed, r = add_rms_norm.add_rms_norm(parts, r, norm_w, 1e-6, interpret=interpret)
            outs.append(normed)
        return outs, r
    return jax.jit(run, compiler_options=options)


def ways(m: int, k: int, n: int, interpret: bool) -> dict:
    """label -> the GEMM of that way (``x, w -> parts [P, M, N]``)."""
    out = {"cublas": lambda x, w: xla_matmul_unfused_input(x, w)[None]}
    base = splitk_config(m, k, n)
    configs = [base] if interpret else [base] + [
        (MatmulConfig(block_m=bm, block_n=bn, block_k=64, num_warps=4, num_stages=3), s)
        for bm, bn, s in ((64, 128, 2), (64, 128, 4), (64, 128, 8), (128, 128, 4), (128, 128, 8), (64, 64, 4))]
    for cfg, s in dict.fromkeys(configs):
        label = f"splitk m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} s{s}" + (" (default)" if (cfg, s) == base else "")
        out[label] = (lambda cfg, s: lambda x, w: matmul_partials(x, w, splits=s, config=cfg, interpret=interpret))(cfg, s)
    return out


def time_way(fn, args, reps: int, layers: int) -> tuple[float | None, dict]:
    """GPU kernel us per layer (all kernels of the chain) and ``{kernel name: us per layer}``."""
    jax.block_until_ready(fn(*args))
    if jax.default_backend() != "gpu":
        return None, {}
    kernels = trace_kernels(lambda: [jax.block_until_ready(fn(*args)) for _ in range(reps)], "bench_splitk_")
    per = reps * layers
    return sum(k["us_per_step"] for k in kernels) / per, {k["name"]: round(k["us_per_step"] / per, 2) for k in kernels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,128,256,512")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    interpret = args.smoke or jax.default_backend() != "gpu"
    hidden, shapes = (64, [("o", 128), ("down", 192)]) if args.smoke else (1024, [("o", 2048), ("down", 3072)])
    rows = [40] if args.smoke else [int(r) for r in args.rows.split(",")]
    layers = 2 if args.smoke else args.layers
    results, bad = [], 0
    for name, k in shapes:
        for m in rows:
            keys = jax.random.split(jax.random.key(m * 7 + k), 2 * layers + 2)
            xs = [jax.random.normal(keys[i], (m, k), jnp.bfloat16) for i in range(layers)]
            ws = [jax.random.normal(keys[layers + i], (k, hidden), jnp.bfloat16) * 0.02 for i in range(layers)]
            r = jax.random.normal(keys[-1], (m, hidden), jnp.bfloat16)
            norm_w = jnp.ones((hidden,), jnp.bfloat16)
            want = None
            for label, gemm in ways(m, k, hidden, interpret).items():
                fn = chain(gemm, interpret, None if interpret or label != "cublas" else CUBLAS)
                outs, r_out = fn(r, norm_w, xs, ws)
                got = np.asarray(r_out, np.float32)
                err = 0.0 if want is None else float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
                want = got if want is None else want
                us, kern = time_way(fn, (r, norm_w, xs, ws), args.reps, layers)
                ok = err < 2e-2
                bad += not ok
                row = dict(matmul=name, M=m, K=k, N=hidden, way=label, us_per_layer=us, rel_err=err, ok=ok, kernels=kern)
                results.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'matmul':7s} {'M':>4s} {'way':34s} {'us/layer':>9s} {'rel err':>9s}")
    for row in results:
        us = "-" if row["us_per_layer"] is None else f"{row['us_per_layer']:.2f}"
        print(f"{row['matmul']:7s} {row['M']:4d} {row['way']:34s} {us:>9s} {row['rel_err']:9.1e}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_splitk.json"), "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, results=results), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
