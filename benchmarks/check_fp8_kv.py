"""The fp8 KV cache against bf16: the compiled kernels' agreement with the jnp reference, decode attention
time and bandwidth, and how far the model's logits move.

  kernels   the Pallas attention kernels (``--backends``: Triton, Mosaic GPU) over an fp8 pool vs the
            reference (fp32 dequantisation), and the fused qkv epilogue's fp8 writes vs the XLA path's
            (must be bitwise equal), compiled
  attention decode attention at ``--shapes`` (default batch 256 x context 1,024; one layer of
            Qwen3-0.6B's heads), each backend: bf16 (block size 16) vs fp8 pool (64, its default; and
            16 on Triton), microseconds and bytes read per second against the HBM read ceiling
            measured in the same process (an XLA sum over 4 GiB; --hbm-tbps off the GPU)
  logits    a model's logits for every position of ``--prompts`` random prompts of ``--prompt-len`` tokens,
            computed over an fp8 pool and over a bf16 pool (the K/V of each chunk written, then read):
            max and mean absolute difference, top-1 agreement. Random weights are not a trained model:
            its activations, and so what fp8 rounding does to them, differ from a real checkpoint's.

    python benchmarks/check_fp8_kv.py --out $OUT                  # GPU, Qwen3-0.6B shapes
    python benchmarks/check_fp8_kv.py --tiny --out /tmp/x         # CPU: tiny checkpoints, interpret mode
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its helper modules)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged.config import FP8_DTYPES  # noqa: E402
from jaxpaged.kernels.fp8 import quantize  # noqa: E402
from jaxpaged.kernels.kv_write import write_kv  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention  # noqa: E402
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference  # noqa: E402
from jaxpaged.models.attention_backends import get_attention_fn  # noqa: E402
from jaxpaged.models.ops import get_model_ops  # noqa: E402
from paged_forward import build_chunk_step, forward_all_logits  # noqa: E402
from jaxpaged.models.kv_pool import init_kv_pool, pool_shape  # noqa: E402

SECTIONS = ("kernels", "attention", "logits")


def interpret() -> bool:
    return jax.default_backend() != "gpu"


def random_fp8_case(rng, num_seqs, ctx, bs, hq, hkv, d, fp8):
    """A decode batch over a pool filled through ``write_kv`` (the engine's write): ``(args_fp8, args_bf16)``."""
    blocks_per_seq = -(-ctx // bs)
    num_blocks = num_seqs * blocks_per_seq + 3
    tables = rng.permutation(num_blocks)[: num_seqs * blocks_per_seq].reshape(num_seqs, blocks_per_seq).astype(np.int32)
    slots = (tables[:, :, None] * bs + np.arange(bs)).reshape(num_seqs, -1)[:, :ctx].reshape(-1).astype(np.int32)
    k = jnp.asarray(rng.standard_normal((slots.size, hkv, d)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((slots.size, hkv, d)), jnp.bfloat16)
    pools = {}
    for dtype in (fp8, jnp.bfloat16):
        pool = jnp.zeros(pool_shape(1, num_blocks, bs, hkv, d, dtype), dtype)
        pools[dtype] = jax.jit(write_kv, static_argnums=1)(pool, 0, k, v, jnp.asarray(slots))
    q = jnp.asarray(rng.standard_normal((num_seqs, hq, d)), jnp.bfloat16)
    meta = (jnp.arange(num_seqs + 1, dtype=jnp.int32), jnp.full(num_seqs, ctx, jnp.int32), jnp.asarray(tables))
    return (q, pools[fp8], 0, *meta), (q, pools[jnp.bfloat16], 0, *meta)


def attention_fn(backend: str):
    """The Pallas attention kernel of ``backend`` ("triton" or "mosaic"), compiled or interpreted."""
    if backend == "mosaic":
        from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu

        return lambda *a: paged_attention_mgpu(*a, interpret=interpret())
    return lambda *a: paged_attention(*a, interpret=interpret())


def check_kernels(fp8, backends) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    cases = {"decode": (64, 300, 64), "decode_block16": (64, 300, 16), "long": (8, 1500, 64)}
    for name, (s, ctx, bs) in cases.items():
        args, _ = random_fp8_case(rng, s, ctx, bs, 16, 8, 128, fp8)
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(paged_attention_reference(*args), np.float32)
        for backend in backends:
            if backend == "mosaic" and bs < 64:  # Mosaic reads an fp8 pool one block (>= 64 slots) a tile
                continue
            got = np.asarray(attention_fn(backend)(*args), np.float32)
            key = name if backend == "triton" else f"{backend}_{name}"
            out[f"attention_{key}_rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            out[f"attention_{key}_finite"] = bool(np.all(np.isfinite(got)))
    from jaxpaged.kernels.qkv_epilogue import qkv_epilogue
    from jaxpaged.models.qwen import ModelOps, qkv_epilogue_ops, rope_cos_sin, rotary
    import functools

    t, hq, hkv, d, bs = 37, 16, 8, 128, 16
    qkv = jnp.asarray(rng.standard_normal((t, (hq + 2 * hkv) * d)) * 3, jnp.bfloat16)
    qn = kn = jnp.ones((d,), jnp.bfloat16)
    positions = jnp.asarray(rng.integers(0, 4000, t), jnp.int32)
    slots = jnp.asarray(rng.permutation(8 * bs)[:t], jnp.int32)
    pool = jnp.zeros(pool_shape(2, 8, bs, hkv, d, fp8), fp8)
    ops = ModelOps(rotary=functools.partial(rotary, separate_products=True))
    _, want = qkv_epilogue_ops(qkv, None, qn, kn, positions, pool, 1, slots, eps=1e-6, theta=1e6, ops=ops,
                               write_kv_fn=write_kv)
    cos, sin = rope_cos_sin(positions, d, 1e6, jnp.bfloat16)
    _, got = qkv_epilogue(qkv[None], None, qn, kn, cos, sin, pool, 1, slots, eps=1e-6, dtype=jnp.bfloat16,
                          interpret=interpret())
    out["qkv_epilogue_bitwise_equal"] = bool(np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)))
    return out


def check_attention(fp8, hbm_tbps: float, tiny: bool, backends, shapes) -> dict:
    """Decode attention per shape ``(batch, context)`` and backend; keys ``{batch}x{ctx}`` then
    ``{backend}_{pool}`` (pool: ``bf16`` at block size 16, ``fp8`` at 64, ``fp8_block16``)."""
    from bench_attention import chain_time, hbm_read_ceiling

    if not interpret():
        hbm_tbps = hbm_read_ceiling(False) / 1e12
    rng = np.random.default_rng(1)
    res = {"ceiling_tbps": hbm_tbps}
    for s, ctx in ([(8, 64)] if tiny else shapes):
        fp8_64, _ = random_fp8_case(rng, s, ctx, 64, 16, 8, 128, fp8)
        fp8_16, bf16_16 = random_fp8_case(rng, s, ctx, 16, 16, 8, 128, fp8)
        shape = res[f"{s}x{ctx}"] = {}
        # each pool dtype at its engine default block size (bf16 16, fp8 64), and fp8 at block size 16
        for backend in backends:
            fn = attention_fn(backend)
            for name, args, bs in (("fp8", fp8_64, 64), ("bf16", bf16_16, 16), ("fp8_block16", fp8_16, 16)):
                if backend == "mosaic" and name == "fp8_block16":
                    continue
                q, pool, layer, cu, kl, tables = args
                call = lambda qq, p, tb: fn(qq, p, 0, cu, kl, tb)  # noqa: E731
                _, t = chain_time(call, q, pool, [tables], reps=5 if tiny else 50, chain=1 if tiny else 8)
                kv_bytes = s * ctx * 2 * 8 * 128 * jnp.dtype(pool.dtype).itemsize * ((bs + 1) / bs if "fp8" in name else 1)
                shape[f"{backend}_{name}"] = dict(block_size=bs, us=t * 1e6, kv_bytes=kv_bytes,
                                                  tbps=kv_bytes / t / 1e12, of_ceiling=kv_bytes / t / 1e12 / hbm_tbps)
        base = shape["triton_bf16"]["us"] if "triton" in backends else None
        for backend in backends:
            shape[f"{backend}_fp8_over_own_bf16_time"] = shape[f"{backend}_fp8"]["us"] / shape[f"{backend}_bf16"]["us"]
            if base:
                shape[f"{backend}_fp8_over_triton_bf16_time"] = shape[f"{backend}_fp8"]["us"] / base
    return res


def check_logits(fp8, tiny: bool, prompts: int, prompt_len: int, only: list[str] | None = None) -> dict:
    from jaxpaged.models.checkpoint import load_params
    from jaxpaged.models.tiny import tiny_checkpoint_path
    from jaxpaged.workloads import QWEN2_5_7B, QWEN3_0_6B, random_model

    models = {"tiny-qwen2": None, "tiny-qwen3": None} if tiny else {"qwen3-0.6b": QWEN3_0_6B, "qwen2.5-7b": QWEN2_5_7B}
    models = {k: v for k, v in models.items() if not only or k in only}
    backend = "triton" if not interpret() else "reference"
    out = {}
    for name, raw in models.items():
        params = (load_params(tiny_checkpoint_path(name.split("-")[1]), "bfloat16", use_cache=False) if raw is None
                  else random_model(raw))
        cfg = params.config
        attn, ops = get_attention_fn(backend), get_model_ops(False)
        rng = np.random.default_rng(2)
        bs, chunk = 16, 256 if not tiny else 32
        stats = dict(max_abs=0.0, sum_abs=0.0, count=0, agree=0, positions=0)
        for _ in range(prompts):
            seq = [int(t) for t in rng.integers(1, cfg.vocab_size, prompt_len)]
            table = list(range(-(-prompt_len // bs)))
            logits = {}
            for dtype in (fp8, jnp.bfloat16):
                pool = init_kv_pool(cfg, len(table) + 1, bs, dtype)
                rows = []
                for start in range(0, prompt_len, chunk):
                    piece = seq[start:start + chunk]
                    inp = build_chunk_step([(piece, start, table)], bs, width=len(table))
                    lg, pool = forward_all_logits(params.graphdef, params.state, pool, inp.token_ids, inp.positions,
                                                  inp.meta, attn, write_kv, ops)
                    rows.append(lg[: len(piece)])
                logits[dtype] = jnp.concatenate(rows)
            a, b = logits[fp8], logits[jnp.bfloat16]
            diff = jnp.abs(a - b)
            stats["max_abs"] = max(stats["max_abs"], float(diff.max()))
            stats["sum_abs"] += float(diff.mean()) * prompt_len
            stats["count"] += prompt_len
            stats["agree"] += int(jnp.sum(jnp.argmax(a, -1) == jnp.argmax(b, -1)))
            stats["positions"] += prompt_len
            stats["logit_std"] = float(jnp.std(b))
        out[name] = dict(max_abs_diff=stats["max_abs"], mean_abs_diff=stats["sum_abs"] / stats["count"],
                         top1_agreement=stats["agree"] / stats["positions"], positions=stats["positions"],
                         bf16_logit_std=stats["logit_std"])
        del params
    return out


def print_attention_table(res: dict, backends) -> None:
    print(f"decode attention, us (% of the {res['ceiling_tbps']:.2f} TB/s read ceiling)")
    for shape, rows in res.items():
        if isinstance(rows, dict):
            cells = [f"{k} {v['us']:.1f} ({100 * v['of_ceiling']:.0f}%)" for k, v in rows.items() if isinstance(v, dict)]
            ratios = [f"{k} {v:.3f}" for k, v in rows.items() if not isinstance(v, dict)]
            print(f"  {shape}: " + "; ".join(cells) + " | " + "; ".join(ratios), flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU mode: tiny checkpoints, small shapes, interpret mode")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=sorted(FP8_DTYPES))
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="off the GPU: the HBM ceiling to report against")
    ap.add_argument("--backends", nargs="+", choices=("triton", "mosaic"), default=["triton", "mosaic"],
                    help="the attention kernels to check and time (mosaic: Hopper, or its interpreter)")
    ap.add_argument("--shapes", nargs="+", default=["256x1024"], help="attention: batch x context")
    ap.add_argument("--prompts", type=int, default=None, help="logits: prompts (5; tiny 2)")
    ap.add_argument("--prompt-len", type=int, default=None, help="logits: tokens each (2048; tiny 64)")
    ap.add_argument("--models", nargs="*", default=None, help="logits: only these (qwen3-0.6b qwen2.5-7b)")
    args = ap.parse_args(argv)
    fp8 = jnp.dtype(FP8_DTYPES[args.kv_cache_dtype])
    report = {"kv_cache_dtype": args.kv_cache_dtype, "device": jax.devices()[0].device_kind}
    t0 = time.perf_counter()
    if "kernels" in args.sections:
        report["kernels"] = check_kernels(fp8, args.backends)
        print("kernels", report["kernels"], flush=True)
    if "attention" in args.sections:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
        report["attention"] = check_attention(fp8, args.hbm_tbps, args.tiny, args.backends, shapes)
        print("attention", json.dumps(report["attention"], indent=1), flush=True)
        print_attention_table(report["attention"], args.backends)
    if "logits" in args.sections:
        report["logits"] = check_logits(fp8, args.tiny, args.prompts or (2 if args.tiny else 5),
                                        args.prompt_len or (64 if args.tiny else 2048), args.models)
        print("logits", report["logits"], flush=True)
    report["seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_fp8_kv.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
