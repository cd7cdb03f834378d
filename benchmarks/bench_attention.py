"""Paged attention on the GPU: correctness vs. the reference, then a timing table of decode and prefill shapes.

One process: HBM read ceiling (XLA sum over 4 GiB bf16), ragged correctness checks (bf16 / fp32, NaN
in every unused slot), decode B x ctx with Qwen3-0.6B heads (16 q, 8 KV, D 128, block 16) against jax's
deprecated Pallas paged kernel and the XLA gather reference, prefill with and without a cached prefix
against cuDNN flash attention on contiguous tokens, and the KV write (HLO copy check + time).

Timing: each measured function is called ``--chain`` times inside one jit, the output of each call
feeding the queries of the next (a true dependency, nothing can be hoisted), with the block tables
rotated over disjoint regions of the pool so that small problems are not served from L2; the median
over ``--reps`` runs, divided by the chain length. Compile times are reported separately.

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \
        PYTHONUNBUFFERED=1 python3 benchmarks/bench_attention.py --out $OUT
    python benchmarks/bench_attention.py --smoke   # tiny shapes, interpret mode, on CPU
    # the two targets only (about 2 minutes on the H200):
    ... bench_attention.py --only check,decode,prefill --batches 256 --ctxs 1024 --prefill 2048+0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.kv_write import pool_from_caches, write_kv
from jaxpaged.models.kv_pool import pool_shape
from jaxpaged.kernels.paged_attention import AttentionConfig, choose_config, paged_attention
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference

warnings.filterwarnings("ignore", category=DeprecationWarning)
HQ, HKV, D, BS = 16, 8, 128, 16
RESULTS: dict = {"decode": [], "prefill": [], "correctness": [], "sweeps": []}


def log(*a):
    print(*a, flush=True)


def timed(make_fn, args, reps):
    """Compiles ``make_fn`` on ``args``; returns (compile_s, median seconds a call) (:func:`time_calls`).
    Large arrays must be passed in ``args`` (a closure would embed them in the executable as constants).
    """
    fn = jax.jit(make_fn)
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t
    return compile_s, time_calls(fn, args, reps)


def time_calls(fn, args, reps):
    """Median seconds a call of the compiled ``fn(*args)``: calls dispatched back to back in groups
    of 4 and synchronised once per group, so host dispatch overlaps device work; the median over
    ``reps`` groups (after one untimed call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(4)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t) / 4)
    return float(np.median(times))


def chained(call, chain):
    """``run(q, consts, *tables)``: ``chain`` calls of ``call(q, consts, tables_i)``, each call's output
    feeding the next call's queries (no hoisting), block tables rotated."""

    def run(q, consts, *tabs):
        for i in range(chain):
            q = call(q, consts, tabs[i % len(tabs)])
        return q

    return run


def chain_time(call, q, consts, tables, reps, chain):
    """Median seconds of one ``call(q, consts, tables_i)`` (:func:`chained`, ``chain`` calls per jit)."""
    c, t = timed(chained(call, chain), (q, consts, *tables), reps)
    return c, t / chain


def time_variants(fns: dict, q, pool, cu_q_lens, kv_lens, table, reps: int = 5, chain: int = 8, where: str = "",
                  rounds: int = 1, each_round: dict | None = None, compiled: dict | None = None):
    """Each ``fns[name](q, pool, layer, cu_q_lens, kv_lens, table)`` over one batch: its output (fp32 numpy)
    and its chained time (:func:`chained`, us). Each variant is compiled once, then timed ``rounds``
    times, the variants in turn, every other round in reverse order (so drift on the machine does not
    favour the one timed first); the time is the mean over the rounds, and ``each_round[name]`` (when
    given) gets the list of them, ``compiled[name]`` the chained jit, called as ``(q, (pool, cu_q_lens,
    kv_lens), table)`` (to trace it, say). A variant that fails is reported (``where`` names the case)
    and left out. Returns ``(times_us, outputs)``, dicts by name."""
    consts = (pool, cu_q_lens, kv_lens)
    compiled = {} if compiled is None else compiled
    outs = {}
    for name, fn in fns.items():
        f = lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb)
        try:
            outs[name] = np.asarray(jax.block_until_ready(jax.jit(f)(q, consts, table)), np.float32)
            compiled[name] = jax.jit(chained(f, chain))
            jax.block_until_ready(compiled[name](q, consts, table))
        except Exception as e:  # noqa: BLE001
            print("FAILED", where, name, type(e).__name__, str(e)[:300], flush=True)
            outs.pop(name, None)
            compiled.pop(name, None)
    per = {name: [] for name in compiled}
    names = list(compiled)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            per[name].append(time_calls(compiled[name], (q, consts, table), reps) / chain * 1e6)
    if each_round is not None:
        each_round.update(per)
    return {name: float(np.mean(v)) for name, v in per.items()}, outs


def reference_hi(*args):
    """The reference with full fp32 matmuls (XLA's GPU default for fp32 dots is TF32)."""
    with jax.default_matmul_precision("highest"):
        return paged_attention_reference(*args)


def rel_err(out, ref):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def hbm_read_ceiling(smoke):
    n = (1 << 20) if smoke else (1 << 31)  # 4 GiB of bf16
    x = jax.random.normal(jax.random.key(1), (n,), jnp.bfloat16)
    c, t = timed(lambda x: jnp.sum(x, dtype=jnp.float32), (x,), 5 if smoke else 20)
    del x
    return 2 * n / t


def make_case(rng, q_lens, kv_lens, bs, hq, hkv, d, dtype, num_blocks, table_width: int | None = None):
    """Random ragged batch with randomly placed blocks; every unused slot and partial tail is NaN.
    ``table_width``: block-table columns (default: the longest sequence's blocks); an engine's tables
    are as wide as its longest context, and the kernels choose split-K from that width. Columns past a
    sequence's blocks name random blocks (NaN where no sequence uses them)."""
    s = len(q_lens)
    w = max(1, max(math.ceil(k / bs) for k in kv_lens))
    perm = rng.permutation(num_blocks)[: s * w].reshape(s, w).astype(np.int32)
    if table_width is not None and table_width > w:
        perm = np.concatenate([perm, rng.integers(0, num_blocks, (s, table_width - w), dtype=np.int32)], axis=1)
    k = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    v = rng.standard_normal((num_blocks, bs, hkv, d)).astype(np.float32)
    used = np.zeros((num_blocks, bs), bool)
    for i, kl in enumerate(kv_lens):
        p = np.arange(kl)
        used[perm[i, p // bs], p % bs] = True
    k[~used] = np.nan
    v[~used] = np.nan
    t = sum(q_lens) + 3
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (jnp.asarray(q, dtype), pool_from_caches(jnp.asarray(k, dtype), jnp.asarray(v, dtype)), 0, jnp.asarray(cu),
            jnp.asarray(np.array(kv_lens, np.int32)), jnp.asarray(perm))


def random_paged_batch(q_lens, prefixes, hq: int, hkv: int, d: int, bs: int, num_tokens: int):
    """A bf16 batch for timing (no NaN): sequences of ``q_lens`` new tokens after ``prefixes`` cached
    ones, their blocks in random order in a one-layer pool with 64 spare blocks, ``num_tokens`` query
    rows (the rest padding); seeded by the token count. Returns ``(q, pool, cu_q_lens, kv_lens, tables)``."""
    total = sum(q_lens)
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    nbs = [-(-k // bs) for k in kv_lens]
    blocks = sum(nbs) + 64
    kq, kp = jax.random.split(jax.random.key(total))
    pool = jax.random.normal(kp, (1, blocks, bs, 2, hkv, d), jnp.bfloat16)
    perm = np.random.default_rng(total).permutation(blocks)
    tables, o = np.zeros((len(q_lens), max(nbs)), np.int32), 0
    for i, n in enumerate(nbs):
        tables[i, :n] = perm[o:o + n]
        o += n
    q = jax.random.normal(kq, (num_tokens, hq, d), jnp.bfloat16)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, pool, jnp.asarray(cu), jnp.asarray(np.array(kv_lens, np.int32)), jnp.asarray(tables)


def correctness(rng, interpret):
    cases = [  # (q_lens, kv_lens, bs, hq, hkv, d, dtype)
        ([1, 1, 1, 37, 0, 5, 1], [1, 15, 16, 50, 9, 300, 1000], 16, 16, 8, 128, jnp.bfloat16),
        ([1, 1, 1, 37, 0, 5, 1], [1, 15, 16, 50, 9, 300, 1000], 16, 16, 8, 128, jnp.float32),
        ([1, 200, 1, 17], [33, 700, 64, 17], 32, 32, 4, 64, jnp.bfloat16),
        ([3, 1, 130], [9, 8, 130], 8, 8, 8, 128, jnp.float32),
        ([1] * 40, list(rng.integers(1, 2000, 40)), 16, 16, 8, 128, jnp.bfloat16),
    ]
    for q_lens, kv_lens, bs, hq, hkv, d, dtype in cases:
        num_blocks = len(q_lens) * max(math.ceil(k / bs) for k in kv_lens) + 8
        args = make_case(rng, q_lens, kv_lens, bs, hq, hkv, d, dtype, num_blocks=num_blocks)
        ref = reference_hi(*args)
        out = paged_attention(*args, interpret=interpret)
        err = rel_err(out, ref)
        tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
        rec = dict(q_lens=str(q_lens)[:40], bs=bs, hq=hq, hkv=hkv, d=d, dtype=jnp.dtype(dtype).name,
                   rel_err=err, ok=bool(err <= tol))
        RESULTS["correctness"].append(rec)
        log("check", rec)
    RESULTS["correctness"].append(big_pool_check(interpret))
    log("check", RESULTS["correctness"][-1])


def big_pool_check(interpret: bool) -> dict:
    """The engine's real situation: a many-layer pool larger than 4 GiB (so the Triton lowering uses
    64-bit addresses), read at its last layer from its highest blocks, every other slot NaN. Tiny sizes
    (a few MiB) in interpret mode."""
    layers, num_blocks = (3, 64) if interpret else (8, 9216)  # 8 x 9,216 x 64 KiB = 4.5 GiB
    hq, hkv, d = (4, 2, 64) if interpret else (HQ, HKV, D)
    shape = (layers, num_blocks, BS, 2, hkv, d)
    q_lens, kv_lens = [1, 1, 7], [40, 300, 130]
    widths = [math.ceil(k / BS) for k in kv_lens]
    top = num_blocks - sum(widths)  # the highest blocks of the pool, in reverse order
    ids = np.arange(num_blocks - 1, top - 1, -1, dtype=np.int32)
    tables = np.zeros((len(q_lens), max(widths)), np.int32)
    start = 0
    for i, w in enumerate(widths):
        tables[i, :w] = ids[start:start + w]
        start += w
    key = jax.random.key(11)
    pool = jnp.full(shape, jnp.nan, jnp.bfloat16)
    values = jax.random.normal(key, (len(ids), BS, 2, hkv, d), jnp.bfloat16)
    pool = pool.at[layers - 1, jnp.asarray(ids)].set(values)
    q = jax.random.normal(jax.random.key(12), (sum(q_lens) + 3, hq, d), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    args = (q, pool, layers - 1, cu, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables))
    err = rel_err(paged_attention(*args, interpret=interpret), reference_hi(*args))
    rec = dict(q_lens="big pool " + str(q_lens), bs=BS, hq=hq, hkv=hkv, d=d, dtype="bfloat16",
               pool_gib=pool.nbytes / 2**30, layer=layers - 1, rel_err=err, ok=bool(err <= 1e-2))
    del pool
    return rec


def decode_inputs(key, b, ctx, pool_blocks, rotations):
    """q [B, Hq, D] and `rotations` block tables over disjoint random blocks of the pool."""
    nb = ctx // BS
    perm = np.random.default_rng(b * 7919 + ctx).permutation(pool_blocks)
    tables = [jnp.asarray(perm[r * b * nb:(r + 1) * b * nb].reshape(b, nb).astype(np.int32))
              for r in range(rotations)]
    q = jax.random.normal(key, (b, HQ, D), jnp.bfloat16)
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    kv_lens = jnp.full((b,), ctx, jnp.int32)
    return q, tables, cu, kv_lens


def bench_decode(args, pool, pool_hm, ceiling, smoke, interpret):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    kv = pool  # [1, N, bs, 2, Hkv, D]
    pool_blocks = kv.shape[1]
    batches = [1, 8] if smoke else [int(x) for x in args.batches.split(",")]
    ctxs = [32, 64] if smoke else [int(x) for x in args.ctxs.split(",")]
    for b in batches:
        for ctx in ctxs:
            nb = ctx // BS
            kv_bytes = b * ctx * HKV * D * 2 * 2
            rot = max(1, min(args.chain, pool_blocks // (b * nb), math.ceil(256e6 / kv_bytes)))
            q, tables, cu, kv_lens = decode_inputs(jax.random.key(b + ctx), b, ctx, pool_blocks, rot)
            row = dict(batch=b, ctx=ctx, kv_MB=kv_bytes / 1e6, rotations=rot)
            ref = reference_hi(q, kv, 0, cu, kv_lens, tables[0])
            configs = {"default": None}
            if args.sweep and (b, ctx) in ((256, 1024), (8, 4096), (1, 4096)) and not smoke:
                d = choose_config(b, b, HQ, HKV, BS, ctx)
                for bk, nw, ns in ((32, 4, 4), (64, 4, 2), (128, 4, 2), (128, 8, 3)):
                    configs[f"k{bk}w{nw}s{ns}"] = AttentionConfig(16, bk, d.num_splits, nw, ns)
                if d.num_splits > 1:
                    configs[f"splits{d.num_splits * 2}"] = AttentionConfig(16, 64, d.num_splits * 2, 4, 3)
                    configs[f"splits{max(1, d.num_splits // 2)}"] = AttentionConfig(
                        16, 64, max(1, d.num_splits // 2), 4, 3)
                else:
                    configs["splits2"] = AttentionConfig(16, 64, 2, 4, 3)
            for name, cfg in configs.items():
                try:
                    t0 = time.perf_counter()
                    out = jax.block_until_ready(paged_attention(
                        q, kv, 0, cu, kv_lens, tables[0], config=cfg, interpret=interpret))
                    c = time.perf_counter() - t0
                    err = rel_err(out, ref)
                    _, t = chain_time(lambda qq, cs, tb, cfg=cfg: paged_attention(
                        qq, cs[0], 0, *cs[1:], tb, config=cfg, interpret=interpret),
                        q, (kv, cu, kv_lens), tables, args.reps, args.chain)
                    rec = dict(time_us=t * 1e6, TBps=kv_bytes / t / 1e12, frac=kv_bytes / t / ceiling,
                               compile_s=c, rel_err=err)
                    if name == "default":
                        row.update(ours=rec, ours_config=str(choose_config(b, b, HQ, HKV, BS, ctx)))
                    else:
                        RESULTS["sweeps"].append(dict(kind="decode", batch=b, ctx=ctx, name=name, **rec))
                    log(f"decode B={b} ctx={ctx} ours[{name}]", {k: round(v, 4) for k, v in rec.items()})
                except Exception as e:  # keep the run going; record the failure
                    log(f"decode B={b} ctx={ctx} ours[{name}] FAILED {type(e).__name__}: {str(e)[:300]}")
            # jax's deprecated kernel (head-major pool); best of a few legal configs.
            best = None
            for ppcb, ks in ((8, 16), (8, 8), (16, 4), (4, 16), (8, 1)):
                ks = min(ks, nb)
                if nb % ks or (nb // ks) % min(ppcb, nb // ks):
                    continue
                if best is not None and not (((b, ctx) == (256, 1024) and args.sweep) or smoke):
                    break
                try:
                    kw = dict(pages_per_compute_block=ppcb, k_splits=ks, interpret=interpret)
                    # It applies no softmax scale: pre-scale q for the error check (timing as is).
                    out = jax_paged.paged_attention(q * D**-0.5, *pool_hm, tables[0], kv_lens, **kw)
                    err = rel_err(out, ref)
                    c, t = chain_time(lambda qq, cs, tb, kw=kw: jax_paged.paged_attention(
                        qq, cs[0], cs[1], tb, cs[2], **kw), q, (*pool_hm, kv_lens), tables, args.reps,
                        args.chain)
                    rec = dict(time_us=t * 1e6, TBps=kv_bytes / t / 1e12, compile_s=c, rel_err=err,
                               config=f"ppcb={ppcb},k_splits={ks}")
                    log(f"decode B={b} ctx={ctx} jax_deprecated", rec)
                    if best is None or rec["time_us"] < best["time_us"]:
                        best = rec
                except Exception as e:
                    log(f"jax_deprecated ppcb={ppcb} ks={ks} FAILED {type(e).__name__}: {str(e)[:200]}")
            row["jax_deprecated"] = best
            try:
                c, t = chain_time(lambda qq, cs, tb: paged_attention_reference(qq, cs[0], 0, *cs[1:], tb), q,
                                  (kv, cu, kv_lens), tables, max(3, args.reps // 3),
                                  args.chain)
                row["xla_reference"] = dict(time_us=t * 1e6, TBps=kv_bytes / t / 1e12, compile_s=c)
            except Exception as e:
                log(f"reference FAILED {type(e).__name__}: {str(e)[:200]}")
            RESULTS["decode"].append(row)
            flush_json(args)


def prefill_flops(q_len, prefix):
    pairs = q_len * prefix + q_len * (q_len + 1) // 2
    return 4 * pairs * HQ * D


def bench_prefill(args, smoke, interpret):
    shapes = [(64, 0), (64, 48)] if smoke else [
        tuple(int(y) for y in x.split("+")) for x in args.prefill.split(",")]
    rng = np.random.default_rng(5)
    for q_len, prefix in shapes:
        kv_len = q_len + prefix
        nb = math.ceil(kv_len / BS)
        num_blocks = 2 * nb + 8
        key = jax.random.key(q_len + prefix)
        kq, kk, kv_ = jax.random.split(key, 3)
        k_cache = jax.random.normal(kk, (num_blocks, BS, HKV, D), jnp.bfloat16)
        v_cache = jax.random.normal(kv_, (num_blocks, BS, HKV, D), jnp.bfloat16)
        kv = pool_from_caches(k_cache, v_cache)
        table = jnp.asarray(rng.permutation(num_blocks)[:nb].reshape(1, nb).astype(np.int32))
        q = jax.random.normal(kq, (q_len, HQ, D), jnp.bfloat16)
        cu = jnp.array([0, q_len], jnp.int32)
        kv_lens = jnp.array([kv_len], jnp.int32)
        flops = prefill_flops(q_len, prefix)
        row = dict(q_len=q_len, prefix=prefix, GFLOP=flops / 1e9)
        # Reference in chunks of query tokens (the full gather would be T x ctx x Hkv x D x 4 B).
        chunk = min(q_len, 256)
        refs = []
        for a in range(0, q_len, chunk):
            refs.append(reference_hi(
                q[a:a + chunk], kv, 0, jnp.array([0, chunk], jnp.int32),
                jnp.array([prefix + a + chunk], jnp.int32), table))
        ref = jnp.concatenate(refs)
        configs = {"default": None}
        if args.sweep and q_len == 2048 and prefix == 0:
            for bm, bk, nw, ns in ((128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)):
                configs[f"m{bm}k{bk}w{nw}s{ns}"] = AttentionConfig(bm, bk, 1, nw, ns, True)
        for name, cfg in configs.items():
            try:
                t0 = time.perf_counter()
                out = jax.block_until_ready(paged_attention(
                    q, kv, 0, cu, kv_lens, table, config=cfg, interpret=interpret))
                c = time.perf_counter() - t0
                err = rel_err(out, ref)
                _, t = chain_time(lambda qq, cs, tb, cfg=cfg: paged_attention(
                    qq, cs[0], 0, *cs[1:], tb, config=cfg, interpret=interpret),
                    q, (kv, cu, kv_lens), [table], args.reps, args.chain)
                rec = dict(time_us=t * 1e6, TFLOPs=flops / t / 1e12, compile_s=c, rel_err=err)
                if name == "default":
                    row.update(ours=rec, ours_config=str(choose_config(q_len, 1, HQ, HKV, BS, nb * BS)))
                else:
                    RESULTS["sweeps"].append(dict(kind="prefill", q_len=q_len, prefix=prefix, name=name,
                                                  **rec))
                log(f"prefill {q_len}+{prefix} ours[{name}]", {k: round(v, 4) for k, v in rec.items()})
            except Exception as e:
                log(f"prefill {q_len}+{prefix} ours[{name}] FAILED {type(e).__name__}: {str(e)[:300]}")
        if prefix == 0 and not smoke:
            # cuDNN flash attention on the same tokens laid out contiguously.
            pos = jnp.arange(kv_len)
            kc = k_cache[table[0, pos // BS], pos % BS][None]  # [1, kv_len, Hkv, D]
            vc = v_cache[table[0, pos // BS], pos % BS][None]
            try:
                fn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True,
                                                                     implementation="cudnn")
                out = jax.jit(fn)(q[None], kc, vc)[0]
                err = rel_err(out, ref)
                c, t = timed(lambda qq, kc, vc: chain_simple(fn, qq, kc, vc, args.chain),
                             (q[None], kc, vc), args.reps)
                t /= args.chain
                row["cudnn"] = dict(time_us=t * 1e6, TFLOPs=flops / t / 1e12, compile_s=c, rel_err=err)
                log(f"prefill {q_len} cudnn", row["cudnn"])
            except Exception as e:
                log(f"cudnn FAILED {type(e).__name__}: {str(e)[:300]}")
        RESULTS["prefill"].append(row)
        flush_json(args)


def chain_simple(fn, q, kc, vc, chain):
    for _ in range(chain):
        q = fn(q, kc, vc)
    return q


def bench_kv_write(args, smoke):
    """28 layers x 256 tokens written into one donated ``[L, N, bs, 2, Hkv, D]`` pool: HLO copy check
    and time."""
    layers, tokens = (2, 8) if smoke else (28, 256)
    nblk = 64 if smoke else 4096
    pools = jnp.zeros(pool_shape(layers, nblk, BS, HKV, D), jnp.bfloat16) + 1
    k = jax.random.normal(jax.random.key(3), (tokens, HKV, D), jnp.bfloat16)
    slots = jnp.asarray(np.random.default_rng(0).permutation(nblk * BS)[:tokens].astype(np.int32))
    slots = slots.at[-1].set(-1)

    def step(pools, k, slots):
        for layer in range(layers):
            pools = write_kv(pools, layer, k, k, slots)
        return pools

    fn = jax.jit(step, donate_argnums=0)
    hlo = fn.lower(pools, k, slots).compile().as_text()
    pool_str = "bf16[" + ",".join(map(str, pools.shape)) + "]"
    copies = [ln for ln in hlo.splitlines() if pool_str in ln.split("=")[-1][:60] and " copy(" in ln]
    pools = fn(pools, k, slots)
    jax.block_until_ready(pools)
    times = []
    for _ in range(args.reps * 2):
        t = time.perf_counter()
        pools = fn(pools, k, slots)
        jax.block_until_ready(pools)
        times.append(time.perf_counter() - t)
    ok = bool(np.array_equal(np.asarray(pools[0, slots[0] // BS, slots[0] % BS, 0]), np.asarray(k[0])))
    RESULTS["kv_write"] = dict(layers=layers, tokens=tokens, pool_copies_in_hlo=len(copies),
                               time_ms=float(np.median(times)) * 1e3, written_ok=ok)
    log("kv_write", RESULTS["kv_write"])


def attention_hlo_copies(pool):
    q = jnp.zeros((256, HQ, D), jnp.bfloat16)
    cu = jnp.arange(257, dtype=jnp.int32)
    kl = jnp.full((256,), 1024, jnp.int32)
    tb = jnp.zeros((256, 64), jnp.int32)
    hlo = paged_attention.lower(q, pool, 0, cu, kl, tb).compile().as_text()
    pool_str = "bf16[" + ",".join(map(str, pool.shape)) + "]"
    return sum(1 for ln in hlo.splitlines() if " copy(" in ln and pool_str in ln)


def flush_json(args):
    if args.out:
        with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


def print_table(ceiling):
    log("\n=== Paged attention, " + RESULTS["device"] + f"; HBM read ceiling {ceiling / 1e12:.2f} TB/s ===")
    log("decode (Hq 16, Hkv 8, D 128, bs 16, bf16)   time us | TB/s | %ceil || jax-depr us | x || XLA ref us | x | err")
    for r in RESULTS["decode"]:
        o, j, x = r.get("ours"), r.get("jax_deprecated"), r.get("xla_reference")
        if not o:
            log(f"B={r['batch']:>3} ctx={r['ctx']:>4}  FAILED")
            continue
        js = f"{j['time_us']:8.1f} | {j['time_us'] / o['time_us']:4.2f}" if j else "     n/a |  n/a"
        xs = f"{x['time_us']:8.1f} | {x['time_us'] / o['time_us']:5.2f}" if x else "     n/a |  n/a"
        log(f"B={r['batch']:>3} ctx={r['ctx']:>4}  {o['time_us']:8.1f} | {o['TBps']:4.2f} | "
            f"{100 * o['frac']:4.0f}% || {js} || {xs} | {o['rel_err']:.1e}")
    log("prefill (1 seq, causal)   time us | TFLOP/s || cudnn us | ratio | err")
    for r in RESULTS["prefill"]:
        o, c = r.get("ours"), r.get("cudnn")
        if not o:
            log(f"{r['q_len']}+{r['prefix']} FAILED")
            continue
        cs = f"{c['time_us']:8.1f} | {o['time_us'] / c['time_us']:4.2f}x" if c else "     n/a |  n/a "
        log(f"new {r['q_len']:>4} prefix {r['prefix']:>4}  {o['time_us']:8.1f} | {o['TFLOPs']:6.1f} || "
            f"{cs} | {o['rel_err']:.1e}")
    log("correctness:", all(c["ok"] for c in RESULTS["correctness"]),
        "; kv_write:", RESULTS.get("kv_write"), "; attention HLO pool copies:", RESULTS.get("attn_copies"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--sweep", action="store_true", help="also time a few launch configurations")
    ap.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    ap.add_argument("--ctxs", default="128,1024,4096", help="decode context lengths")
    ap.add_argument("--prefill", default="512+0,512+1536,2048+0,2048+1536", help="new+prefix tokens")
    ap.add_argument("--only", default="", help="comma list of: check,decode,prefill,kv")
    args = ap.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    smoke = args.smoke
    interpret = smoke or jax.default_backend() != "gpu"
    if smoke:
        args.reps, args.chain = 2, 2
    only = set(args.only.split(",")) if args.only else {"check", "decode", "prefill", "kv"}
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    RESULTS["jax"] = jax.__version__
    t0 = time.perf_counter()
    ceiling = hbm_read_ceiling(smoke)
    RESULTS["hbm_read_ceiling_TBps"] = ceiling / 1e12
    log(f"HBM read ceiling {ceiling / 1e12:.3f} TB/s")
    rng = np.random.default_rng(0)
    steps = [("check", lambda: correctness(rng, interpret))]
    pool_blocks = 64 if smoke else 256 * 4096 // BS + 1024
    pool = None
    if "decode" in only:
        kk, kv_ = jax.random.split(jax.random.key(0))
        caches = (jax.random.normal(kk, (pool_blocks, BS, HKV, D), jnp.bfloat16),
                  jax.random.normal(kv_, (pool_blocks, BS, HKV, D), jnp.bfloat16))
        pool_hm = tuple(jnp.transpose(p, (2, 0, 1, 3)) for p in caches)  # [Hkv, N, bs, D], once
        pool = pool_from_caches(*caches)  # ours: [1, N, bs, 2, Hkv, D]
        del caches
        steps.append(("decode", lambda: bench_decode(args, pool, pool_hm, ceiling, smoke, interpret)))
        if not smoke:
            steps.append(("decode", lambda: RESULTS.__setitem__("attn_copies", attention_hlo_copies(pool))))
    steps += [("prefill", lambda: bench_prefill(args, smoke, interpret)),
              ("kv", lambda: bench_kv_write(args, smoke))]
    for name, step in steps:
        if name not in only:
            continue
        try:
            step()
        except Exception:
            log(f"step {name} FAILED:\n{traceback.format_exc()[-2000:]}")
        log(f"[{time.perf_counter() - t0:.0f}s] {name} done")
        flush_json(args)
    print_table(ceiling)


if __name__ == "__main__":
    main()
