"""The decode-step matmuls at 1-16 rows: XLA's dot vs the split-K Pallas GEMV (``kernels/gemv.py``).

For each projection of a model (qkv, o, gate_up, down, LM head) and ``M`` rows: ``L`` distinct weights
(enough bytes that the 50 MB L2 cannot hold them, like the layers of a step) are multiplied one after
the other inside one jit, each product consumed by an elementwise add (as the residual add or the next
fusion consumes it in the model). Times are GPU kernel times from a ``jax.profiler`` trace (the
matmul kernels only: XLA's GEMM fusions, the GEMV), per matmul, against the weight-read floor at the
HBM read ceiling measured in the same call (XLA ``sum`` over 4 GiB). Host dispatch is not in them: a
jit call of 28 tiny matmuls is launch-bound on the host, an engine step is not (it is one CUDA graph).
``--sweep`` times a grid of launch configurations at ``M = 1`` (each configuration's kernel has its
own name, so one trace per shape times them all) and prints the best next to :func:`gemv_config`'s
choice. Every GEMV result is checked against an fp32 product.

    python benchmarks/bench_gemv.py --out $OUT [--sweep] [--models qwen3-0.6b,qwen3-8b]
    python benchmarks/bench_gemv.py --out $OUT --layouts --rows 64,128,256,512   # cuBLAS, [K,N] vs [N,K]
    python benchmarks/bench_gemv.py --smoke          # tiny shapes, interpret mode (CPU)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_attention import hbm_read_ceiling  # noqa: E402
from jaxpaged.kernels.gemv import ROWS, GemvConfig, gemv, gemv_config, supported  # noqa: E402
from jaxpaged.models.qwen import rms_norm  # noqa: E402
from jaxpaged.workloads import QWEN2_5_7B, QWEN3_0_6B, QWEN3_8B  # noqa: E402
from profile_step import trace_kernels  # noqa: E402

MODELS = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-8b": QWEN3_8B, "qwen2.5-7b": QWEN2_5_7B}
MATMUL_KERNELS = ("gemm", "dot", "cublas", "cutlass", "triton", "matmul", "gemv", "sm90", "xmma")


def model_shapes(raw: dict) -> list[tuple[str, int, int, bool]]:
    """``(name, K, N, transpose_w)`` of each matmul of a decode step."""
    h, i, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    d = raw.get("head_dim", h // raw["num_attention_heads"])
    q, kv = raw["num_attention_heads"] * d, raw["num_key_value_heads"] * d
    return [("qkv", h, q + 2 * kv, False), ("o", q, h, False), ("gate_up", h, 2 * i, False),
            ("down", i, h, False), ("lm_head", h, v, raw.get("tie_word_embeddings", False))]


def make_weights(k, n, transpose, count, seed):
    keys = jax.random.split(jax.random.key(seed), count)
    shape = (n, k) if transpose else (k, n)
    return [jax.random.normal(kk, shape, jnp.bfloat16) * 0.02 for kk in keys]


def chain(op, compiler_options=None):
    """``op`` applied to every weight in turn, each with its own input (``xs``: one per weight; with one
    shared input XLA merged the dots into a single wider GEMM, so a per-matmul time was a fraction of
    one merged kernel: session 12), each product + ``r`` (a consumer, as in the model)."""
    def run(xs, r, *ws):
        return [(op(x, w) + r).astype(x.dtype) for x, w in zip(xs, ws)]
    return jax.jit(run, compiler_options=compiler_options)


def inputs(m: int, k: int, count: int) -> list[jax.Array]:
    """``count`` distinct bf16 inputs ``[m, k]`` (one per weight of a chain)."""
    return [jax.random.normal(jax.random.key(m * 1000 + i), (m, k), jnp.bfloat16) for i in range(count)]


CUBLAS = {"xla_gpu_enable_triton_gemm": False}  # the engine's option for 33-512-token steps (runner.CUBLAS_OPTIONS)


def layout_row(model, name, k, n, m, weights, floor_us, reps) -> dict:
    """``--layouts``: XLA's dot through cuBLAS (as the engine's decode-sized steps run it) with the
    weight stored ``[K, N]`` (the engine's layout) and ``[N, K]`` (contracting the last axis of both
    operands): which cuBLAS kernel the layout gets and how long it takes, per matmul."""
    xs = inputs(m, k, len(weights))
    r = jnp.zeros((m, n), jnp.bfloat16)
    row = dict(model=model, name=name, K=k, N=n, M=m, weights=len(weights), floor_us=floor_us)
    if jax.default_backend() != "gpu":
        return row
    kn = chain(lambda x, w: jnp.matmul(x, w), CUBLAS)
    nk = chain(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))), CUBLAS)
    transposed = [w.T.copy() for w in weights]
    row["kn_us"] = kernel_times({"kn": (kn, None)}, xs, r, weights, reps, names := {})["kn"]
    row["nk_us"] = kernel_times({"nk": (nk, None)}, xs, r, transposed, reps, names)["nk"]
    row["kernels"] = names
    y_kn, y_nk = kn(xs[:1], r, weights[0])[0], nk(xs[:1], r, transposed[0])[0]
    row["max_abs_diff"] = float(jnp.max(jnp.abs(y_kn.astype(jnp.float32) - y_nk.astype(jnp.float32))))
    return row


def kernel_times(cases: dict, xs, r, weights, reps: int, names: dict | None = None) -> dict:
    """GPU kernel microseconds per matmul for each ``label -> (jitted chain, kernel-name prefix or None)``
    from one profiler trace (``None``: every matmul-like kernel that is not a GEMV, i.e. XLA's).
    ``names``: if given, gets ``label -> {kernel name: us per call}`` for the ``None`` cases."""
    for fn, _ in cases.values():
        jax.block_until_ready(fn(xs, r, *weights))

    def calls():
        for fn, _ in cases.values():
            for _ in range(reps):
                jax.block_until_ready(fn(xs, r, *weights))

    kernels = trace_kernels(calls, "bench_gemv_")
    out = {}
    for label, (_, prefix) in cases.items():
        if prefix is None:
            mine = [k for k in kernels if not k["name"].startswith("gemv")
                    and any(t in k["name"].lower() for t in MATMUL_KERNELS)]
            us = sum(k["us_per_step"] for k in mine)
            if names is not None:
                names[label] = {k["name"]: round(k["us_per_call"], 2) for k in mine}
        else:
            us = sum(k["us_per_step"] for k in kernels if k["name"].startswith(prefix))
        out[label] = us / (reps * len(weights)) if us else None
    return out


def check(x, w, transpose, cfg, interpret):
    y = gemv(x, w, transpose_w=transpose, config=cfg, interpret=interpret).astype(jnp.float32)
    ref = jnp.matmul(x.astype(jnp.float32), (w.T if transpose else w).astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return float(jnp.max(jnp.abs(y - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))


def kernel_prefix(cfg: GemvConfig) -> str:
    return f"gemv_n{cfg.block_n}_k{cfg.block_k}_s{cfg.splits}_w{cfg.num_warps}_p{cfg.num_stages}"


def sweep_configs(k, n, transpose):
    for bn, bk, s, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8),
                                                      (4,), (3,)):
        if k % (s * bk) == 0 and k // s >= 2 * bk and (s == 1 or not transpose):
            yield GemvConfig(block_n=bn, block_k=bk, splits=s, num_warps=warps, num_stages=stages)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--prologue", action="store_true",
                    help="also XLA's dot with an RMSNorm producing x (the model's shape of it): matmul kernels only")
    ap.add_argument("--layouts", action="store_true",
                    help="for rows above the GEMV's 32: cuBLAS with the weight [K, N] vs [N, K] (o/down's tile question)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    results = dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=[], sweeps=[], layouts=[])
    ceiling = hbm_read_ceiling(args.smoke)
    results["read_ceiling_Bps"] = ceiling
    print(f"HBM read ceiling (XLA sum, 4 GiB): {ceiling / 1e12:.2f} TB/s", flush=True)
    if args.smoke:
        shapes = {"smoke": [("a", 256, 96, False), ("b", 512, 64, True)]}
        rows = [1, 3] + ([64] if args.layouts else [])
    else:
        shapes = {m: model_shapes(MODELS[m]) for m in args.models.split(",")}
        rows = [int(r) for r in args.rows.split(",")]
    for model, mshapes in shapes.items():
        for name, k, n, transpose in mshapes:
            wbytes = 2 * k * n
            count = 2 if args.smoke else max(2, min(28, math.ceil(400e6 / wbytes)))
            weights = make_weights(k, n, transpose, count, seed=k * 7 + n)
            floor_us = wbytes / ceiling * 1e6
            xla = chain(lambda x, w, t=transpose: jnp.matmul(x, w.T if t else w))
            default = gemv_config(k, n, transpose)
            for m in rows:
                xs = inputs(m, k, count)
                x = xs[0]
                r = jnp.zeros((m, n), jnp.bfloat16)
                if args.layouts and m > ROWS and not transpose:
                    row = layout_row(model, name, k, n, m, weights, floor_us, args.reps)
                    results["layouts"].append(row)
                    print(json.dumps(row), flush=True)
                    continue
                row = dict(model=model, name=name, K=k, N=n, transpose=transpose, M=m, weights=count,
                           floor_us=floor_us, config=default.__dict__)
                if not supported(x, weights[0], transpose, default):
                    row["gemv"] = "unsupported"
                    results["rows"].append(row)
                    continue
                row["rel_err"] = check(x, weights[0], transpose, default, interpret)
                if not interpret:
                    cases = {"xla": (xla, None),
                             "gemv": (chain(lambda x, w: gemv(x, w, transpose_w=transpose)), kernel_prefix(default))}
                    if args.prologue and not transpose:  # as in the model: an RMSNorm produces x
                        g = jnp.ones((k,), jnp.bfloat16)
                        cases["xla_norm"] = (chain(lambda x, w: jnp.matmul(rms_norm(x, g, 1e-6), w)), None)
                    if args.sweep and m == rows[0]:
                        for cfg in sweep_configs(k, n, transpose):
                            if cfg != default:
                                cases[kernel_prefix(cfg)] = (
                                    chain(lambda x, w, c=cfg: gemv(x, w, transpose_w=transpose, config=c)),
                                    kernel_prefix(cfg))
                    try:
                        times = kernel_times(cases, xs, r, weights, args.reps)
                    except Exception as e:  # e.g. a configuration Triton rejects: time without the sweep
                        print(f"  sweep failed ({type(e).__name__}: {str(e)[:150]}); default only", flush=True)
                        times = kernel_times({c: cases[c] for c in ("xla", "gemv")}, xs, r, weights, args.reps)
                    row["xla_us"], row["gemv_us"] = times.pop("xla"), times.pop("gemv")
                    if "xla_norm" in times:
                        row["xla_norm_us"] = times.pop("xla_norm")
                    swept = {c: t for c, t in times.items() if t}
                    if swept:
                        best = min(swept, key=swept.get)
                        row["best_sweep"], row["best_sweep_us"] = best, swept[best]
                        results["sweeps"].append(dict(model=model, name=name, M=m, times_us=swept))
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            del weights
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_gemv.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'model':11s} {'matmul':8s} {'M':>3s} {'floor us':>9s} {'xla us':>8s} {'gemv us':>8s} "
          f"{'gemv/xla':>8s} {'floor/gemv':>10s} {'rel err':>8s}  best of sweep")
    for r in results["rows"]:
        xu, gu = r.get("xla_us"), r.get("gemv_us")
        ratio = f"{gu / xu:8.2f}" if xu and gu else f"{'-':>8s}"
        eff = f"{r['floor_us'] / gu:10.2f}" if gu else f"{'-':>10s}"
        best = f"  {r['best_sweep']} {r['best_sweep_us']:.2f} us" if r.get("best_sweep") else ""
        if r.get("xla_norm_us"):
            best += f"  xla with norm prologue {r['xla_norm_us']:.2f} us"
        print(f"{r['model']:11s} {r['name']:8s} {r['M']:3d} {r['floor_us']:9.2f} "
              f"{(f'{xu:8.2f}' if xu else '       -')} {(f'{gu:8.2f}' if gu else '       -')} {ratio} {eff} "
              f"{r.get('rel_err', float('nan')):8.1e}{best}")
    if results["layouts"]:
        print(f"\n{'model':11s} {'matmul':8s} {'M':>4s} {'floor us':>9s} {'[K,N] us':>9s} {'[N,K] us':>9s}  (cuBLAS)")
        for r in results["layouts"]:
            kn, nk = r.get("kn_us"), r.get("nk_us")
            print(f"{r['model']:11s} {r['name']:8s} {r['M']:4d} {r['floor_us']:9.2f} "
                  f"{(f'{kn:9.2f}' if kn else '        -')} {(f'{nk:9.2f}' if nk else '        -')}")
    return results


if __name__ == "__main__":
    main()
