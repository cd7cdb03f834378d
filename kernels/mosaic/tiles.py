"""The one-warpgroup Mosaic GPU attention kernel: query tiles of a sequence and a KV head, wgmma.

It runs the decode-shaped and short launches of :func:`jaxpaged.kernels.mosaic.attention.paged_attention_mgpu`
(read that module for the contract and the choice between kernels), and the sequences of one new token in
a prefill launch (:func:`one_token_rows`).

How the work is cut (the arrays that say so: ``layout.py``):
  * A program owns one *query tile* of one sequence for one KV head: up to ``block_q = 64 // G``
    consecutive new tokens (32 at most: a barrier a token, :data:`MAX_TILE_TOKENS`) times the
    ``G = Hq // Hkv`` query heads that read that KV head, at most 64 rows: Hopper's wgmma has a
    fixed M of 64 per warpgroup, so one program is one warpgroup, its matmuls always 64 rows (those
    past its tokens' padding), and every K/V tile it loads serves all its rows. Grid ``(Hkv, tiles)``,
    the KV head fastest, so the programs of one query tile read neighbouring bytes of each pool block.
    Sequence ``i`` owns tiles ``cu_q_lens[i] // block_q + i + j`` for ``j < cdiv(q_len_i, block_q)``
    (the Triton kernel's numbering: ``cdiv(T, block_q) + S`` tiles bound it; unowned tiles exit at
    once), and the padding tokens are tiled the same way, as one more sequence whose tiles write zeros
    (:func:`tile_layout`). A decode sequence is one tile of one token;
    a prompt chunk is ``cdiv(q_len, block_q)`` tiles whatever the launch's shapes: a step of a
    many-slot engine pads to as many sequences as tokens, so its launches of up to 512 tokens are
    decode-shaped, prompt chunks after long cached prefixes included, and a tile of one token would
    read the whole prefix once a token.
  * Queries and outputs stay where they are: token ``j`` of a tile arrives by its own TMA copy of
    ``q[tok0 + j, hG:(h + 1)G]`` into rows ``[j G, (j + 1) G)`` of a ``[64, D]`` shared-memory tile,
    on a barrier of its own (a decode tile issues and waits for one copy; copies that arrive on one
    barrier would need a static count), and wgmma reads the rows from registers (a swizzled tile
    takes TMA copies only at rows that are multiples of 8, so these rows are unswizzled). Rows past
    the tile's tokens stay stale: each row's softmax is its own, and only the tile's rows are stored.
    The outputs leave a token's ``G`` rows at a time, to the output or with split-K to its ``[P, T,
    Hq, D]`` partials, which the merge reads in token order: no XLA gather relays the queries into
    tiles or the outputs back, which would cost a short decode launch more than its kernel.
    The same tiles, a tile a sequence, compute the sequences of one new token in a prefill launch at
    GQA groups of 4 or more (:func:`one_token_rows`).
  * KV tiles of ``block_kv`` tokens (default ``max(64, block_size)``): ``block_kv / block_size`` pool
    blocks, each one TMA copy of its ``[block_size, D]`` keys (``pool[layer, id, :, 0, h, :]``, rows
    strided by ``2 * Hkv * D``) and one of its values into a shared-memory slot, the physical block ids
    read as scalars from ``block_tables`` inside the kernel. All copies of a tile arrive on one barrier
    (``num_arrivals`` = copies per tile). ``num_slots`` slots (default 2): the copies of tile
    ``t + num_slots`` are issued as soon as tile ``t`` is consumed, so transfers overlap the
    arithmetic of the tiles before them. Without split-K the output tile reuses Q's shared memory.
  * Split-K (``num_splits > 1``, by default for decode launches whose tiles, counted from the
    tokens (a launch's padded sequences overstate a prompt chunk's), are too few to fill the GPU:
    :func:`choose_splits`): a tile's KV tiles are cut into ``num_splits`` contiguous ranges
    (:func:`split_range`); each (tile, range) item writes its range's output, normalised by its own
    softmax sum, in fp32 with the log-sum-exp, and ``split_k.merge_splits`` (XLA) combines them. The
    launch is persistent: a few programs a KV head take the items that have keys in turn
    (:func:`work_list`), so splits chosen for a long context cost a short one nothing. Splits with an
    empty range are not in the list and write nothing; the merge masks them.
  * ``S = Q K^T`` is one wgmma (``[64, D] x [D, block_kv]``, K's shared-memory tile read
    transposed); softmax online in fp32 and base 2 (running max and sum per row); ``P`` is cast to
    the pool dtype and ``P V`` is a second wgmma (``[64, block_kv] x [block_kv, D]``) with ``P`` from
    registers (in the interpreter, whose wgmma reads shared memory only, from a shared-memory tile),
    rescaled into the fp32 accumulator (``P`` from registers needs no store and no fence, and is the
    faster of the two, docs/DECISIONS.md).
  * Masking: tiles wholly at or before the tile's first query position (every row sees every key)
    take an unmasked path. The others (the causal diagonal and the ``kv_len`` tail; a decode tile has
    at most one) set the scores of keys past each row's position (or past the tile's last needed key,
    ``kv_end``) to ``-inf`` with a select, and zero the values of keys at or past ``kv_end`` in shared
    memory before ``P V``: TMA copies whole blocks, the tail of the last block may be stale NaN, and
    ``P = 0`` times ``NaN`` would still be NaN. Keys are never multiplied by a mask, only selected.
    Blocks past a sequence's last block are read at a clipped table column (in range by contract) and
    fully masked.

Scope: ``G <= 64``; one warpgroup per program (a decode tile fills ``G`` of its 64 rows), whole blocks
copied for the last KV tile. Over an fp8 pool a KV tile is one pool block (``fp8.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels import lowered_once
from jaxpaged.kernels.fp8 import is_fp8
from jaxpaged.kernels.kv_write import block_size_of
from jaxpaged.kernels.mosaic.common import BLOCK_M, LOG2E, MASKED, NUM_SLOTS, SMEM_BYTES, TMA_ALIGN, kv_tile, transforms
from jaxpaged.kernels.mosaic.fp8 import copy_fp8_block, f16_queries, fp8_block_copies, scales_f32
from jaxpaged.kernels.mosaic.layout import one_token_layout, split_range, tile_layout, work_list
from jaxpaged.kernels.shapes import num_cores
from jaxpaged.kernels.split_k import merge_splits

MAX_TILE_TOKENS = 32  # a query tile's tokens at most: one barrier each, and Mosaic GPU initialises 32 a group
LSE_LANES = 32  # a split program's log-sum-exp, copied to each lane of a 128-byte row: TMA copies out of
# shared memory from 128-byte aligned addresses, and a program's rows start at any row of its tile
INTERPRET_PROGRAMS = 2  # programs a KV head of an interpreted split launch (each takes several items)


def smem_bytes(head_dim: int, block_kv: int, num_slots: int, dtype, split: bool = False,
               p_in_smem: bool = False, fp8: bool = False) -> int:
    """Shared memory of one program, at most: the Q (later output) tile, ``num_slots`` K and V tiles (of an
    fp8 pool: ``num_slots`` fp8 tiles and their scales, and one f16 tile, K's then V^T's),
    with split-K the fp32 partial and its log-sum-exp (an upper bound: the kernel puts those in the
    slots' memory), and in the interpreter P (barriers aside)."""
    kv_tiles = 1 if fp8 else 2 * num_slots
    tiles = (BLOCK_M * head_dim + kv_tiles * block_kv * head_dim + BLOCK_M * block_kv * p_in_smem)
    staged = num_slots * 2 * (block_kv * head_dim + max(block_kv, TMA_ALIGN)) if fp8 else 0  # one byte an element
    return tiles * jnp.dtype(dtype).itemsize + staged + (BLOCK_M * head_dim + BLOCK_M) * 4 * split


def _attention_kernel(layer_ref, meta_ref, tables_ref, q_ref, kv_ref, *refs, q_bar, k_bar, v_bar,
                      q_plain, k_smem=None, v_smem=None, kv_then_out=None, q_smem=None, p_smem=None,
                      fp8_union=None, q16_smem=None, scale_log2: float, group: int, block_kv: int,
                      block_size: int, num_slots: int, num_splits: int, by_sequence: bool = False,
                      num_programs: int = 0):
    """One program: KV head ``h = axis_index("kv_head")`` and query tile ``axis_index("tile")``; with
    ``num_splits > 1`` (``num_programs`` given) program ``axis_index("program")`` of a persistent launch,
    taking items ``(tile, split)`` of ``work_ref`` (:func:`work_list`) in turn.

    Refs (GMEM): ``layer_ref i32[1]``, ``meta_ref i32[tiles, 4]`` (:func:`tile_layout`),
    ``tables_ref i32[S, W]``, the queries where they are, ``q_ref [T, Hq, D]``, ``kv_ref [L, N, bs, 2,
    Hkv, D]``, with splits ``work_ref i32[tiles P + 1, 2]``; outputs ``o_ref [T, Hq, D]``, or with
    splits ``o_ref f32[P, T, Hq, D]`` (each split's
    normalised partial) and ``lse_ref f32[P, T, Hq, LSE_LANES]`` (its log-sum-exp, base 2, in each
    lane). Token ``j < ntok`` of the tile comes by its own TMA copy (heads ``[h G, (h + 1) G)``) into
    rows ``[j G, (j + 1) G)``, on barrier ``q_bar[j]`` (one a token of the largest tile); its outputs
    leave a token at a time. With ``by_sequence`` (:func:`one_token_rows`), ``meta_ref
    i32[S, 4]`` (:func:`one_token_layout`) and tiles of one token: tile ``i`` reads the queries of token
    ``meta_ref[i, 3]`` and writes row ``i`` of outputs ``[S, Hq, D]``.
    A tile without a sequence but with tokens (padding tokens; by sequence, the sequences of several
    new tokens) writes zeros there (with splits nothing: the merge masks it).

    Shared memory (keyword refs): ``q_plain [64, D]`` unswizzled (a swizzled tile takes TMA copies
    only at rows that are multiples of 8): the queries land there, wgmma reads them from registers, and
    the output leaves from there; ``k_smem/v_smem [slots, block_kv, D]``; barriers ``q_bar[tokens]``,
    ``k_bar[slots]``, ``v_bar[slots]``. With splits ``kv_then_out`` (or the third part of
    ``fp8_union``): the slots, then ``o32_smem f32[64, D]`` and ``lse_smem f32[64, LSE_LANES]`` in the
    same memory. In the interpreter (its wgmma reads shared memory only) ``q_smem [64, D]`` and
    ``p_smem [64, block_kv]``, swizzled, for ``Q`` and ``P``.

    An fp8 pool (``fp8_union`` given; one pool block a KV tile; module docstring): the slots are
    ``k8_smem [slots, block_kv, D]`` (keys as stored), ``vt8_smem [slots, D, block_kv]`` (values
    transposed, as stored) and ``scale_smem [slots, 2, >= block_kv]`` (the block's K and V scale rows,
    each at a ``TMA_ALIGN``-byte boundary); ``k_smem f16[block_kv, D]`` and ``v_smem f16[D, block_kv]``
    (``V^T``) share one piece of memory, the keys converted for ``Q K^T``, then the values for ``P V``;
    in the interpreter ``q16_smem`` holds the f16 queries and ``p_smem`` is f16.
    """
    o32_smem = lse_smem = None
    if kv_then_out is not None:  # one piece of shared memory: the K/V slots, then the split's output
        (k_smem, v_smem), (o32_smem, lse_smem) = kv_then_out
    fp8 = fp8_union is not None
    if fp8:  # one piece: the fp8 slots and the f16 K tile; the f16 V^T tile; [the split's output]
        (k_smem, k8_smem, vt8_smem, scale_smem), (v_smem,), *out_part = fp8_union
        if out_part:
            (o32_smem, lse_smem), = out_part
    if num_programs:  # with splits: a work list (tile, split) of the non-empty items, its count first
        work_ref, o_ref, lse_ref = refs
    else:
        (o_ref, lse_ref), work_ref = (refs + (None,))[:2], None
    head_dim = k_smem.shape[-1]
    width = tables_ref.shape[1]
    blocks_per_tile = block_kv // block_size
    h = lax.axis_index("kv_head")

    def item(tile, split):
        """Query tile ``tile``'s KV split ``split``: its outputs (or its split's partial)."""
        seq = meta_ref[tile, 0]
        pos0 = meta_ref[tile, 1]
        kv_end = meta_ref[tile, 2]
        tok0 = meta_ref[tile, 3]
        ntok = kv_end - pos0
        lo, hi = split_range(kv_end, split, block_kv, num_splits)
        out0 = tile if by_sequence else tok0  # the output row of its first token
        heads = pl.ds(h * group, group)

        def store_rows(src, dst, lead=()):
            """The tile's tokens' ``G`` rows of ``src`` (shared memory, token ``j`` at rows ``j G``) to ``dst``."""
            def one(j, carry):
                plgpu.copy_smem_to_gmem(src.at[pl.ds(j * group, group)], dst.at[(*lead, out0 + j, heads)])
                return carry

            lax.fori_loop(0, ntok, one, 0)

        @pl.when(jnp.logical_and(seq >= 0, lo < hi))  # an unowned tile, or an empty split: nothing to do
        def _owned_tile():
            layer = layer_ref[0]
            n_full = jnp.clip(lax.div(pos0 + 1, block_kv), lo, hi)  # tiles every row sees entirely end here

            def fetch(t, slot):
                """Issues the TMA copies of KV tile ``t`` into ``slot``: one per pool block, K and V."""
                if fp8:  # one block: its keys, its values' D / block_size boxes of V^T rows, its two scale rows
                    copy_fp8_block(kv_ref, layer, tables_ref[seq, jnp.minimum(t, width - 1)], h, slot, k8_smem, vt8_smem,
                                   scale_smem, k_bar, v_bar)
                    return
                for b in range(blocks_per_tile):
                    blk = jnp.minimum(t * blocks_per_tile + b, width - 1)  # past the table: masked anyway
                    phys = tables_ref[seq, blk]
                    rows = pl.ds(b * block_size, block_size)
                    plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, 0, h, :], k_smem.at[slot, rows],
                                            k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, 1, h, :], v_smem.at[slot, rows],
                                            v_bar.at[slot])

            def copy_token(j):
                """Token ``j`` of the tile, heads [h G, (h + 1) G), to rows [j G, (j + 1) G), on ``q_bar[j]``."""
                plgpu.copy_gmem_to_smem(q_ref.at[tok0 + j, heads], q_plain.at[pl.ds(j * group, group)], q_bar.at[j])

            # Rows past the tile's tokens stay stale: each row's softmax is its own, and only its rows are stored.
            # The tile's other tokens by loops to ntok: unrolled to the largest tile under conditions (31
            # twice at G = 2), a decode tile of one token would pay for them all.
            copy_token(0)
            pl.loop(1, ntok)(copy_token)
            fetch(lo, 0)  # the range is not empty; tile lo + i goes to slot i
            for i in range(1, num_slots):
                pl.when(lo + i < hi)(functools.partial(fetch, lo + i, i))

            plgpu.barrier_wait(q_bar.at[0])
            pl.loop(1, ntok)(lambda j: plgpu.barrier_wait(q_bar.at[j]))
            q_op = plgpu.load(q_plain, layout=plgpu.Layout.WGMMA)  # wgmma's A operand from registers
            q_unscale = scale_log2  # what multiplies Q K^T: the softmax scale (base 2), over fp8 each row's own
            if fp8:  # Q in f16, each row times the power of two that brings its largest element near 2^14
                q_op, q_unscale = f16_queries(q_op.astype(jnp.float32), scale_log2)
                if q16_smem is not None:  # the interpreter: through a swizzled tile
                    q16_smem[...] = q_op
                    plgpu.commit_smem()
                    q_op = q16_smem
            elif q_smem is not None:  # the interpreter: through a swizzled tile
                q_smem[...] = q_op
                plgpu.commit_smem()
                q_op = q_smem

            def step(t, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(t - lo, num_slots)
                wgmma_iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)
                plgpu.barrier_wait(k_bar.at[slot])
                if fp8:  # keys as stored, converted exactly to f16; their scales multiply the scores' columns
                    k_smem[...] = plgpu.load(k8_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float16)
                    plgpu.commit_smem()  # visible to wgmma
                    k_op = k_smem.transpose((1, 0))
                else:
                    k_op = k_smem.at[slot].transpose((1, 0))

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_op, k_op)
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((BLOCK_M, block_kv), jnp.float32))
                if fp8:
                    s = s * lax.broadcast_in_dim(q_unscale, s.shape, [0]) * scales_f32(scale_smem.at[slot, 0], s.shape)
                else:
                    s = s * q_unscale
                plgpu.barrier_wait(v_bar.at[slot])
                if masked:
                    key = t * block_kv + wgmma_iota((BLOCK_M, block_kv), 1)
                    # row r is token r // G of the tile, at position pos0 + r // G; rows past its tokens see
                    # what its last token sees, at most (their outputs are dropped)
                    row_tok = lax.div(wgmma_iota((BLOCK_M, block_kv), 0), group)
                    last_key = jnp.minimum(pos0 + row_tok, kv_end - 1)
                    visible = key <= last_key
                    s = jnp.where(visible, s, -jnp.inf)
                # Values at or past kv_end may be stale NaN: zeroed (P = 0 there, but 0 * NaN = NaN).
                if fp8:  # values (V^T) as stored, converted exactly to f16 (k_smem's memory: Q K^T is done)
                    vt = plgpu.load(vt8_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float16)
                    if masked:
                        vt = jnp.where(t * block_kv + wgmma_iota(vt.shape, 1) < kv_end, vt, jnp.zeros((), vt.dtype))
                    v_smem[...] = vt
                    v_op = v_smem.transpose((1, 0))  # [block_kv, D]
                else:
                    if masked:
                        v_key = t * block_kv + wgmma_iota((block_kv, head_dim), 0)
                        v_smem[slot] = jnp.where(v_key < kv_end, v_smem[slot], jnp.zeros((), v_smem.dtype))
                    v_op = v_smem.at[slot]
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_new = l_i * alpha + p.sum(axis=1)
                if fp8:  # P's columns times their V scales over the row's largest, so P stays in [0, 1] for f16
                    v_scale = scales_f32(scale_smem.at[slot, 1], s.shape)
                    if masked:
                        v_scale = jnp.where(visible, v_scale, 0.0)  # (a stale scale may be NaN)
                    v_max = v_scale.max(axis=1)
                    v_max = jnp.where(v_max > 0, v_max, 1.0)  # powers of two: dividing is exact
                    p = p * v_scale * lax.broadcast_in_dim(1.0 / v_max, s.shape, [0])
                p_dtype = jnp.float16 if fp8 else v_smem.dtype
                if p_smem is None:
                    p_op = p.astype(p_dtype)
                    if masked or fp8:
                        plgpu.commit_smem()  # the values written visible to wgmma (it reads through the async proxy)
                else:
                    p_smem[...] = p.astype(p_smem.dtype)
                    plgpu.commit_smem()  # P (and masked V) visible to wgmma, which reads through the async proxy
                    p_op = p_smem

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_op, v_op)
                    return acc_ref[...]

                o = pl.run_scoped(pv, plgpu.ACC((BLOCK_M, head_dim), jnp.float32))
                if fp8:
                    o = o * lax.broadcast_in_dim(v_max, o.shape, [0])

                @pl.when(t + num_slots < hi)  # the slot is consumed: refill it
                def _():
                    fetch(t + num_slots, slot)

                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o, m_new, l_new

            rows = plgpu.Layout.WGMMA.reduce(1)
            carry = (
                plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((BLOCK_M,), MASKED, jnp.float32), rows),
                plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), rows),
            )
            carry = lax.fori_loop(lo, n_full, functools.partial(step, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), carry)
            has = l_i > 0
            out = acc / lax.broadcast_in_dim(jnp.where(has, l_i, 1.0), acc.shape, [0])
            lse = None if num_splits == 1 else jnp.where(has, m_i + jnp.log(jnp.where(has, l_i, 1.0)) * LOG2E, -jnp.inf)
            if num_splits == 1:
                q_plain[...] = out.astype(q_plain.dtype)  # Q is done (it is in registers, or in q_smem)
                plgpu.commit_smem()
                store_rows(q_plain, o_ref)
            else:  # the fp32 partial and its log-sum-exp, in LSE_LANES lanes (TMA leaves at 128-byte rows)
                o32_smem[...] = out
                lse_smem[...] = lax.broadcast_in_dim(lse, lse_smem.shape, [0])
                plgpu.commit_smem()
                store_rows(o32_smem, o_ref, (split,))
                store_rows(lse_smem, lse_ref, (split,))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        if num_splits == 1:
            @pl.when(jnp.logical_and(seq < 0, ntok > 0))  # padding tokens (by sequence, other sequences): zeros
            def _zeros():
                q_plain[...] = plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), q_plain.dtype), plgpu.Layout.WGMMA)
                plgpu.commit_smem()
                store_rows(q_plain, o_ref)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if work_ref is None:
        item(lax.axis_index("tile"), lax.axis_index("split") if num_splits > 1 else 0)
    else:  # items prog, prog + N, ... of the list: empty splits and unowned tiles are not in it
        prog = lax.axis_index("program")
        count = work_ref[0, 0]

        @pl.loop(0, lax.div(jnp.maximum(count - prog + (num_programs - 1), 0), num_programs))
        def _(j):
            i = 1 + prog + j * num_programs
            item(work_ref[i, 0], work_ref[i, 1])


def one_token_rows(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale: float, interpret) -> jax.Array:
    """The outputs of the sequences that have one new token, ``[S, Hq, D]`` in sequence order (zeros
    for the others), by the decode tiles: a program a (sequence, KV head) computes that token's ``G``
    query heads in one wgmma tile, reading its queries in place. The prefill kernel (``prefill.py``)
    leaves such sequences (the decode rows of a mixed step) to this launch where ``G`` is at least its
    ``DECODE_TILES_MIN_GROUP``: its items are a query head each, so a one-token sequence would cost it
    ``G`` programs' arithmetic, one a head, for every KV head's keys. Unsplit: where a prefill launch
    has no such sequences every program exits at once, and split-K's merge would be one more kernel.
    ``layer`` an ``i32[]``, the rest validated by ``attention.paged_attention_mgpu``; the decode
    launches' KV tile and slots."""
    block_kv = kv_tile(block_size_of(kv_pool))
    return paged_attention_tiles(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, scale=scale, interpret=interpret,
                                 block_kv=block_kv, num_slots=NUM_SLOTS, block_q=1, num_splits=1, by_sequence=True)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_kv", "num_slots", "block_q", "num_splits",
                                             "by_sequence"))
def paged_attention_tiles(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale, interpret, block_kv,
                          num_slots, block_q, num_splits, by_sequence: bool = False):
    """``attention.paged_attention_mgpu`` after validation; ``layer`` an ``i32[]`` operand (one compiled kernel
    serves every layer of a step). ``by_sequence`` (with ``block_q == 1``, unsplit): :func:`one_token_rows`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    block_size = block_size_of(kv_pool)
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    if by_sequence:
        meta = one_token_layout(cu_q_lens, kv_lens)
        tile_of = jnp.arange(meta.shape[0], dtype=jnp.int32)
    else:
        meta, tile_of = tile_layout(cu_q_lens, kv_lens, num_tokens, block_q)
    num_out = meta.shape[0] if by_sequence else num_tokens  # output rows: tokens, or (by_sequence) sequences

    dtype = q.dtype  # the pool's, or bf16 over an fp8 pool (validated): the output tile reuses the queries'
    fp8 = is_fp8(kv_pool.dtype)
    tile = lambda shape, dt=dtype: plgpu.SMEM(shape, dt, transforms=transforms(dt, shape[-1]))
    slots = (num_slots, block_kv, head_dim)
    # Copies a KV tile's barrier waits for: one a pool block; of an fp8 block, its keys or its D / block_size
    # boxes of values, and a scale row.
    k_copies, v_copies = fp8_block_copies(head_dim, block_size) if fp8 else (block_kv // block_size,) * 2
    max_tokens = min(block_q, num_tokens)  # a tile's tokens, at most
    scratch = dict(q_bar=plgpu.Barrier(num_arrivals=1, num_barriers=max_tokens),
                   k_bar=plgpu.Barrier(num_arrivals=k_copies, num_barriers=num_slots),
                   v_bar=plgpu.Barrier(num_arrivals=v_copies, num_barriers=num_slots),
                   q_plain=plgpu.SMEM((BLOCK_M, head_dim), dtype))  # unswizzled (validated: max_tokens G <= 64)
    if interpret is not None:  # the interpreter's wgmma reads shared memory only: Q and P through swizzled tiles
        scratch["q_smem"] = tile((BLOCK_M, head_dim))
        scratch["p_smem"] = tile((BLOCK_M, block_kv), jnp.float16 if fp8 else dtype)
        if fp8:
            scratch["q16_smem"] = tile((BLOCK_M, head_dim), jnp.float16)
    split_out = (plgpu.SMEM((BLOCK_M, head_dim), jnp.float32), plgpu.SMEM((BLOCK_M, LSE_LANES), jnp.float32))
    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((num_out, num_q_heads, head_dim), q.dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((num_splits, num_out, num_q_heads, head_dim), jnp.float32),
                    jax.ShapeDtypeStruct((num_splits, num_out, num_q_heads, LSE_LANES), jnp.float32))
    # With splits, the output after the last K/V tile lives in the slots' memory (80 KiB a program, not
    # 120). Over an fp8 pool the f16 V^T tile shares the f16 K tile's memory.
    shared_out = (split_out,) if num_splits > 1 else ()
    if fp8:  # fp8 slots as stored (swizzled, untiled: TMA boxes at any row), one f16 K and one V^T tile
        staged = lambda shape: plgpu.SMEM(shape, kv_pool.dtype, transforms=(plgpu.SwizzleTransform(shape[-1]),))
        scale_rows = plgpu.SMEM((num_slots, 2, max(block_kv, TMA_ALIGN)), kv_pool.dtype)  # rows TMA-aligned
        k_group = (tile((block_kv, head_dim), jnp.float16), staged(slots), staged((num_slots, head_dim, block_kv)),
                   scale_rows)
        scratch["fp8_union"] = plgpu.RefUnion(k_group, (tile((head_dim, block_kv), jnp.float16),), *shared_out)
    elif shared_out:
        scratch["kv_then_out"] = plgpu.RefUnion((tile(slots), tile(slots)), *shared_out)
    else:
        scratch["k_smem"], scratch["v_smem"] = tile(slots), tile(slots)
    inputs = (jnp.reshape(layer, (1,)), meta, block_tables, q, kv_pool)
    num_programs = 0
    if num_splits > 1:  # a persistent launch over the (tile, split) items that have keys: work_list
        work = work_list(meta, block_kv, num_splits)
        inputs += (work,)
        # As many programs as fit on the device at once, by shared memory (two an SM at bf16, D 128, KV
        # tiles of 64); more would wait for a slot, as the grid's programs did.
        per_core = max(1, SMEM_BYTES // smem_bytes(head_dim, block_kv, num_slots, dtype, split=True, fp8=fp8))
        num_programs = min(work.shape[0] - 1, INTERPRET_PROGRAMS if interpret is not None else
                           max(1, per_core * num_cores() // num_kv_heads))
    build = functools.partial(  # (picklable: lowered_once may build it in a worker)
        plgpu.kernel,
        functools.partial(_attention_kernel, scale_log2=scale * LOG2E, group=group, block_kv=block_kv,
                          block_size=block_size, num_slots=num_slots, num_splits=num_splits,
                          by_sequence=by_sequence, num_programs=num_programs),
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_kv_heads, num_programs or meta.shape[0]),
        grid_names=("kv_head", "program" if num_programs else "tile"),
        interpret=interpret,
        kernel_name="one_token_rows" if by_sequence else "paged_attention_tiles",  # (profiles name it)
    )
    out = lowered_once.launch(build, *inputs, interpret=interpret)
    if num_splits == 1:
        return out  # padding tokens (and, by_sequence, the other sequences): zeros, written by the kernel
    # Splits that had no keys, padding tokens and unowned tiles wrote nothing: their memory is not read.
    o_parts, lse = out
    split = jnp.arange(num_splits, dtype=jnp.int32)[:, None]
    lo, hi = split_range(meta[None, tile_of, 2], split, block_kv, num_splits)  # [P, T]
    wrote = ((lo < hi) & (meta[None, tile_of, 0] >= 0))[:, :, None]
    lse = jnp.where(wrote, lse[..., 0], -jnp.inf)
    o_parts = jnp.where(wrote[..., None], o_parts, 0.0)
    return merge_splits(o_parts, lse, q.dtype)  # zeros where none wrote
