"""Where an fp8 pool's decode attention time goes: variants of the engine kernel's unmasked decode loop.

Batch 256 x context 1,024, Qwen3-0.6B's heads (16 q, 8 KV, D 128), block size ``BS`` (default 16), one
layer, each variant timed as ``bench_attention.timed`` does (8 chained calls per jit, median of 30
groups) next to the bf16 pool and the engine's own kernel (``engine_fp8``). The fp8 pool is written by
``write_kv`` (values transposed within each (block, head) slab, ``kernels/fp8.py``); variants that read
values in key order get a copy with the values put back. Variants (``VARIANTS=run1|run2|blk|swap|f8|f8T``):

  bf16          the bf16 pool, the engine's loop
  fp8           fp8 pool, values in key order: tiles cast to bf16, K scales on the scores' columns, V
                scales on P's columns
  *_noscale     the same without loading or applying scales (wrong values: what the scales cost)
  fp8_vrow      scales applied to K's and V's rows in f32, then cast (dequantise before the dots)
  fp8_kT        K loaded transposed ([D, block_k])
  u8*           the pool read as uint8 and converted to bf16 with integer ops instead of a cast
  *_sel         the converted tiles passed through a select (keeps the cast out of the dot's operands)
  kmix / vmix   K from the fp8 pool and V from the bf16 pool / the reverse (no scales)
  fma_noscale   scores and P @ V as broadcast products and sums, no dot (Pallas-Triton does not lower it)
  blk*          values transposed (the engine's layout), each KV tile processed one pool block at a
                time (scalar block id: vectorised K, V^T and scale loads)
  swap*         the transposed products: S^T = K Q^T and O^T += V^T P^T (the converted fp8 tile as
                the first operand); swap_bf16 over the bf16 pool; swapblk* a block at a time
  f8*           native fp8 dots: P rounded to e4m3 (scaled by its tile's largest V scale) times the
                fp8 V tile; f8all* also Q (a per-row scale) times the fp8 K tile; *T: the transposed
                values, one block a tile (``BS=64``)

    python benchmarks/results/fp8/attention_variants/variants.py          # GPU; SMOKE=1: CPU interpret
    BS=64 VARIANTS=f8T python benchmarks/results/fp8/attention_variants/variants.py
"""
import functools
import json
import math
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
from jaxpaged.kernels.fp8 import values_from_slab
from jaxpaged.kernels.kv_write import pool_shape, write_kv
from jaxpaged.kernels.paged_attention import paged_attention
from bench_attention import timed, hbm_read_ceiling

SMOKE = bool(os.environ.get("SMOKE"))
S, CTX, HQ, HKV, D = (4, 128, 16, 8, 128) if SMOKE else (256, 1024, 16, 8, 128)
BS = int(os.environ.get("BS", 16))  # the pool's block size
G = HQ // HKV
LOG2E = math.log2(math.e)


def kernel(tables_ref, q_ref, kv_ref, *rest, variant, block_k, fp8):
    kv16_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    block_m = 16
    bs = BS
    h = pl.program_id(0)
    seq = pl.program_id(1)
    rows = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    row_ok = rows < G
    dims = lax.broadcasted_iota(jnp.int32, (1, D), 1)
    head_ix = (h * G + rows % G)[:, None]
    tok_ix = jnp.where(row_ok, seq, q_ref.shape[0])[:, None]  # masked rows past T (interpret drops them)
    q = plgpu.load(q_ref.at[tok_ix, head_ix, dims], mask=row_ok[:, None], other=0)
    cols = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    scale_log2 = D ** -0.5 * LOG2E

    def cvt(x):
        if variant.startswith("u8"):
            b = x.astype(jnp.uint16)
            bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
            return lax.bitcast_convert_type(bits, jnp.bfloat16) * jnp.bfloat16(2.0 ** 120)
        return x.astype(q.dtype)

    def cvt_sel(x, ok):
        y = cvt(x)
        return jnp.where(ok, y, jnp.zeros_like(y)) if "sel" in variant else y

    def scl(x):  # an fp8 power-of-two scale -> f32, exactly (subnormal scales included)
        if not variant.startswith("u8"):
            return x.astype(jnp.float32)
        b = x.astype(jnp.int32)
        e = (b >> 3) & 0xF
        normal = lax.bitcast_convert_type((e - 7 + 127) << 23, jnp.float32)
        return jnp.where(e > 0, normal, (b & 7).astype(jnp.float32) * (2.0 ** -9))

    def blk_step(t, carry):
        acc, m_i, l_i = carry
        nsub = block_k // bs
        ri = lax.broadcasted_iota(jnp.int32, (bs, 1), 0)
        dcol = lax.broadcasted_iota(jnp.int32, (D, 1), 0)
        tt = lax.broadcasted_iota(jnp.int32, (1, bs), 1)
        tv = lax.broadcasted_iota(jnp.int32, (bs,), 0)
        per = D // bs
        ss, vts, vss = [], [], []
        for j in range(nsub):
            phys = tables_ref[seq, t * nsub + j]
            k = kv_ref[0, phys, ri, 0, h, dims].astype(q.dtype)  # [bs, D]
            vt = kv_ref[0, phys, dcol // per, 1, h, (dcol % per) * bs + tt].astype(q.dtype)  # [D, bs]
            s_j = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if "noscale" in variant:
                s_j = s_j * scale_log2
                vss.append(None)
            else:
                ks = kv_ref[0, phys, bs, 0, h, tv].astype(jnp.float32)
                vss.append(kv_ref[0, phys, bs, 1, h, tv].astype(jnp.float32))
                s_j = s_j * (scale_log2 * ks)[None, :]
            ss.append(s_j)
            vts.append(vt)
        m_new = m_i
        for s_j in ss:
            m_new = jnp.maximum(m_new, jnp.max(s_j, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        l_new = l_i * alpha
        acc = acc * alpha[:, None]
        for s_j, vt, vs in zip(ss, vts, vss):
            p = jnp.exp2(s_j - m_new[:, None])
            l_new = l_new + jnp.sum(p, axis=1)
            if vs is not None:
                p = p * vs[None, :]
            acc = acc + lax.dot_general(p.astype(q.dtype), vt, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
        return acc, m_new, l_new

    def step(t, carry):
        acc, m_i, l_i = carry
        pos = t * block_k + cols
        phys = tables_ref[seq, pos // bs]
        off = pos % bs
        if variant.endswith("kT"):
            dcol = lax.broadcasted_iota(jnp.int32, (D, 1), 0)
            kt = kv_ref[0, phys[None, :], off[None, :], 0, h, dcol]  # [D, block_k]
        else:
            k = kv_ref[0, phys[:, None], off[:, None], 0, h, dims]
        v = kv_ref[0, phys[:, None], off[:, None], 1, h, dims]
        if variant == "kmix":
            v = kv16_ref[0, phys[:, None], off[:, None], 1, h, dims]
        if variant == "vmix":
            k = kv16_ref[0, phys[:, None], off[:, None], 0, h, dims]
        if variant in ("kmix", "vmix"):
            s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale_log2
        elif variant.startswith("fma"):
            kf = k.astype(jnp.float32)
            s = jnp.sum(kf[None, :, :] * q[:G].astype(jnp.float32)[:, None, :], axis=2) * scale_log2  # [G, bk]
        if variant in ("kmix", "vmix") or variant.startswith("fma"):
            pass
        elif fp8:
            noscale = "noscale" in variant
            if not noscale:
                ks = kv_ref[0, phys, bs, 0, h, off]
                vs = kv_ref[0, phys, bs, 1, h, off]
                ks, vs = scl(ks), scl(vs)
            if "vrow" in variant:
                k = (cvt(k).astype(jnp.float32) * ks[:, None]).astype(q.dtype)
                v = (cvt(v).astype(jnp.float32) * vs[:, None]).astype(q.dtype)
                s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale_log2
            else:
                v = cvt_sel(v, (phys >= 0)[:, None])
                if "sel" in variant:
                    k = cvt_sel(k, (phys >= 0)[:, None])
                if variant.endswith("kT"):
                    s = lax.dot_general(q, cvt(kt), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                else:
                    s = lax.dot_general(q, cvt(k), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                s = s * (scale_log2 if noscale else (scale_log2 * ks)[None, :])
        else:
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale_log2
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        if fp8 and "vrow" not in variant and "noscale" not in variant and "mix" not in variant:
            p = p * vs[None, :]
        if variant.startswith("fma"):
            pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None], axis=1)
        else:
            pv = lax.dot_general(p.astype(q.dtype), v.astype(q.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l_new

    def swap_scores(k, ks):
        s_t = lax.dot_general(k.astype(q.dtype), q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return s_t * (scale_log2 if ks is None else (scale_log2 * ks)[:, None])  # [tile, block_m]

    def swap_update(carry, s_list, vt_list, vs_list):
        acc_t, m_i, l_i = carry
        m_new = m_i
        for s_t in s_list:
            m_new = jnp.maximum(m_new, jnp.max(s_t, axis=0))
        alpha = jnp.exp2(m_i - m_new)
        l_new = l_i * alpha
        acc_t = acc_t * alpha[None, :]
        for s_t, vt, vs in zip(s_list, vt_list, vs_list):
            p_t = jnp.exp2(s_t - m_new[None, :])
            l_new = l_new + jnp.sum(p_t, axis=0)
            if vs is not None:
                p_t = p_t * vs[:, None]
            acc_t = acc_t + lax.dot_general(vt.astype(q.dtype), p_t.astype(q.dtype), (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)
        return acc_t, m_new, l_new

    def swap_step(t, carry):  # key-order pool; K [tile, D] and V^T [D, tile] gathered per slot
        pos = t * block_k + cols
        phys = tables_ref[seq, pos // bs]
        off = pos % bs
        dcol = lax.broadcasted_iota(jnp.int32, (D, 1), 0)
        k = kv_ref[0, phys[:, None], off[:, None], 0, h, dims]
        vt = kv_ref[0, phys[None, :], off[None, :], 1, h, dcol]
        ks = vs = None
        if fp8 and "noscale" not in variant:
            ks = kv_ref[0, phys, bs, 0, h, off].astype(jnp.float32)
            vs = kv_ref[0, phys, bs, 1, h, off].astype(jnp.float32)
        return swap_update(carry, [swap_scores(k, ks)], [vt], [vs])

    def swapblk_step(t, carry):  # slab pool; one pool block (scalar id) at a time
        nsub = block_k // bs
        ri = lax.broadcasted_iota(jnp.int32, (bs, 1), 0)
        dcol = lax.broadcasted_iota(jnp.int32, (D, 1), 0)
        tt = lax.broadcasted_iota(jnp.int32, (1, bs), 1)
        tv = lax.broadcasted_iota(jnp.int32, (bs,), 0)
        per = D // bs
        ss, vts, vss = [], [], []
        for j in range(nsub):
            phys = tables_ref[seq, t * nsub + j]
            k = kv_ref[0, phys, ri, 0, h, dims]
            vts.append(kv_ref[0, phys, dcol // per, 1, h, (dcol % per) * bs + tt])
            ks = None
            vss.append(None)
            if "noscale" not in variant:
                ks = kv_ref[0, phys, bs, 0, h, tv].astype(jnp.float32)
                vss[-1] = kv_ref[0, phys, bs, 1, h, tv].astype(jnp.float32)
            ss.append(swap_scores(k, ks))
        return swap_update(carry, ss, vts, vss)

    def f8_step(t, carry):  # native fp8 dots: P (and with "all", Q) rounded to e4m3
        acc, m_i, l_i = carry
        scaled = "noscale" not in variant
        if variant.endswith("T") or "T_" in variant:  # slab pool, one block a tile: V^T [D, tile] contiguous
            phys = tables_ref[seq, t]
            ri = lax.broadcasted_iota(jnp.int32, (bs, 1), 0)
            dcol = lax.broadcasted_iota(jnp.int32, (D, 1), 0)
            tt = lax.broadcasted_iota(jnp.int32, (1, bs), 1)
            per = D // bs
            k = kv_ref[0, phys, ri, 0, h, dims]
            v, v_contract = kv_ref[0, phys, dcol // per, 1, h, (dcol % per) * bs + tt], 1
            off = cols
        else:
            pos = t * block_k + cols
            phys = tables_ref[seq, pos // bs]
            off = pos % bs
            k = kv_ref[0, phys[:, None], off[:, None], 0, h, dims]
            v, v_contract = kv_ref[0, phys[:, None], off[:, None], 1, h, dims], 0
        if "all" in variant:
            s = lax.dot_general(q8, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = s * (q_scale * scale_log2)[:, None]
        else:
            s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale_log2
        if scaled:
            s = s * kv_ref[0, phys, bs, 0, h, off].astype(jnp.float32)[None, :]
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        if scaled:
            vs = kv_ref[0, phys, bs, 1, h, off].astype(jnp.float32)
            vmax = jnp.max(vs)
            p = p * (vs / vmax)[None, :]
        pv = lax.dot_general(p.astype(kv_ref.dtype), v, (((1,), (v_contract,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + (pv * vmax if scaled else pv), m_new, l_new

    if variant.startswith("f8"):
        qf = q.astype(jnp.float32)
        q_scale = jnp.maximum(jnp.max(jnp.abs(qf), axis=1), 1e-30) / 448.0
        q8 = (qf / q_scale[:, None]).astype(kv_ref.dtype)
        step = f8_step

    if variant.startswith("swap"):
        step = swapblk_step if variant.startswith("swapblk") else swap_step
        carry = (jnp.zeros((D, block_m), jnp.float32), jnp.full((block_m,), -1e30, jnp.float32),
                 jnp.zeros((block_m,), jnp.float32))
        acc_t, m_i, l_i = lax.fori_loop(0, CTX // block_k, step, carry)
        out_t = acc_t / l_i[None, :]
        tok_row = jnp.where(row_ok, seq, q_ref.shape[0])[None, :]
        dcol = lax.broadcasted_iota(jnp.int32, (D, 1), 0)
        plgpu.store(o_ref.at[tok_row, (h * G + rows % G)[None, :], dcol], out_t.astype(o_ref.dtype),
                    mask=row_ok[None, :])
        return

    nr = G if variant.startswith("fma") else block_m
    if variant.startswith("blk"):
        step = blk_step
    carry = (jnp.zeros((nr, D), jnp.float32), jnp.full((nr,), -1e30, jnp.float32),
             jnp.zeros((nr,), jnp.float32))
    acc, m_i, l_i = lax.fori_loop(0, CTX // block_k, step, carry)
    out = acc / l_i[:, None]
    if variant.startswith("fma"):
        out = jnp.concatenate([out] * (block_m // G), axis=0)
    plgpu.store(o_ref.at[tok_ix, head_ix, dims], out.astype(o_ref.dtype), mask=row_ok[:, None])


def key_order_layout(pool):
    """An fp8 pool as ``write_kv`` writes it (values transposed within each (block, head) slab,
    ``kernels/fp8.py``) with the values put back in key order (``[t, h, d]``), as the non-``blk``
    variants read them."""
    return pool.at[:, :, :BS, 1].set(values_from_slab(pool[:, :, :BS, 1]))


def attn(q, pool, tables, pool16=None, *, variant, block_k=64, stages=3, warps=4):
    fp8 = variant not in ("bf16", "swap_bf16")
    if variant.startswith("u8"):
        pool = lax.bitcast_convert_type(pool, jnp.uint8)

    k = functools.partial(kernel, variant=variant, block_k=block_k, fp8=fp8)
    return pl.pallas_call(k, grid=(HKV, S), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                          compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
                          name=f"var_{variant}_k{block_k}_s{stages}_w{warps}", interpret=SMOKE)(tables, q, pool, *((pool16,) if 'mix' in variant else ()))


def main():
    out_dir = os.environ.get("OUT", ".")
    rng = np.random.default_rng(0)
    bpseq = CTX // BS
    nb = S * bpseq + 3
    tables = jnp.asarray(rng.permutation(nb)[: S * bpseq].reshape(S, bpseq).astype(np.int32))
    slots = (np.asarray(tables)[:, :, None] * BS + np.arange(BS)).reshape(-1).astype(np.int32)
    k = jnp.asarray(rng.standard_normal((slots.size, HKV, D)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((slots.size, HKV, D)), jnp.bfloat16)
    pools = {}
    for dt in (jnp.float8_e4m3fn, jnp.bfloat16):
        p = jnp.zeros(pool_shape(1, nb, BS, HKV, D, dt), dt)
        pools[dt] = jax.jit(write_kv, static_argnums=1)(p, 0, k, v, jnp.asarray(slots))
    del k, v
    slab_pool = pools[jnp.float8_e4m3fn]
    pools[jnp.float8_e4m3fn] = jax.jit(key_order_layout)(slab_pool)
    q = jnp.asarray(rng.standard_normal((S, HQ, D)), jnp.bfloat16)
    cu = jnp.arange(S + 1, dtype=jnp.int32)
    kl = jnp.full(S, CTX, jnp.int32)
    ceiling = hbm_read_ceiling(SMOKE)
    print(f"ceiling {ceiling/1e12:.2f} TB/s")
    ref = np.asarray(paged_attention(q, pools[jnp.bfloat16], 0, cu, kl, tables, interpret=SMOKE), np.float32)
    rows = []
    variants = {
        "run1": [("bf16", 64, 3, 4), ("engine_fp8", 64, 3, 4), ("fp8", 64, 3, 4), ("fp8_noscale", 64, 3, 4),
                 ("fp8_vrow", 64, 3, 4), ("fp8_kT", 64, 3, 4), ("u8", 64, 3, 4), ("u8_noscale", 64, 3, 4),
                 ("u8_vrow", 64, 3, 4), ("u8_kT", 64, 3, 4), ("fp8", 128, 3, 4), ("fp8", 64, 2, 4),
                 ("fp8", 64, 4, 4), ("fp8_vrow", 128, 3, 4), ("u8", 128, 3, 4), ("u8", 64, 4, 4),
                 ("bf16", 128, 3, 4), ("bf16", 64, 4, 4)],
        "run2": [("bf16", 64, 3, 4), ("fp8", 64, 3, 4), ("fp8_sel", 64, 3, 4), ("fma_noscale", 64, 3, 4),
                 ("fma_noscale", 32, 3, 4), ("fp8_noscale", 64, 3, 4), ("fp8_sel_noscale", 64, 3, 4),
                 ("fma_noscale", 128, 3, 8), ("fp8_sel", 64, 3, 8), ("kmix", 64, 3, 4), ("vmix", 64, 3, 4)],
        "blk": [("bf16", 64, 3, 4), ("engine_fp8", 16, 3, 4), ("blk", 16, 3, 4), ("blk", 32, 3, 4),
                ("blk", 64, 3, 4), ("blk_noscale", 64, 3, 4), ("blk", 128, 3, 4), ("blk", 64, 2, 4),
                ("blk", 64, 4, 4), ("blk", 64, 3, 8)],
        "f8": [("bf16", 64, 3, 4), ("fp8", 64, 3, 4), ("f8pv", 64, 3, 4), ("f8pv_noscale", 64, 3, 4),
               ("f8all", 64, 3, 4), ("f8all_noscale", 64, 3, 4), ("f8pv", 128, 3, 4), ("f8all", 128, 3, 4)],
        "f8T": [("bf16", 64, 3, 4), ("fp8", 64, 3, 4), ("blk", 64, 3, 4), ("f8pvT", 64, 3, 4),
                ("f8allT", 64, 3, 4), ("f8allT_noscale", 64, 3, 4), ("f8pv", 64, 3, 4), ("f8all", 64, 3, 4)],
        "swap": [("bf16", 64, 3, 4), ("swap_bf16", 64, 3, 4), ("fp8", 64, 3, 4), ("swap", 64, 3, 4),
                 ("swap_noscale", 64, 3, 4), ("swapblk", 64, 3, 4), ("swapblk_noscale", 64, 3, 4),
                 ("swap", 128, 3, 4), ("swapblk", 128, 3, 4), ("swap", 64, 4, 4), ("swapblk", 64, 4, 4),
                 ("swap", 64, 3, 8), ("swap_bf16", 128, 3, 4)],
    }[os.environ.get("VARIANTS", "blk")]
    for name, bk, st, wp in variants:
        try:
            pool = pools[jnp.bfloat16 if name in ("bf16", "swap_bf16") else jnp.float8_e4m3fn]
            if name.startswith(("blk", "swapblk")) or name == "engine_fp8" or (name.startswith("f8") and "T" in name):
                pool = slab_pool
            if name == "engine_fp8":
                fn = lambda q, p, t: paged_attention(q, p, 0, cu, kl, t, interpret=SMOKE)
            else:
                fn = functools.partial(attn, pool16=pools[jnp.bfloat16], variant=name, block_k=bk, stages=st, warps=wp)
            def chain(q, p, t, fn=fn):
                for _ in range(8):
                    q = fn(q, p, t)
                return q
            chain.__name__ = f"chain_{name}_{bk}_{st}_{wp}"
            c, t = timed(chain, (q, pool, tables), 1 if SMOKE else 30)
            t /= 8
            got = np.asarray(jax.jit(fn)(q, pool, tables), np.float32)
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            nbytes = S * CTX * 2 * HKV * D * (2 if name in ("bf16", "swap_bf16") else 1.5 if name in ('kmix', 'vmix') else 1 if 'noscale' in name else 17 / 16)
            rows.append(dict(variant=name, block_k=bk, stages=st, warps=wp, us=t * 1e6, tbps=nbytes / t / 1e12,
                             of_ceiling=nbytes / t / ceiling, rel_err_vs_bf16=err, compile_s=c))
            print(json.dumps(rows[-1]))
            with open(os.path.join(out_dir, "fp8_variants.json"), "w") as f:
                json.dump(rows, f, indent=1)
        except Exception as e:  # noqa: BLE001
            print(name, bk, st, wp, "FAILED", type(e).__name__, str(e)[:300])
    with open(os.path.join(out_dir, "fp8_variants.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'variant':14s} {'bk':>4s} {'st':>3s} {'wp':>3s} {'us':>8s} {'TB/s':>6s} {'ceil':>5s} {'err':>8s}")
    for r in rows:
        print(f"{r['variant']:14s} {r['block_k']:4d} {r['stages']:3d} {r['warps']:3d} {r['us']:8.1f} {r['tbps']:6.2f} {r['of_ceiling']:5.2f} {r['rel_err_vs_bf16']:8.4f}")


if __name__ == "__main__":
    main()
