"""Decode attention on Mosaic GPU with keys on wgmma's M: ``S^T = K Q^T``, ``O^T += V^T P^T``, over bf16
and fp8 pools.

A decode step has ``G = Hq // Hkv`` query rows per KV head and token (2 at Qwen3-0.6B's shapes).
``tiles.py``'s query tiles put query rows on wgmma's M, which is 64 per
warpgroup: both matmuls and the softmax between them compute 64 rows for ``G`` useful ones. Here the
products are transposed: the KV tile is the ``M`` operand (its 64 keys, or ``V^T``'s ``D`` rows) and the
queries are wgmma's ``N = R`` (``G`` rounded up to 8), so a KV tile costs ``64 x R`` scores instead of
``64 x 64`` and a program needs fewer registers. Over fp8 pools that arithmetic, not the halved reads,
sets the query tiles' time (docs/DECISIONS.md has both kernels' times).

One program: token ``t`` (grid axis ``tile``), KV head ``h`` and, with split-K, split ``p`` of its KV
tiles (``layout.split_range``). Its copies are the query tiles':

  * bf16: a KV tile is ``block_kv`` keys (64, or one pool block if larger), ``block_kv / bs`` pool
    blocks, each one TMA copy of its keys and one of its values into a K and a V slot. ``K`` is wgmma's
    A operand straight from shared memory, ``V^T`` the V slot read transposed;
  * fp8: a KV tile is one pool block of 64 or 128 slots: its keys, its values' ``V^T`` in ``D / bs``
    boxes and its two scale rows. Keys and ``V^T`` are converted exactly to f16 in registers and feed
    wgmma from there (the interpreter, whose wgmma reads shared memory only, goes through shared-memory
    tiles); the queries are scaled per row into f16's range (each row's own power of two, undone on its
    score column, as the query tiles do); the K scales multiply the score rows (one per key).

Per KV tile:

  * ``S^T [block_kv, R] = K Q^T``; keys at or past ``kv_end`` are ``-inf``;
  * the online softmax runs down the columns (a column is a query row): running max and rescale; the
    running sum stays one partial sum per key row, added up over the keys once after the last tile
    (one cross-warp reduction a tile fewer);
  * ``P^T`` (over fp8: its rows times their V scale and a constant power of two, :func:`v_shift`; over
    e5m2, over the tile's largest V scale instead) rounded to the operands' 16-bit type, stored in a
    shared-memory tile that wgmma reads as its ``N`` operand;
  * ``O^T [D, R] += V^T P^T`` (the power of two undone at the end); values at or past ``kv_end`` are
    zeroed first (stale slots may hold NaN, and ``0 x NaN`` is NaN): over bf16 in the V slot, over fp8
    in registers. The fp8 ``V^T`` is read and converted after ``S^T``'s wgmma completes: converted during
    it, both tiles' f16 registers are live at once; every shared-memory read of a slot waits on that
    slot's barrier first (the V scales too: read early, they were stale where many programs share the
    GPU, which the interpreter, whose copies land at once, cannot show).

Over fp8 this is one cross-warp reduction (e5m2) or two (e4m3) a tile fewer than dividing by the tile's
largest V scale and summing each tile's probabilities, and at 144 registers a thread three programs
share a multiprocessor (converting ``V^T`` during the first wgmma, or issuing the next copy as soon as
the slot is read, take more registers and are slower at large batches).

Shared memory: the queries, then their 16-bit swizzled form (the copy lands in unswizzled rows: copied
straight into the swizzled tile, Mosaic GPU's layout inference found no layouts for the kernel) share
one ``[64, D]`` piece; the K slots, after the last tile, the output's swizzled tile. With two slots (the
default) a program takes 81 KiB over bf16 at ``D`` 128 (two a multiprocessor; one slot, 49 KiB, was
faster at contexts up to 128 and slower from 256 on, and the engine's block tables are as wide as its
longest context) and 54 KiB over fp8.

The output is written in place, as the query tiles': ``O^T`` is stored transposed into a swizzled ``[64,
D]`` tile (a transposed store into unswizzled memory does not lower), read back row-major into the
queries' unswizzled rows, and the token's ``G`` rows go to ``o [T Hq, D]`` (a padding token's program
writes zeros). With split-K the programs write fp32 ``O^T`` partials and log-sum-exps, which XLA merges
into ``[T, Hq, D]``. Same arithmetic as the query tiles, to the order of the f32 sums (over fp8 their V
scaling is by another power of two, so P rounds to the same f16 wherever both stay within f16's normal
range).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels import lowered_once
from jaxpaged.kernels.fp8 import exponent_range, is_fp8
from jaxpaged.kernels.kv_write import block_size_of
from jaxpaged.kernels.mosaic.common import BLOCK_M, LOG2E, MASKED, TMA_ALIGN, transforms
from jaxpaged.kernels.mosaic.fp8 import copy_fp8_block, f16_queries, fp8_block_copies, scales_f32
from jaxpaged.kernels.mosaic.layout import split_range, token_layout
from jaxpaged.kernels.split_k import merge_splits


def v_shift(dtype) -> int | None:
    """The power of two ``c`` that ``P^T`` times its V scales is multiplied by before rounding to f16, or
    ``None`` where no constant works. ``P <= 1`` times a scale must stay within f16's normal range
    (2^-14 .. 2^15): e4m3's scales (2^-9 .. 2^8, kernels/fp8.py) times 2^7 do, for every ``P`` down to
    2^-12; e5m2's (2^-16 .. 2^15) span more than f16 holds beside ``P``, so each of its tiles divides by
    the tile's largest V scale instead (one more reduction over the keys a tile)."""
    lo, hi = exponent_range(dtype)
    shift = 15 - hi
    return shift if lo + shift >= -2 else None


def _tile(shape, dtype):
    """A shared-memory tile wgmma reads (the query tiles' tiling and swizzle)."""
    return plgpu.SMEM(shape, dtype, transforms=transforms(dtype, shape[-1]))


def _column(vec_smem, n):
    """``n`` f32 values from shared memory as a row vector of a ``[64, n]`` WGMMA array (one a column)."""
    return plgpu.load(vec_smem.at[pl.ds(0, n)], layout=plgpu.Layout.WGMMA.reduce(0))


def _decode_kernel(layer_ref, meta_ref, tables_ref, q_ref, kv_ref, o_ref, lse_ref=None, *, q_bar, k_bar, v_bar,
                   q_union, k_union, v_slots, pt_smem, qs_smem=None, scales=None, lse_smem=None, k16=None,
                   vt16=None, scale_log2: float, group: int, rows: int, block_kv: int, num_slots: int,
                   num_splits: int, v_shift: int | None):
    """Refs: ``q_ref [T Hq (+ pad), D]`` bf16; ``kv_ref [L, N, bs, 2, Hkv, D]`` bf16 (``v_slots``: V tiles
    ``[slots, block_kv, D]``) or ``[L, N, bs + 1, 2, Hkv, D]`` fp8 (``scales`` given; ``v_slots``: ``V^T``
    tiles ``[slots, D, bs]``); ``o_ref [T Hq, D]`` bf16, or ``f32[P, T, Hkv, D, R]`` and ``lse_ref
    f32[P, T, Hkv, R]``. Columns ``c`` of a program's output are query rows ``first + c`` of ``q``
    (``first``: the token's first row, moved back near the end of ``q`` so that ``R`` rows fit; its ``G``
    rows start at column ``row0 - first``)."""
    fp8 = scales is not None
    q_plain, q_op16, out_smem = q_union  # one piece of memory: the queries, then their 16-bit tile, then the output
    k_slots, o_tile = k_union  # the keys' slots, then (after the last tile) the output
    wgmma = plgpu.Layout.WGMMA
    head_dim = k_slots.shape[-1]
    block_size = kv_ref.shape[2] - (1 if fp8 else 0)  # (an fp8 block's last row holds its scales)
    blocks_per_tile = block_kv // block_size
    width = tables_ref.shape[1]
    split = lax.axis_index("split") if num_splits > 1 else 0
    h = lax.axis_index("kv_head")
    tile = lax.axis_index("tile")
    seq = meta_ref[tile, 0]
    kv_end = meta_ref[tile, 2]
    lo, hi = split_range(kv_end, split, block_kv, num_splits)
    row0 = (tile * kv_ref.shape[4] + h) * group
    first = jnp.minimum(row0, q_ref.shape[0] - rows)

    @pl.when(jnp.logical_and(seq >= 0, lo < hi))
    def _owned():
        layer = layer_ref[0]

        def fetch(t, slot):
            if fp8:
                copy_fp8_block(kv_ref, layer, tables_ref[seq, jnp.minimum(t, width - 1)], h, slot, k_slots, v_slots,
                               scales, k_bar, v_bar)
                return
            for b in range(blocks_per_tile):
                phys = tables_ref[seq, jnp.minimum(t * blocks_per_tile + b, width - 1)]  # past the table: masked
                part = pl.ds(b * block_size, block_size)
                plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, 0, h, :], k_slots.at[slot, part], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, 1, h, :], v_slots.at[slot, part], v_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first, rows)], q_plain.at[pl.ds(0, rows)], q_bar)
        fetch(lo, 0)
        for i in range(1, num_slots):
            pl.when(lo + i < hi)(functools.partial(fetch, lo + i, i))

        # The queries as wgmma's N operand. Over fp8, each row times the power of two that brings its
        # largest element near 2^14, in f16; the inverse (times the softmax scale, base 2) multiplies
        # that row's score column.
        plgpu.barrier_wait(q_bar)
        q_rows = plgpu.load(q_plain, layout=wgmma)  # rows past R: stale, never used
        plgpu.commit_smem()  # (a warpgroup barrier: every warp has read q_plain before q_op16 overwrites it)
        if fp8:
            q_op16[...], qs_smem[...] = f16_queries(q_rows.astype(jnp.float32), scale_log2)
        else:
            q_op16[...] = q_rows
        plgpu.commit_smem()
        q_op = q_op16.at[pl.ds(0, rows)].transpose((1, 0))  # [D, R]
        q_unscale = _column(qs_smem, rows) if fp8 else None
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=wgmma)
        shape = (block_kv, rows)

        def step(t, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(t - lo, num_slots)
            plgpu.barrier_wait(k_bar.at[slot])
            k_op = k_slots.at[slot]
            if fp8:
                k_op = plgpu.load(k_op, layout=wgmma).astype(jnp.float16)  # [bs, D]
                if k16 is not None:  # the interpreter's wgmma reads shared memory only
                    k16[...] = k_op
                    plgpu.commit_smem()
                    k_op = k16

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, k_op, q_op)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))  # S^T: a row per key
            plgpu.barrier_wait(v_bar.at[slot])  # the values (over fp8, V^T and the V scales)
            live = t * block_kv + iota(shape, 0) < kv_end if masked else None
            if fp8:
                vt = plgpu.load(v_slots.at[slot], layout=wgmma).astype(jnp.float16)  # [D, bs]
                vs = scales_f32(scales.at[slot, 1], shape, key_axis=0)
                s = s * scales_f32(scales.at[slot, 0], shape, key_axis=0)
                s = s * lax.broadcast_in_dim(q_unscale, shape, [1])
                if masked:
                    vt = jnp.where(t * block_kv + iota(vt.shape, 1) < kv_end, vt, jnp.zeros((), vt.dtype))
                    vs = jnp.where(live, vs, 0.0)  # (a stale scale may be NaN)
            else:
                s = s * scale_log2
                if masked:
                    v_key = t * block_kv + iota((block_kv, head_dim), 0)
                    v_slots[slot] = jnp.where(v_key < kv_end, v_slots[slot], jnp.zeros((), v_slots.dtype))
                vt = v_slots.at[slot].transpose((1, 0))  # [D, block_kv]
            if masked:
                s = jnp.where(live, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=0))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [1]))
            l_new = l_i * lax.broadcast_in_dim(alpha, shape, [1]) + p  # summed over the keys after the last tile
            if fp8 and v_shift is not None:
                p = p * (vs * float(2.0 ** v_shift))
            elif fp8:
                v_max = vs.max(axis=0)  # the tile's largest V scale, in every column
                v_max = jnp.where(v_max > 0, v_max, 1.0)
                p = p * vs * lax.broadcast_in_dim(1.0 / v_max, shape, [1])
            pt_smem.transpose((1, 0))[...] = p.astype(pt_smem.dtype)  # P^T [block_kv, R] into the [R, block_kv] tile
            if vt16 is not None:
                vt16[...] = vt
                vt = vt16
            plgpu.commit_smem()  # P^T (and the zeroed values, or V^T in the interpreter) visible to wgmma

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, vt, pt_smem.transpose((1, 0)))
                return acc_ref[...]

            o = pl.run_scoped(pv, plgpu.ACC((head_dim, rows), jnp.float32))

            @pl.when(t + num_slots < hi)
            def _():
                fetch(t + num_slots, slot)

            wide = lambda x: lax.broadcast_in_dim(x, acc.shape, [1])  # noqa: E731
            acc = acc * wide(alpha) + (o * wide(v_max) if fp8 and v_shift is None else o)
            return acc, m_new, l_new

        carry = (plgpu.layout_cast(jnp.zeros((head_dim, rows), jnp.float32), wgmma),
                 plgpu.layout_cast(jnp.full((rows,), MASKED, jnp.float32), wgmma.reduce(0)),
                 plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma))
        n_full = jnp.clip(lax.div(meta_ref[tile, 1] + 1, block_kv), lo, hi)
        carry = lax.fori_loop(lo, n_full, functools.partial(step, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), carry)
        l_i = l_i.sum(axis=0)
        if fp8 and v_shift is not None:
            acc = acc * float(2.0 ** -v_shift)
        has = l_i > 0
        out = acc / lax.broadcast_in_dim(jnp.where(has, l_i, 1.0), acc.shape, [1])
        if num_splits == 1:  # this token's G rows, in place (O^T transposed through a swizzled tile)
            o_tile.at[pl.ds(0, rows)].transpose((1, 0))[...] = out.astype(o_tile.dtype)
            plgpu.commit_smem()
            q_plain[...] = plgpu.load(o_tile, layout=wgmma)  # (rows past R: stale, never copied)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_plain.at[pl.ds(row0 - first, group)], o_ref.at[pl.ds(row0, group)])
        else:
            out_smem[...] = out
            lse_smem[...] = jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)) * LOG2E, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, o_ref.at[split, tile, h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, tile, h])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if num_splits == 1:
        @pl.when(seq < 0)  # a padding token: zeros (with splits, the merge masks what no split wrote)
        def _padding_token():
            q_plain[...] = plgpu.layout_cast(jnp.zeros(q_plain.shape, q_plain.dtype), wgmma)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_plain.at[pl.ds(0, group)], o_ref.at[pl.ds(row0, group)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def query_rows(q: jax.Array, num_kv_heads: int) -> tuple[int, int, jax.Array]:
    """A program's queries as wgmma's ``N`` columns: ``G``, ``R`` (``G`` rounded up to 8) and the
    queries as rows ``[T Hq, D]``, padded to at least ``R`` rows (a program reads ``R`` rows from its
    first, moved back near the end where needed)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    rows = -(-group // 8) * 8
    q_in = q.reshape(num_tokens * num_q_heads, head_dim)
    if q_in.shape[0] < rows:
        q_in = jnp.pad(q_in, ((0, rows - q_in.shape[0]), (0, 0)))
    return group, rows, q_in


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_kv", "num_slots", "num_splits"))
def paged_decode_mgpu(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale: float, interpret,
                      block_kv: int, num_slots: int, num_splits: int):
    """Decode attention, a program a token and KV head (and split), over a bf16 or fp8 pool; arguments as
    ``attention.paged_attention_mgpu`` after its validation (``layer`` an
    ``i32[]``, ``interpret`` ``None`` or ``InterpretGPUParams``; over fp8 ``block_kv`` is the block size).
    Returns ``[T, Hq, D]`` bf16, padding tokens zero."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    fp8 = is_fp8(kv_pool.dtype)
    assert not fp8 or block_kv == block_size_of(kv_pool), "over fp8 a KV tile is one pool block"
    group, rows, q_in = query_rows(q, num_kv_heads)
    meta = token_layout(cu_q_lens, kv_lens, num_tokens)
    op16 = jnp.float16 if fp8 else q.dtype  # the operands wgmma reads
    if fp8:
        staged = lambda shape: plgpu.SMEM(shape, kv_pool.dtype, transforms=(plgpu.SwizzleTransform(shape[-1]),))  # noqa: E731
        k_copies, v_copies = fp8_block_copies(head_dim, block_kv)
        k_slots, v_slots = staged((num_slots, block_kv, head_dim)), staged((num_slots, head_dim, block_kv))
    else:
        k_copies = v_copies = block_kv // block_size_of(kv_pool)
        k_slots, v_slots = _tile((num_slots, block_kv, head_dim), q.dtype), _tile((num_slots, block_kv, head_dim), q.dtype)
    scratch = dict(
        q_bar=plgpu.Barrier(num_arrivals=1),
        k_bar=plgpu.Barrier(num_arrivals=k_copies, num_barriers=num_slots),
        v_bar=plgpu.Barrier(num_arrivals=v_copies, num_barriers=num_slots),
        q_union=plgpu.RefUnion(plgpu.SMEM((BLOCK_M, head_dim), q.dtype), _tile((BLOCK_M, head_dim), op16),
                               plgpu.SMEM((head_dim, rows), jnp.float32)),
        k_union=plgpu.RefUnion(k_slots, _tile((BLOCK_M, head_dim), q.dtype)),
        v_slots=v_slots,
        pt_smem=_tile((rows, block_kv), op16),
    )
    if fp8:
        scratch.update(qs_smem=plgpu.SMEM((BLOCK_M,), jnp.float32),
                       scales=plgpu.SMEM((num_slots, 2, max(block_kv, TMA_ALIGN)), kv_pool.dtype))
        if interpret is not None:
            scratch.update(k16=_tile((block_kv, head_dim), jnp.float16), vt16=_tile((head_dim, block_kv), jnp.float16))
    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), q.dtype)
    else:
        scratch["lse_smem"] = plgpu.SMEM((rows,), jnp.float32)
        out_type = (jax.ShapeDtypeStruct((num_splits, num_tokens, num_kv_heads, head_dim, rows), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, num_tokens, num_kv_heads, rows), jnp.float32))
    build = functools.partial(  # (picklable: lowered_once may build it in a worker)
        plgpu.kernel,
        functools.partial(_decode_kernel, scale_log2=scale * LOG2E, group=group, rows=rows, block_kv=block_kv,
                          num_slots=num_slots, num_splits=num_splits,
                          v_shift=v_shift(kv_pool.dtype) if fp8 else None),
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_kv_heads, num_tokens) + ((num_splits,) if num_splits > 1 else ()),
        grid_names=("kv_head", "tile") + (("split",) if num_splits > 1 else ()),
        interpret=interpret,
        kernel_name="paged_decode_fp8" if fp8 else "paged_decode",  # (profiles name it)
    )
    out = lowered_once.launch(build, jnp.reshape(layer, (1,)), meta, block_tables, q_in, kv_pool, interpret=interpret)
    if num_splits == 1:
        return out.reshape(num_tokens, num_q_heads, head_dim)  # padding tokens: zeros, written by the kernel

    # Split (p, t, h)'s G columns start at row0 - first (nonzero only near the end of q).
    t = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    h = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :]
    row0 = (t * num_kv_heads + h) * group
    col = (row0 - jnp.minimum(row0, q_in.shape[0] - rows))[..., None] + jnp.arange(group, dtype=jnp.int32)

    def heads(x):  # [..., T, Hkv, D, R] -> [..., T, Hkv, G, D]
        x = jnp.swapaxes(x, -1, -2)
        return jnp.take_along_axis(x, jnp.broadcast_to(col[..., None], x.shape[:-4] + col.shape + (1,)), axis=-2)

    owned = meta[:, 0] >= 0
    o_parts, lse = out
    split = jnp.arange(num_splits, dtype=jnp.int32)[:, None]
    lo, hi = split_range(meta[None, :, 2], split, block_kv, num_splits)
    wrote = ((lo < hi) & owned[None, :])[:, :, None, None]  # [P, T, 1, 1]
    lse = jnp.take_along_axis(lse, jnp.broadcast_to(col, lse.shape[:1] + col.shape), axis=-1)  # [P, T, Hkv, G]
    lse = jnp.where(wrote, lse, -jnp.inf).reshape(num_splits, num_tokens, num_q_heads)
    o_parts = jnp.where(wrote[..., None], heads(o_parts), 0.0).reshape(num_splits, num_tokens, num_q_heads, head_dim)
    return merge_splits(o_parts, lse, q.dtype)
