"""The Mosaic GPU paged attention kernel on a GPU: does it lower, is it right, how fast is decode.

One process, three steps, each of which reports its own failure and lets the others run (a kernel that
does not lower for the GPU prints the error and the script goes on):

  1. correctness: ragged decode/prefill batches (bf16, every unused pool slot NaN, blocks in random
     order, block sizes 16-64, GQA/MQA; and fp8 pools of block size 64, e4m3 and e5m2, stale slots' values
     and scales NaN), launches whose block tables are as wide as a 4,096-token engine's (split-K chosen
     from that width: most splits empty), and a pool over 4 GiB read at its last layer and highest blocks;
     max abs and relative error of the Mosaic kernel and of the Triton kernel against the reference.
     A float32 pool is expected to be refused on the GPU (ValueError), checked in ``--tiny`` mode.
  2. decode timing: batch 256 x context 1,024, Hq 16, Hkv 8, D 128, bf16, block sizes 16 and 64, both
     kernels, with ``bench_attention.chain_time`` (calls chained through their outputs) against the
     HBM read ceiling (``bench_attention.hbm_read_ceiling``); on the GPU also a few Mosaic tuning
     variants (``num_slots`` 3/4, ``block_kv`` 128; ``--no-sweep`` skips them).
  3. a short table, and ``check_attention_mgpu.json`` under ``--out``.

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \
        PYTHONUNBUFFERED=1 python3 benchmarks/check_attention_mgpu.py --out $OUT
    python benchmarks/check_attention_mgpu.py --tiny   # interpret mode, small shapes, on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_attention import (chain_simple, chain_time, hbm_read_ceiling, make_case, prefill_flops,  # noqa: E402
                             reference_hi, rel_err, timed)
from jaxpaged.kernels.fp8 import is_fp8, quantize_pool  # noqa: E402
from jaxpaged.kernels.kv_write import pool_from_caches  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention  # noqa: E402
from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu  # noqa: E402
from jaxpaged.kernels.mosaic.common import kv_tile  # noqa: E402
from jaxpaged.kernels.mosaic.layout import choose_splits  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
RESULTS: dict = {"correctness": [], "decode": [], "decode_sweep": [], "prefill": [], "errors": []}
HQ, HKV, D = 16, 8, 128


def log(*a):
    print(*a, flush=True)


def failure(where: str, e: BaseException) -> str:
    """Logs an exception (the head of a long Mosaic GPU lowering error included) and records it."""
    msg = f"{type(e).__name__}: {str(e)[:3000]}"
    log(f"{where} FAILED {msg}")
    log(traceback.format_exc()[-1500:])
    RESULTS["errors"].append(dict(where=where, error=msg))
    return msg


def kernels(interpret: bool, sweep: bool = False, uniform_decode: bool = False):
    """name -> callable(q, pool, layer, cu, kv_lens, tables); ``sweep`` adds Mosaic tuning variants;
    ``uniform_decode``: a launch of at most one token a sequence, told to Mosaic as an engine tells it."""
    fns = {
        "mosaic": lambda *a: paged_attention_mgpu(*a, interpret=interpret, uniform_decode=uniform_decode),
        "triton": lambda *a: paged_attention(*a, interpret=interpret),
    }
    if sweep:
        for kw in (dict(num_slots=3), dict(num_slots=4), dict(block_kv=128), dict(block_kv=128, num_slots=3)):
            name = "mosaic_" + ",".join(f"{k}={v}" for k, v in kw.items())
            fns[name] = lambda *a, kw=kw: paged_attention_mgpu(*a, interpret=interpret, uniform_decode=uniform_decode,
                                                               **kw)
    return fns


def compare(name: str, args, interpret: bool, dtype_name: str, uniform_decode: bool = False):
    ref = np.asarray(reference_hi(*args), np.float32)
    rec, outs = dict(case=name, dtype=dtype_name), {}
    for kname, fn in kernels(interpret, uniform_decode=uniform_decode).items():
        try:
            t0 = time.perf_counter()
            out = np.asarray(jax.block_until_ready(fn(*args)), np.float32)
            finite = bool(np.all(np.isfinite(out)))
            rec[kname] = dict(max_abs_err=float(np.max(np.abs(out - ref))) if finite else float("nan"),
                              rel_err=rel_err(out, ref), finite=finite, first_call_s=time.perf_counter() - t0)
            outs[kname] = out
        except ValueError as e:
            if kname == "mosaic" and dtype_name == "float32" and not interpret:  # refused by design
                rec[kname] = dict(refused=str(e)[:200])
                log(f"{name} mosaic refused float32 as expected: {str(e)[:120]}")
            else:
                rec[kname] = dict(error=failure(f"{name} {kname}", e))
        except Exception as e:  # noqa: BLE001 (report and go on)
            rec[kname] = dict(error=failure(f"{name} {kname}", e))
    if len(outs) == 2:
        rec["mosaic_vs_triton_max_abs"] = float(np.max(np.abs(outs["mosaic"] - outs["triton"])))
    tol = 1e-5 if dtype_name == "float32" else 2e-2
    m = rec.get("mosaic", {})
    rec["mosaic_ok"] = "refused" in m or bool(
        m.get("finite") and m.get("rel_err", 1.0) <= tol / 4 and m.get("max_abs_err", 1.0) <= tol * 4)
    RESULTS["correctness"].append(rec)
    log("check", rec)


def correctness(rng, tiny: bool, interpret: bool):
    if tiny:
        cases = [  # (q_lens, kv_lens, bs, hq, hkv, d, dtype)
            ([1, 1, 1, 1, 1], [1, 15, 16, 17, 200], 16, 4, 2, 128, jnp.bfloat16),
            ([1, 37, 0, 5], [1, 50, 9, 80], 16, 4, 2, 64, jnp.bfloat16),
            ([1, 1, 9], [64, 65, 130], 64, 8, 1, 64, jnp.float32),
            ([1, 5, 1], [63, 70, 130], 64, 4, 2, 128, jnp.float8_e4m3fn),
            ([1, 1], [5, 40], 16, 4, 2, 64, jnp.bfloat16, 1024),  # wide tables: split, most splits empty
        ]
    else:
        cases = [
            ([1] * 7, [1, 15, 16, 17, 64, 300, 1000], 16, HQ, HKV, D, jnp.bfloat16),
            ([1, 37, 0, 5, 1, 130], [1, 50, 9, 300, 1000, 200], 16, HQ, HKV, D, jnp.bfloat16),
            ([1, 1, 1, 200, 1], [63, 64, 65, 700, 1000], 64, 32, 4, 64, jnp.bfloat16),  # G=8, D=64
            ([3, 1, 1], [9, 8, 2000], 32, 8, 1, 128, jnp.bfloat16),  # MQA
            ([300, 1, 129, 70], [1000, 40, 129, 70], 16, HQ, HKV, D, jnp.bfloat16),  # prefill tile pairs, a prefix hit
            ([1] * 40, list(rng.integers(1, 2000, 40)), 16, HQ, HKV, D, jnp.bfloat16),
            ([1, 1], [17, 100], 16, 4, 2, 64, jnp.float32),  # expected: refused on the GPU
            ([1] * 7, [1, 63, 64, 65, 300, 1000, 2000], 64, HQ, HKV, D, jnp.float8_e4m3fn),  # fp8: split-K decode
            ([1, 37, 0, 5, 1, 130], [1, 50, 9, 300, 1000, 200], 64, HQ, HKV, D, jnp.float8_e4m3fn),  # prefix hits
            ([1, 1, 200, 1], [63, 700, 1000, 129], 64, 8, 1, 64, jnp.float8_e5m2),  # MQA, D=64
            # a prompt chunk after a long cached prefix in a decode-shaped launch (T <= 2 S: a many-slot
            # engine's step), G 2 and G 7, the chunk's last tokens at the end of q
            ([100, 1, 1, 1] + [0] * 60, [2100, 300, 40, 1000] + [0] * 60, 16, HQ, HKV, D, jnp.bfloat16),
            ([1, 1, 61] + [0] * 29, [500, 70, 3000] + [0] * 29, 16, 28, 4, 128, jnp.bfloat16),
            ([40] + [1] * 31, [140] + [300] * 31, 16, 8, 8, 64, jnp.bfloat16),  # G 1: tiles of 32 tokens
            # over fp8 the same (the query tiles, split; persistent programs taking several items each),
            # and a lone 32-token chunk after 4,096 cached tokens padded to 32 sequences (one tile, split
            # many ways)
            ([100, 1, 1, 1] + [0] * 60, [2100, 300, 40, 1000] + [0] * 60, 64, HQ, HKV, D, jnp.float8_e4m3fn),
            ([32] + [0] * 31, [4128] + [0] * 31, 64, HQ, HKV, D, jnp.float8_e4m3fn),
            # block tables as wide as a 4,096-token engine's (split-K is chosen from the width): most
            # splits empty. A lone 32-token prompt without a prefix padded to 32 sequences, batch-1
            # decode at 40 tokens, and 8 decode rows of unequal contexts; bf16 and fp8
            ([32] + [0] * 31, [32] + [0] * 31, 16, HQ, HKV, D, jnp.bfloat16, 4096),
            ([32] + [0] * 31, [32] + [0] * 31, 64, HQ, HKV, D, jnp.float8_e4m3fn, 4096),
            ([1], [40], 16, HQ, HKV, D, jnp.bfloat16, 4096),
            ([1], [40], 64, HQ, HKV, D, jnp.float8_e4m3fn, 4096),
            ([1] * 8, [5, 40, 64, 65, 300, 1000, 2000, 4000], 16, 28, 4, D, jnp.bfloat16, 4096),  # G 7
        ]
    for q_lens, kv_lens, bs, hq, hkv, d, dtype, *width in cases:
        name = ((f"w{width[0]} " if width else "")  # (first: the summary shows a name's first 50 characters)
                + f"q{str(q_lens)[:24]} kv{str(list(map(int, kv_lens)))[:30]} bs{bs} hq{hq} hkv{hkv} d{d}")
        table_width = -(-width[0] // bs) if width else None
        try:
            num_blocks = max(len(q_lens) * max(math.ceil(k / bs) for k in kv_lens), table_width or 0) + 8
            case = dict(num_blocks=num_blocks, table_width=table_width)
            if is_fp8(dtype):  # bf16 queries over the fp8 pool of the same random K/V (stale slots stay NaN)
                q, pool, *meta = make_case(rng, q_lens, kv_lens, bs, hq, hkv, d, jnp.float32, **case)
                args = (q.astype(jnp.bfloat16), jax.jit(quantize_pool, static_argnums=1)(pool, dtype), *meta)
            else:
                args = make_case(rng, q_lens, kv_lens, bs, hq, hkv, d, dtype, **case)
            compare(name, args, interpret, jnp.dtype(dtype).name, uniform_decode=max(q_lens) <= 1)
        except Exception as e:  # noqa: BLE001
            failure(f"case {name}", e)
    if not tiny:
        try:
            big_pool(interpret)
        except Exception as e:  # noqa: BLE001
            failure("big pool", e)


def big_pool(interpret: bool):
    """A many-layer pool over 4 GiB (64-bit addresses, large TMA coordinates) read at its last layer
    from its highest blocks, every other slot NaN."""
    layers, num_blocks, bs = 8, 9216, 16  # 8 x 9,216 x 64 KiB = 4.5 GiB
    q_lens, kv_lens = [1, 1, 7], [40, 300, 130]
    widths = [math.ceil(k / bs) for k in kv_lens]
    ids = np.arange(num_blocks - 1, num_blocks - 1 - sum(widths), -1, dtype=np.int32)
    tables = np.zeros((len(q_lens), max(widths)), np.int32)
    start = 0
    for i, w in enumerate(widths):
        tables[i, :w] = ids[start:start + w]
        start += w
    pool = jnp.full((layers, num_blocks, bs, 2, HKV, D), jnp.nan, jnp.bfloat16)
    pool = pool.at[layers - 1, jnp.asarray(ids)].set(
        jax.random.normal(jax.random.key(11), (len(ids), bs, 2, HKV, D), jnp.bfloat16))
    q = jax.random.normal(jax.random.key(12), (sum(q_lens) + 3, HQ, D), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    args = (q, pool, layers - 1, cu, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables))
    compare(f"big pool {pool.nbytes / 2**30:.1f} GiB, last layer", args, interpret, "bfloat16")


def decode_timing(args, ceiling: float, interpret: bool):
    b, ctx = (4, 128) if args.tiny else (256, 1024)
    hq, hkv, d = (4, 2, 64) if args.tiny else (HQ, HKV, D)
    for bs in (16, 64):
        nb = ctx // bs
        kv_bytes = b * ctx * hkv * d * 2 * 2
        rot = max(1, min(args.chain, math.ceil(256e6 / kv_bytes)))
        pool_blocks = rot * b * nb + 16
        kk, kv_, kq = jax.random.split(jax.random.key(bs), 3)
        pool = pool_from_caches(jax.random.normal(kk, (pool_blocks, bs, hkv, d), jnp.bfloat16),
                                jax.random.normal(kv_, (pool_blocks, bs, hkv, d), jnp.bfloat16))
        perm = np.random.default_rng(bs).permutation(pool_blocks)
        tables = [jnp.asarray(perm[r * b * nb:(r + 1) * b * nb].reshape(b, nb).astype(np.int32)) for r in range(rot)]
        q = jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
        cu = jnp.arange(b + 1, dtype=jnp.int32)
        kv_lens = jnp.full((b,), ctx, jnp.int32)
        ref = reference_hi(q, pool, 0, cu, kv_lens, tables[0])
        row = dict(batch=b, ctx=ctx, block_size=bs, hq=hq, hkv=hkv, d=d, kv_MB=kv_bytes / 1e6, rotations=rot)
        for name, fn in kernels(interpret, sweep=not args.tiny and not args.no_sweep, uniform_decode=True).items():
            try:
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn(q, pool, 0, cu, kv_lens, tables[0]))
                first = time.perf_counter() - t0
                err = rel_err(out, ref)
                compile_s, t = chain_time(lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb),
                                          q, (pool, cu, kv_lens), tables, args.reps, args.chain)
                row[name] = dict(time_us=t * 1e6, TBps=kv_bytes / t / 1e12, frac_ceiling=kv_bytes / t / ceiling,
                                 first_call_s=first, chain_compile_s=compile_s, rel_err=err)
                log(f"decode B={b} ctx={ctx} bs={bs} {name}", {k: round(v, 4) for k, v in row[name].items()})
            except Exception as e:  # noqa: BLE001
                row[name] = dict(error=failure(f"decode bs={bs} {name}", e))
        RESULTS["decode"].append(row)
        del pool


def decode_sweep(args, ceiling: float, interpret: bool):
    """Decode, block size 16 (the engine's default), batch x context over ``--batches`` x ``--ctxs``, both
    kernels on one pool sized for the largest shape (block tables rotated over it as in
    ``decode_timing``); the error is Mosaic's against the Triton kernel's output."""
    batches = [2] if args.tiny else [int(x) for x in args.batches.split(",")]
    ctxs = [64] if args.tiny else [int(x) for x in args.ctxs.split(",")]
    hq, hkv, d, bs = (4, 2, 64, 16) if args.tiny else (HQ, HKV, D, 16)
    # The pool is sized for the largest shape that fits: a launch over it needs about its size again
    # on the device (256 x 32k tokens, 32 GiB, needs an allocator limit above ~70 GiB).
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0) if not interpret else 0
    kv_token = hkv * d * 2 * 2
    fits = [(b, c) for b in batches for c in ctxs if not limit or 2.2 * b * c * kv_token < limit]
    for b, c in sorted(set((b, c) for b in batches for c in ctxs) - set(fits)):
        log(f"decode sweep {b}x{c} skipped: {b * c * kv_token / 2**30:.1f} GiB of KV, twice that over the "
            f"device's {limit / 2**30:.0f} GiB")
    need = max(b * c for b, c in fits) // bs
    pool_blocks = need + 1024
    pool = jax.random.normal(jax.random.key(7), (1, pool_blocks, bs, 2, hkv, d), jnp.bfloat16)
    log(f"decode sweep pool {pool.nbytes / 2**30:.1f} GiB")
    fns = kernels(interpret, uniform_decode=True)
    for b in batches:
        for ctx in ctxs:
            if (b, ctx) not in fits:
                continue
            nb = ctx // bs
            kv_bytes = b * ctx * kv_token
            rot = max(1, min(args.chain, pool_blocks // (b * nb), math.ceil(256e6 / kv_bytes)))
            perm = np.random.default_rng(b * 31 + ctx).permutation(pool_blocks)
            tables = [jnp.asarray(perm[r * b * nb:(r + 1) * b * nb].reshape(b, nb).astype(np.int32))
                      for r in range(rot)]
            q = jax.random.normal(jax.random.key(b + ctx), (b, hq, d), jnp.bfloat16)
            cu = jnp.arange(b + 1, dtype=jnp.int32)
            kv_lens = jnp.full((b,), ctx, jnp.int32)
            row, outs = dict(batch=b, ctx=ctx, kv_MB=kv_bytes / 1e6), {}
            row["mosaic_splits"] = choose_splits(b, b, hkv, kv_tile(bs), tables[0].shape[1] * bs, decode=True)
            for name, fn in fns.items():
                try:
                    outs[name] = jax.block_until_ready(fn(q, pool, 0, cu, kv_lens, tables[0]))
                    _, t = chain_time(lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb),
                                      q, (pool, cu, kv_lens), tables, args.reps, args.chain)
                    row[name] = dict(time_us=t * 1e6, TBps=kv_bytes / t / 1e12, frac_ceiling=kv_bytes / t / ceiling)
                except Exception as e:  # noqa: BLE001
                    row[name] = dict(error=failure(f"decode sweep {b}x{ctx} {name}", e))
            if len(outs) == 2:
                row["mosaic_vs_triton_rel"] = rel_err(outs["mosaic"], outs["triton"])
            log(f"decode sweep B={b} ctx={ctx}", row)
            RESULTS["decode_sweep"].append(row)
    del pool


def prefill_timing(args, interpret: bool):
    """One sequence's prefill (``--prefill`` new+prefix tokens), block size 16: Mosaic, Triton, and
    without a prefix cuDNN's flash attention (``jax.nn.dot_product_attention``) on the same tokens laid
    out contiguously. Errors against the Triton kernel's output. With ``--prefill-kv`` an fp8 dtype, the
    pool is that fp8 pool (block size 64, the engine's default for fp8), and ``mosaic_bf16`` times the
    Mosaic kernel over the bf16 pool it was quantised from (what the same prefill costs over bf16), and
    ``mosaic_1wg`` the one-warpgroup kernel's prefill tiles over the fp8 pool."""
    shapes = [(64, 0), (64, 32)] if args.tiny else [tuple(int(y) for y in x.split("+")) for x in args.prefill.split(",")]
    fp8 = args.prefill_kv != "bfloat16"
    hq, hkv, d, bs = (4, 2, 64, 16) if args.tiny else (HQ, HKV, D, 16)
    if fp8:
        bs = 64
    for q_len, prefix in shapes:
        kv_len = q_len + prefix
        nb = math.ceil(kv_len / bs)
        num_blocks = nb + 64
        kq, kp = jax.random.split(jax.random.key(q_len * 3 + prefix))
        pool = jax.random.normal(kp, (1, num_blocks, bs, 2, hkv, d), jnp.bfloat16)
        fns = kernels(interpret)
        if fp8:  # the fp8 pool timed as "mosaic" and "triton"; the bf16 pool by the Mosaic kernel
            pool_bf16, pool = pool, jax.jit(quantize_pool, static_argnums=1)(pool, jnp.dtype(args.prefill_kv))
            fns["mosaic_bf16"] = lambda qq, _pool, *a: paged_attention_mgpu(qq, pool_bf16, *a, interpret=interpret)
            # the one-warpgroup kernel's prefill tiles (what fp8 prefill launches ran before the prefill kernel)
            fns["mosaic_1wg"] = lambda *a: paged_attention_mgpu(*a, interpret=interpret, block_q=64 // (hq // hkv))
        table = jnp.asarray(np.random.default_rng(q_len).permutation(num_blocks)[:nb].reshape(1, nb).astype(np.int32))
        q = jax.random.normal(kq, (q_len, hq, d), jnp.bfloat16)
        cu = jnp.array([0, q_len], jnp.int32)
        kv_lens = jnp.array([kv_len], jnp.int32)
        flops = prefill_flops(q_len, prefix) * hq * d // (HQ * D)
        row, outs = dict(q_len=q_len, prefix=prefix, GFLOP=flops / 1e9), {}
        for name, fn in fns.items():
            try:
                outs[name] = jax.block_until_ready(fn(q, pool, 0, cu, kv_lens, table))
                _, t = chain_time(lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb),
                                  q, (pool, cu, kv_lens), [table], args.reps, args.chain)
                row[name] = dict(time_us=t * 1e6, TFLOPs=flops / t / 1e12)
            except Exception as e:  # noqa: BLE001
                row[name] = dict(error=failure(f"prefill {q_len}+{prefix} {name}", e))
        if "mosaic" in outs and "triton" in outs:
            row["mosaic_vs_triton_rel"] = rel_err(outs["mosaic"], outs["triton"])
        if prefix == 0 and not interpret and not fp8:
            pos = jnp.arange(kv_len)
            blk = table[0, pos // bs]
            kc, vc = pool[0, blk, pos % bs, 0][None], pool[0, blk, pos % bs, 1][None]  # [1, T, Hkv, D]
            try:
                fn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
                _, t = timed(lambda qq, kc, vc: chain_simple(fn, qq, kc, vc, args.chain), (q[None], kc, vc), args.reps)
                t /= args.chain
                row["cudnn"] = dict(time_us=t * 1e6, TFLOPs=flops / t / 1e12)
            except Exception as e:  # noqa: BLE001
                row["cudnn"] = dict(error=failure(f"prefill {q_len} cudnn", e))
        log(f"prefill {q_len}+{prefix}", row)
        RESULTS["prefill"].append(row)
        del pool


def print_table(ceiling: float):
    log(f"\n=== Mosaic GPU vs Triton paged attention, {RESULTS['device']} (jax {RESULTS['jax']}); "
        f"HBM read ceiling {ceiling / 1e12:.2f} TB/s ===")
    log("correctness (vs reference)                          | mosaic max abs / rel | triton max abs / rel")
    for r in RESULTS["correctness"]:
        cols = []
        for k in ("mosaic", "triton"):
            x = r.get(k, {})
            cols.append(f"{x['max_abs_err']:.2e} / {x['rel_err']:.1e}" if "max_abs_err" in x else
                        "refused (expected)" if "refused" in x else "FAILED")
        log(f"{r['case'][:50]:<50} {r['dtype'][:4]} | {cols[0]:>20} | {cols[1]:>20}")
    log("decode B x ctx, bs     | mosaic us | TB/s | %ceil || triton us | TB/s | %ceil || mosaic/triton")
    for r in RESULTS["decode"]:
        m, t = r.get("mosaic", {}), r.get("triton", {})
        ms = f"{m['time_us']:9.1f} | {m['TBps']:4.2f} | {100 * m['frac_ceiling']:4.0f}%" if "time_us" in m else \
            f"{'FAILED':>9} |      |      "
        ts = f"{t['time_us']:9.1f} | {t['TBps']:4.2f} | {100 * t['frac_ceiling']:4.0f}%" if "time_us" in t else \
            f"{'FAILED':>9} |      |      "
        ratio = f"{m['time_us'] / t['time_us']:.2f}" if "time_us" in m and "time_us" in t else "n/a"
        log(f"{r['batch']:>3} x {r['ctx']:>4}, bs {r['block_size']:>2} | {ms} || {ts} || {ratio}")
        for k, x in r.items():
            if k.startswith("mosaic_"):
                log(f"    {k:<36} " + (f"{x['time_us']:9.1f} us | {x['TBps']:4.2f} TB/s | err {x['rel_err']:.1e}"
                                       if "time_us" in x else "FAILED"))
    if RESULTS["decode_sweep"]:
        log("decode sweep, bs 16: B x ctx | mosaic us | %ceil || triton us | %ceil || mosaic/triton")
    for r in RESULTS["decode_sweep"]:
        m, t = r.get("mosaic", {}), r.get("triton", {})
        if "time_us" in m and "time_us" in t:
            log(f"{r['batch']:>3} x {r['ctx']:>5} | {m['time_us']:9.1f} | {100 * m['frac_ceiling']:4.0f}% || "
                f"{t['time_us']:9.1f} | {100 * t['frac_ceiling']:4.0f}% || {m['time_us'] / t['time_us']:.2f}")
        else:
            log(f"{r['batch']:>3} x {r['ctx']:>5} | FAILED")
    if RESULTS["prefill"]:
        log("prefill new+prefix | mosaic us | TFLOP/s || triton us | TFLOP/s || cudnn us | mosaic/cudnn | mosaic/triton")
    for r in RESULTS["prefill"]:
        m, t, c = r.get("mosaic", {}), r.get("triton", {}), r.get("cudnn", {})
        f = lambda x: f"{x['time_us']:9.1f} | {x['TFLOPs']:6.1f}" if "time_us" in x else f"{'n/a':>9} |    n/a"
        mc = f"{m['time_us'] / c['time_us']:.2f}" if "time_us" in m and "time_us" in c else "n/a"
        mt = f"{m['time_us'] / t['time_us']:.2f}" if "time_us" in m and "time_us" in t else "n/a"
        cs = f"{c['time_us']:9.1f}" if "time_us" in c else f"{'n/a':>9}"
        b16 = r.get("mosaic_bf16", {})  # (--prefill-kv fp8: the Mosaic kernel over the bf16 pool)
        bs = f" || mosaic over bf16 {b16['time_us']:9.1f} us, fp8/bf16 {m['time_us'] / b16['time_us']:.2f}" \
            if "time_us" in b16 and "time_us" in m else ""
        one = r.get("mosaic_1wg", {})
        bs += f" || one-warpgroup {one['time_us']:9.1f} us, mosaic/one-warpgroup {m['time_us'] / one['time_us']:.2f}" \
            if "time_us" in one and "time_us" in m else ""
        log(f"{r['q_len']:>6}+{r['prefix']:<6} | {f(m)} || {f(t)} || {cs} | {mc} | {mt}{bs}")
    log(f"errors: {len(RESULTS['errors'])}")


def flush_json(args):
    if args.out:
        with open(os.path.join(args.out, "check_attention_mgpu.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--tiny", action="store_true", help="small shapes in interpret mode (a CPU)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--only", default="", help="comma list of: check,decode,sweep,prefill")
    ap.add_argument("--batches", default="1,8,64,256", help="decode sweep batch sizes")
    ap.add_argument("--ctxs", default="256,1024,4096,32768", help="decode sweep context lengths")
    ap.add_argument("--prefill", default="1024+0,2048+0,4096+0,8192+0,16384+0,2048+2048,8192+8192",
                    help="prefill shapes, new+prefix tokens")
    ap.add_argument("--no-sweep", action="store_true", help="time only the default Mosaic configuration")
    ap.add_argument("--prefill-kv", default="bfloat16", choices=("bfloat16", "float8_e4m3fn", "float8_e5m2"),
                    help="the prefill timings' pool dtype (fp8: block size 64, and the bf16 pool timed beside it)")
    args = ap.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    interpret = args.tiny or jax.default_backend() != "gpu"
    if args.tiny:
        args.reps, args.chain = 2, 2
    only = set(args.only.split(",")) if args.only else {"check", "decode", "sweep", "prefill"}
    RESULTS.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__, interpret=interpret)
    t0 = time.perf_counter()
    ceiling = hbm_read_ceiling(args.tiny)
    RESULTS["hbm_read_ceiling_TBps"] = ceiling / 1e12
    log(f"HBM read ceiling {ceiling / 1e12:.3f} TB/s; interpret={interpret}")
    rng = np.random.default_rng(0)
    for name, step in (("check", lambda: correctness(rng, args.tiny, interpret)),
                       ("decode", lambda: decode_timing(args, ceiling, interpret)),
                       ("sweep", lambda: decode_sweep(args, ceiling, interpret)),
                       ("prefill", lambda: prefill_timing(args, interpret))):
        if name not in only:
            continue
        try:
            step()
        except Exception as e:  # noqa: BLE001
            failure(f"step {name}", e)
        log(f"[{time.perf_counter() - t0:.0f}s] {name} done")
        flush_json(args)
    print_table(ceiling)
    flush_json(args)
    return RESULTS


if __name__ == "__main__":
    main()
