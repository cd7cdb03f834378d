"""The fp8 decode kernel as it was at 05ad370 with the switches its variants were measured with
(``decode_variants.py``): ``early_fetch`` (the slot's next copy issued once the tile is read),
``fixed_v`` (P^T times V scale times 2^7, no per-tile largest scale), ``lazy_l`` (running sums kept
per key row), ``serial`` (V^T converted after the first wgmma). Not used by the engine."""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels.fp8 import exponent_range
from jaxpaged.kernels.kv_write import block_size_of
from jaxpaged.kernels.paged_attention_mgpu import BLOCK_M, LOG2E, TMA_ALIGN, _MASKED, _transforms
from jaxpaged.kernels.paged_attention_mgpu_fp8 import _scales, copy_fp8_block, f16_queries, fp8_block_copies
from jaxpaged.kernels.paged_attention_mgpu_layout import split_range, token_layout
from jaxpaged.kernels.split_k import merge_splits


def _tile(shape, dtype):
    """A shared-memory tile wgmma reads (the one-warpgroup kernel's tiling and swizzle)."""
    return plgpu.SMEM(shape, dtype, transforms=_transforms(dtype, shape[-1]))


def _column(vec_smem, n):
    """``n`` f32 values from shared memory as a row vector of a ``[64, n]`` WGMMA array (one a column)."""
    return plgpu.load(vec_smem.at[pl.ds(0, n)], layout=plgpu.Layout.WGMMA.reduce(0))


def _decode_kernel(layer_ref, meta_ref, tables_ref, q_ref, kv_ref, o_ref, lse_ref=None, *, q_bar, k_bar, v_bar,
                   q_union, qs_smem, k8, vt8, scales, pt16, lse_smem=None, k16=None, vt16=None,
                   scale_log2: float, group: int, rows: int, num_slots: int, num_splits: int,
                   early_fetch: bool = False, fixed_v: int | None = None, lazy_l: bool = False,
                   serial: bool = False):
    """Refs: ``q_ref [T Hq (+ pad), D]`` bf16, ``kv_ref [L, N, bs + 1, 2, Hkv, D]`` fp8; ``o_ref [T, Hkv, D, R]``
    bf16, or ``f32[P, T, Hkv, D, R]`` and ``lse_ref f32[P, T, Hkv, R]``. Columns ``c`` of a program's
    output are query rows ``first + c`` of ``q`` (``first``: the tile's first row, moved back near the
    end of ``q`` so that ``R`` rows fit; the caller reads its ``G`` columns from ``row0 - first``)."""
    q_plain, q16, out_smem = q_union  # one piece of memory: the queries, then f16 queries, then the output
    wgmma = plgpu.Layout.WGMMA
    block_size, head_dim = k8.shape[1:]
    width = tables_ref.shape[1]
    split = lax.axis_index("split") if num_splits > 1 else 0
    h = lax.axis_index("kv_head")
    tile = lax.axis_index("tile")
    seq = meta_ref[tile, 0]
    kv_end = meta_ref[tile, 2]
    lo, hi = split_range(kv_end, split, block_size, num_splits)
    row0 = (tile * kv_ref.shape[4] + h) * group
    first = jnp.minimum(row0, q_ref.shape[0] - rows)

    @pl.when(jnp.logical_and(seq >= 0, lo < hi))
    def _owned():
        layer = layer_ref[0]

        def fetch(t, slot):
            copy_fp8_block(kv_ref, layer, tables_ref[seq, jnp.minimum(t, width - 1)], h, slot, k8, vt8, scales,
                           k_bar, v_bar)

        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first, rows)], q_plain.at[pl.ds(0, rows)], q_bar)
        fetch(lo, 0)
        for i in range(1, num_slots):
            pl.when(lo + i < hi)(functools.partial(fetch, lo + i, i))

        # Queries: each row times the power of two that brings its largest element near 2^14, in f16;
        # the inverse (times the softmax scale, base 2) multiplies that row's score column.
        plgpu.barrier_wait(q_bar)
        q32 = plgpu.load(q_plain, layout=wgmma).astype(jnp.float32)  # rows past R: stale, never used
        plgpu.commit_smem()  # (a warpgroup barrier: every warp has read q_plain before q16 overwrites it)
        q16[...], qs_smem[...] = f16_queries(q32, scale_log2)
        plgpu.commit_smem()
        q_op = q16.at[pl.ds(0, rows)].transpose((1, 0))  # [D, R]: wgmma's N operand
        q_unscale = _column(qs_smem, rows)
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=wgmma)

        def step(t, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(t - lo, num_slots)
            plgpu.barrier_wait(k_bar.at[slot])
            k_op = plgpu.load(k8.at[slot], layout=wgmma).astype(jnp.float16)  # [bs, D]
            if k16 is not None:  # the interpreter's wgmma reads shared memory only
                k16[...] = k_op
                plgpu.commit_smem()
                k_op = k16

            shape = (block_size, rows)

            def load_v():
                plgpu.barrier_wait(v_bar.at[slot])  # V^T and the V scales
                vt = plgpu.load(vt8.at[slot], layout=wgmma).astype(jnp.float16)  # [D, bs]
                if masked:
                    vt = jnp.where(t * block_size + iota(vt.shape, 1) < kv_end, vt, jnp.zeros((), vt.dtype))
                vs = _scales(scales.at[slot, 1], shape, key_axis=0)
                ks = _scales(scales.at[slot, 0], shape, key_axis=0)
                if early_fetch:
                    plgpu.commit_smem()  # every warp has read the slot

                    @pl.when(t + num_slots < hi)
                    def _():
                        fetch(t + num_slots, slot)
                return vt, vs, ks

            def qk(acc_ref):  # while wgmma computes S^T, V^T is converted
                plgpu.wgmma(acc_ref, k_op, q_op)
                if serial:
                    return acc_ref[...]
                return (acc_ref[...],) + load_v()

            if serial:
                s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
                vt, vs, ks = load_v()
            else:
                s, vt, vs, ks = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))  # S^T: a row per key
            s = s * ks
            s = s * lax.broadcast_in_dim(q_unscale, shape, [1])
            if masked:
                live = t * block_size + iota(shape, 0) < kv_end
                s = jnp.where(live, s, -jnp.inf)
                vs = jnp.where(live, vs, 0.0)  # (a stale scale may be NaN)
            m_new = jnp.maximum(m_i, s.max(axis=0))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [1]))
            if lazy_l:
                l_new = l_i * lax.broadcast_in_dim(alpha, shape, [1]) + p
            else:
                l_new = l_i * alpha + p.sum(axis=0)
            if fixed_v is not None:
                p = p * (vs * float(2.0 ** fixed_v))
            else:
                v_max = vs.max(axis=0)  # the tile's largest V scale, in every column
                v_max = jnp.where(v_max > 0, v_max, 1.0)
                p = p * vs * lax.broadcast_in_dim(1.0 / v_max, shape, [1])
            pt16.transpose((1, 0))[...] = p.astype(jnp.float16)  # P^T [bs, R] into the [R, bs] tile
            if vt16 is not None:
                vt16[...] = vt
                vt = vt16
            plgpu.commit_smem()  # P^T (and V^T in the interpreter) visible to wgmma
            p_op = pt16.transpose((1, 0))  # [bs, R]

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, vt, p_op)
                return acc_ref[...]

            o = pl.run_scoped(pv, plgpu.ACC((head_dim, rows), jnp.float32))

            if not early_fetch:
                @pl.when(t + num_slots < hi)
                def _():
                    fetch(t + num_slots, slot)

            wide = lambda x: lax.broadcast_in_dim(x, acc.shape, [1])  # noqa: E731
            if fixed_v is not None:
                return acc * wide(alpha) + o, m_new, l_new
            return acc * wide(alpha) + o * wide(v_max), m_new, l_new

        cols = wgmma.reduce(0)
        carry = (plgpu.layout_cast(jnp.zeros((head_dim, rows), jnp.float32), wgmma),
                 plgpu.layout_cast(jnp.full((rows,), _MASKED, jnp.float32), cols),
                 plgpu.layout_cast(jnp.zeros((block_size, rows) if lazy_l else (rows,), jnp.float32),
                                   wgmma if lazy_l else cols))
        pos0 = meta_ref[tile, 1]
        n_full = jnp.clip(lax.div(pos0 + 1, block_size), lo, hi)
        carry = lax.fori_loop(lo, n_full, functools.partial(step, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), carry)
        if lazy_l:
            l_i = l_i.sum(axis=0)
        if fixed_v is not None:
            acc = acc * float(2.0 ** -fixed_v)
        has = l_i > 0
        out = acc / lax.broadcast_in_dim(jnp.where(has, l_i, 1.0), acc.shape, [1])
        out_smem[...] = out.astype(out_smem.dtype)
        if num_splits > 1:
            lse_smem[...] = jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)) * LOG2E, -jnp.inf)
        plgpu.commit_smem()
        if num_splits == 1:
            plgpu.copy_smem_to_gmem(out_smem, o_ref.at[tile, h])
        else:
            plgpu.copy_smem_to_gmem(out_smem, o_ref.at[split, tile, h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, tile, h])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_slots", "num_splits", "early_fetch", "fixed_v",
                                                       "lazy_l", "serial"))
def paged_decode_fp8_mgpu(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale: float, interpret,
                          num_slots: int, num_splits: int, early_fetch: bool = False, fixed_v: bool = False,
                          lazy_l: bool = False, serial: bool = False):
    """Decode attention (one query tile a token) over an fp8 pool; arguments as
    :func:`jaxpaged.kernels.paged_attention_mgpu.paged_attention_mgpu` after its validation (``layer`` an
    ``i32[]``, ``interpret`` ``None`` or ``InterpretGPUParams``). Returns ``[T, Hq, D]`` bf16, padding
    tokens zero."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    block_size = block_size_of(kv_pool)
    group = num_q_heads // num_kv_heads
    rows = -(-group // 8) * 8
    meta = token_layout(cu_q_lens, kv_lens, num_tokens)
    q_in = q.reshape(num_tokens * num_q_heads, head_dim)
    if q_in.shape[0] < rows:
        q_in = jnp.pad(q_in, ((0, rows - q_in.shape[0]), (0, 0)))
    fp8 = kv_pool.dtype
    staged = lambda shape: plgpu.SMEM(shape, fp8, transforms=(plgpu.SwizzleTransform(shape[-1]),))  # noqa: E731
    out_dtype = q.dtype if num_splits == 1 else jnp.float32
    k_copies, v_copies = fp8_block_copies(head_dim, block_size)
    scratch = dict(
        q_bar=plgpu.Barrier(num_arrivals=1),
        k_bar=plgpu.Barrier(num_arrivals=k_copies, num_barriers=num_slots),
        v_bar=plgpu.Barrier(num_arrivals=v_copies, num_barriers=num_slots),
        q_union=plgpu.RefUnion(plgpu.SMEM((BLOCK_M, head_dim), q.dtype), _tile((BLOCK_M, head_dim), jnp.float16),
                               plgpu.SMEM((head_dim, rows), out_dtype)),
        qs_smem=plgpu.SMEM((BLOCK_M,), jnp.float32),
        k8=staged((num_slots, block_size, head_dim)),
        vt8=staged((num_slots, head_dim, block_size)),
        scales=plgpu.SMEM((num_slots, 2, max(block_size, TMA_ALIGN)), fp8),
        pt16=_tile((rows, block_size), jnp.float16),
    )
    if interpret is not None:
        scratch.update(k16=_tile((block_size, head_dim), jnp.float16), vt16=_tile((head_dim, block_size), jnp.float16))
    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim, rows), q.dtype)
    else:
        scratch["lse_smem"] = plgpu.SMEM((rows,), jnp.float32)
        out_type = (jax.ShapeDtypeStruct((num_splits, num_tokens, num_kv_heads, head_dim, rows), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, num_tokens, num_kv_heads, rows), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_decode_kernel, scale_log2=scale * LOG2E, group=group, rows=rows, num_slots=num_slots,
                          num_splits=num_splits, early_fetch=early_fetch, lazy_l=lazy_l, serial=serial,
                          fixed_v=(15 - exponent_range(fp8)[1]) if fixed_v else None),
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_kv_heads, num_tokens) + ((num_splits,) if num_splits > 1 else ()),
        grid_names=("kv_head", "tile") + (("split",) if num_splits > 1 else ()),
        interpret=interpret,
    )
    out = kernel(jnp.reshape(layer, (1,)), meta, block_tables, q_in, kv_pool)

    # Program (t, h)'s G columns start at row0 - first (nonzero only near the end of q).
    t = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    h = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :]
    row0 = (t * num_kv_heads + h) * group
    col = (row0 - jnp.minimum(row0, q_in.shape[0] - rows))[..., None] + jnp.arange(group, dtype=jnp.int32)

    def heads(x):  # [..., T, Hkv, D, R] -> [..., T, Hkv, G, D]
        x = jnp.swapaxes(x, -1, -2)
        return jnp.take_along_axis(x, jnp.broadcast_to(col[..., None], x.shape[:-4] + col.shape + (1,)), axis=-2)

    owned = meta[:, 0] >= 0
    if num_splits == 1:
        out = heads(out).reshape(num_tokens, num_q_heads, head_dim)
        return jnp.where(owned[:, None, None], out, jnp.zeros((), out.dtype))
    o_parts, lse = out
    split = jnp.arange(num_splits, dtype=jnp.int32)[:, None]
    lo, hi = split_range(meta[None, :, 2], split, block_size, num_splits)
    wrote = ((lo < hi) & owned[None, :])[:, :, None, None]  # [P, T, 1, 1]
    lse = jnp.take_along_axis(lse, jnp.broadcast_to(col, lse.shape[:1] + col.shape), axis=-1)  # [P, T, Hkv, G]
    lse = jnp.where(wrote, lse, -jnp.inf).reshape(num_splits, num_tokens, num_q_heads)
    o_parts = jnp.where(wrote[..., None], heads(o_parts), 0.0).reshape(num_splits, num_tokens, num_q_heads, head_dim)
    return merge_splits(o_parts, lse, q.dtype)
