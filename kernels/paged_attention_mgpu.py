"""Ragged paged attention for Hopper with Pallas' Mosaic GPU backend: TMA copies of pool blocks, wgmma.

Same contract as :func:`jaxpaged.kernels.paged_attention_reference.paged_attention_reference` (read its
module docstring): ``q[T, Hq, D]`` new tokens of ``S`` sequences (``cu_q_lens``), ``kv_lens`` including
the new tokens, layer ``layer`` of the pool ``[L, num_blocks, block_size, 2, Hkv, D]`` read through
``block_tables[S, W]``; causal; padding tokens give zeros; keys at or past ``kv_lens`` are never used
(stale NaN cannot leak). The Pallas-Triton kernel (``paged_attention.py``) computes the same thing;
this one is written for the backend Pallas develops for Hopper (Triton's is deprecated): operands
reach shared memory by the bulk tensor copy engine (TMA) and both matmuls run on wgmma.

How the work is cut (the arrays that say so: ``paged_attention_mgpu_layout.py``):
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
    Hq, D]`` partials, which the merge reads in token order. Relaying the queries into tiles first and
    the outputs back after (XLA gathers) had cost a batch-1 decode launch 3-6 us around a 3-5 us
    attention kernel (H200, 2026-12-03). One TMA box of the tile's tokens into a ``[tokens, G, D]``
    view of the rows lowered and compiled but read the wrong queries on the GPU (H100, 2026-12-06).
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
    rescaled into the fp32 accumulator. (Through shared memory, decode measured 0.95-1.39x the time of
    ``P`` from registers, 2026-12-03; registers also need no store and no fence.)
  * Masking: tiles wholly at or before the tile's first query position (every row sees every key)
    take an unmasked path. The others (the causal diagonal and the ``kv_len`` tail; a decode tile has
    at most one) set the scores of keys past each row's position (or past the tile's last needed key,
    ``kv_end``) to ``-inf`` with a select, and zero the values of keys at or past ``kv_end`` in shared
    memory before ``P V``: TMA copies whole blocks, the tail of the last block may be stale NaN, and
    ``P = 0`` times ``NaN`` would still be NaN. Keys are never multiplied by a mask, only selected.
    Blocks past a sequence's last block are read at a clipped table column (in range by contract) and
    fully masked.

Scope: bf16 pools on the GPU. A float32 pool runs in interpret mode only: Hopper's wgmma has no
fp32 inputs (float32 operands run as TF32, about 10 mantissa bits, not the reference's fp32), and
Mosaic GPU does not lower a float32 ``P V`` at all ("Only f16 WGMMA supports transposes": the
values' tile is N-major, 32-bit wgmma operands must be K-major). fp8 pools (kernels/fp8.py) with
bf16 queries, one pool block a KV tile (block size 64 or 128): see below. ``head_dim`` 64 or 128;
block sizes 8 to 128 (powers of two);
``G <= 64``. One warpgroup per program (a decode tile fills ``G`` of its 64 rows), whole blocks
copied for the last KV tile. Launches that are neither decode (at most two tokens a sequence, or
at most ``SMALL_LAUNCH_TOKENS``) nor given ``block_q``/``num_splits`` (prefill,
chunked prefill, mixed steps) run the warp-specialised kernel of ``paged_attention_mgpu_prefill.py``
instead: two compute warpgroups share each K/V tile and a third issues the copies (1.3x faster than
this kernel at 4k-16k tokens).

Decode steps (``uniform_decode``: the caller says no sequence has more than one new token; bf16 and
fp8 pools) run ``paged_attention_mgpu_decode.py`` instead: keys on wgmma's M, so a
decode token's ``G`` query rows cost wgmma ``N = 8`` columns instead of 64 rows (over fp8 0.61x this
kernel's time at batch 256, context 1,024, H200; over bf16 0.86-0.99x at 1-256 sequences, H100).

fp8 pools: prefill and mixed launches the warp-specialised kernel where it fits (blocks of 64
slots, two slots or more: ``paged_attention_mgpu_prefill.py``), else this one-warpgroup kernel, whose
arithmetic they share (``paged_attention_mgpu_fp8.py``). A KV tile is one pool block: TMA copies its keys
(``[bs, D]``), its values' ``V^T`` (``D / bs`` boxes of the transposed slab, kernels/fp8.py) and its two
scale rows into fp8 slots. Each step converts the keys to f16 in registers (exact: an fp8 value is an
f16 value) and stores them in an f16 tile for ``Q K^T``; the queries are f16 too, each row first
multiplied by the power of two that brings its largest element near 2^14 (bf16 has a wider range than
f16), which the scores' row is divided by again; the K scales multiply the scores' columns. ``V^T`` is
converted the same way into the same f16 tile (``Q K^T`` is done with it); the V scales, divided by
the largest the row sees in the tile (powers of two: exact), multiply the probabilities' columns
before ``P`` is rounded to f16 (which keeps 11 significant bits of ``P`` in ``[0, 1]``, bf16 8), and
that largest scale multiplies the row of ``P V``. The Triton kernel's f16 path does the same
arithmetic. The slots are copied untiled with the TMA's swizzle only: a tiled copy needs the pool's
row axis (``bs + 1`` rows, the scale row included) to be a multiple of 8.

In a profile the kernels are ``<name>_mosaic_gpu_kernel``: ``paged_attention_tiles`` (this module's
query tiles: decode and short launches), ``one_token_rows`` (the decode rows of a prefill launch),
``paged_prefill`` (the warp-specialised kernel), ``paged_decode`` and ``paged_decode_fp8`` (the decode
kernel over bf16 and fp8 pools).

Interpret mode (``interpret=True``) runs Mosaic GPU's CPU interpreter
(``plgpu.InterpretGPUParams``), which simulates shared memory, TMA copies, barriers and wgmma
(uninitialised shared memory reads as NaN, out-of-bounds reads raise, barrier phases are checked,
and a race detector can be switched on); it checks the arithmetic and the copy/barrier protocol.
Lowering for the GPU is checked apart: on a machine without a GPU, ``jax.jit(...).trace(...).lower(
lowering_platforms=("cuda",))`` runs the whole Pallas -> Mosaic GPU lowering for sm_90a (wgmma,
TMA); only the PTX compilation and the run itself need the GPU.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels.fp8 import is_fp8
from jaxpaged.kernels import lowered_once
from jaxpaged.kernels.kv_write import block_size_of, check_pool
from jaxpaged.kernels.metadata import check_ragged_metadata
from jaxpaged.kernels.shapes import is_pow2, num_cores
from jaxpaged.kernels.paged_attention_mgpu_fp8 import _scales, copy_fp8_block, f16_queries, fp8_block_copies
from jaxpaged.kernels.paged_attention_mgpu_layout import (choose_splits, one_token_layout, split_range, tile_layout,
                                                         work_list)
from jaxpaged.kernels.split_k import MAX_SPLITS, merge_splits

LOG2E = math.log2(math.e)
BLOCK_M = 64  # query rows of a program: Hopper wgmma's M per warpgroup
MAX_TILE_TOKENS = 32  # a query tile's tokens at most: one barrier each, and Mosaic GPU initialises 32 a group
# Launches of at most this many tokens run the query tiles with split-K even where they are not decode-shaped
# (a short prompt alone, a chat turn after its cached history): see paged_attention_mgpu's docstring.
SMALL_LAUNCH_TOKENS = 128
MIN_KV_TILE = 64  # keys per inner step at least (wgmma K of P @ V: one 128-byte swizzle row of bf16)
MAX_KV_TILE = 256  # wgmma's largest N (S = Q K^T)
NUM_SLOTS = 2  # KV tiles in flight by default (double buffering)
PREFILL_KV_TILE = 128  # keys per inner step of the prefill kernel (64 measured 1.1x slower at 4k-16k tokens)
TMA_ALIGN = 128  # bytes: a TMA copy's shared-memory address is a multiple of this
SWIZZLE = 128  # bytes: shared-memory swizzle of every tile (rows of 64 bf16 / 32 fp32 elements)
SMEM_BYTES = 227 * 1024  # an H100/H200 block's shared memory
LSE_LANES = 32  # a split program's log-sum-exp, copied to each lane of a 128-byte row: TMA copies out of
# shared memory from 128-byte aligned addresses, and a program's rows start at any row of its tile
INTERPRET_PROGRAMS = 2  # programs a KV head of an interpreted split launch (each takes several items)
_MASKED = -1e30  # initial running max: finite, so a fully masked row gives exp2(-inf) = 0, never NaN
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32, 64, 128)


def pool_dtypes(interpret) -> tuple[jnp.dtype, ...]:
    """The pool dtypes the kernel reads: bf16, and float32 in interpret mode only (module docstring)."""
    return (jnp.dtype(jnp.bfloat16),) + ((jnp.dtype(jnp.float32),) if interpret else ())


def kv_tile(block_size: int) -> int:
    """Default keys per inner step: ``MIN_KV_TILE``, or one pool block if larger."""
    return max(MIN_KV_TILE, block_size)


def interpreter_threads() -> int:
    """Threads XLA's CPU client runs computations on: one a core this process may use, or one a CPU
    device where there are more (``--xla_force_host_platform_device_count``).

    Mosaic GPU's interpreter runs each warpgroup of a program as a computation of its own whose
    barrier waits block the thread running it; the caller's computation holds one more. With fewer
    threads than warpgroups + 1, the warp-specialised prefill kernel (3 warpgroups) can deadlock (a
    2-core machine did), so in interpret mode :func:`paged_attention_mgpu` runs its prefill launches
    on the one-warpgroup kernel there."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(cores, jax.local_device_count("cpu"))


def prefill_kv_tile(block_size: int) -> int:
    """Default keys per inner step of the prefill kernel: ``PREFILL_KV_TILE``, or one pool block if larger."""
    return max(PREFILL_KV_TILE, block_size)


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


def _transforms(dtype, cols: int | None = None):
    """Tiling and swizzle of a shared-memory tile of ``dtype``: 8 rows x one 128-byte swizzle row, or for a
    tile of ``cols`` narrower than that (an fp8 tile of 64 columns), one row."""
    swizzle = SWIZZLE if cols is None else min(SWIZZLE, cols * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


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
            # twice at G = 2), a decode tile of one token paid for them all (0.88x the time with the loops
            # at batch 256, context 64; 0.86-0.89x at batch 1 and 32-128-token prompts; H100,
            # benchmarks/results/mosaic/README.md).
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
                    s = s * lax.broadcast_in_dim(q_unscale, s.shape, [0]) * _scales(scale_smem.at[slot, 0], s.shape)
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
                    v_scale = _scales(scale_smem.at[slot, 1], s.shape)
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
                plgpu.layout_cast(jnp.full((BLOCK_M,), _MASKED, jnp.float32), rows),
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

def _interpret_params(interpret):
    """``True`` -> Mosaic GPU's CPU interpreter with default parameters; an ``InterpretGPUParams`` is
    used as given; ``False``/``None`` -> compiled."""
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None


def _validate(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, interpret, block_kv, num_slots, block_q,
              num_splits, prefill: bool = False):
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    check_pool(kv_pool, layer)
    fp8 = is_fp8(kv_pool.dtype)
    if fp8:
        if q.dtype != jnp.bfloat16:
            raise ValueError(f"q dtype ({q.dtype}) must be bfloat16 over an fp8 pool")
        if block_kv != block_size_of(kv_pool):
            raise ValueError(f"an fp8 pool is read one block a KV tile: block_kv ({block_kv}) must be its block "
                             f"size ({block_size_of(kv_pool)}), at least {MIN_KV_TILE}")
    elif jnp.dtype(kv_pool.dtype) not in pool_dtypes(True):
        raise ValueError(f"kv_pool dtype must be bfloat16, float32 or fp8, got {kv_pool.dtype}")
    elif q.dtype != kv_pool.dtype:
        raise ValueError(f"q dtype ({q.dtype}) must be the pool's ({kv_pool.dtype})")
    if not fp8 and jnp.dtype(kv_pool.dtype) not in pool_dtypes(interpret):
        raise ValueError("a float32 pool runs in interpret mode only: Hopper's wgmma has no fp32 inputs "
                         "(TF32 at best), see the module docstring")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, d = kv_pool.shape[4:]
    block_size = block_size_of(kv_pool)
    if d != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != head_dim of the pool ({d})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if num_q_heads // num_kv_heads > BLOCK_M:
        raise ValueError(f"G = Hq // Hkv = {num_q_heads // num_kv_heads} must be <= {BLOCK_M}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    check_ragged_metadata(cu_q_lens, kv_lens, block_tables)
    if block_kv % MIN_KV_TILE or block_kv % block_size or not MIN_KV_TILE <= block_kv <= MAX_KV_TILE:
        raise ValueError(f"block_kv={block_kv} must be a multiple of {MIN_KV_TILE} and of block_size={block_size}, "
                         f"at most {MAX_KV_TILE}")
    if not 1 <= num_slots <= 4:
        raise ValueError(f"num_slots must be in [1, 4], got {num_slots}")
    if block_q is not None and not (1 <= block_q * (num_q_heads // num_kv_heads) <= BLOCK_M
                                    and block_q <= MAX_TILE_TOKENS):
        raise ValueError(f"block_q={block_q} tokens x G={num_q_heads // num_kv_heads} heads must be 1..{BLOCK_M} rows, "
                         f"and at most {MAX_TILE_TOKENS} tokens")
    if num_splits is not None and not (is_pow2(num_splits) and num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be a power of two <= {MAX_SPLITS}, got {num_splits!r}")
    if prefill:
        from jaxpaged.kernels.paged_attention_mgpu_prefill import prefill_smem_bytes

        need = prefill_smem_bytes(head_dim, block_kv, num_slots, q.dtype, p_in_smem=bool(interpret), fp8=fp8)
    else:
        need = smem_bytes(head_dim, block_kv, num_slots, q.dtype, split=(num_splits or 1) > 1,
                          p_in_smem=bool(interpret), fp8=fp8)
    if not interpret and need > SMEM_BYTES:
        raise ValueError(f"a program would need {need} bytes of shared memory (> {SMEM_BYTES})")


def paged_attention_mgpu(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
    interpret=False,
    block_kv: int | None = None,
    num_slots: int = NUM_SLOTS,
    block_q: int | None = None,
    decode: bool | None = None,
    num_splits: int | None = None,
    uniform_decode: bool = False,
) -> jax.Array:
    """Ragged paged attention (decode, prefill, prefill with a cached prefix) with Mosaic GPU.

    Args:
      q: ``[T, Hq, D]`` in the pool's dtype; kv_pool: ``[L, num_blocks, block_size, 2, Hkv, D]``, bf16
        (float32 in interpret mode only), read at layer ``layer`` (a Python int or an ``i32[]``);
      cu_q_lens ``i32[S+1]``, kv_lens ``i32[S]``, block_tables ``i32[S, W]``: as in the reference.
      scale: softmax scale, default ``1/sqrt(D)``.
      interpret: ``True`` (or a ``plgpu.InterpretGPUParams``) runs Mosaic GPU's CPU interpreter.
      block_kv: keys per inner step (a multiple of 64 and of the block size, <= 256); default
        :func:`kv_tile` (:func:`prefill_kv_tile` on the prefill kernel). num_slots: KV tiles in flight
        (1-4). block_q: tokens per query tile, at most and by default ``min(64 // G, 32)`` (over an fp8 pool
        ``block_q`` 1 runs ``paged_attention_mgpu_decode``: a token a tile).
        num_splits: programs sharing a query tile's keys (split-K, a power of two <= 32); default
        :func:`choose_splits`. All for tuning: any value gives the same result (to rounding).
      decode: the decode configuration (the query tiles, split-K by :func:`choose_splits` over the
        tiles the launch's tokens fill) or, ``False``, the prefill kernel; by default decode
        where the launch has at most two tokens a sequence or at most ``SMALL_LAUNCH_TOKENS`` tokens.
        On the prefill kernel a short launch that is not decode-shaped (a 32-token prompt alone, padded to 8 sequences) pays the copies around it
        (queries into 128 rows, the side output's scatter, the output's copy back), and its few
        programs read a cached prefix unsplit. There the tiles with split-K took 0.57 / 0.62x the prefill kernel's time after 4,096 cached
        tokens (32 / 128 new tokens), 0.42x at ``G`` = 7, and 0.95-1.00x without (0.62 at ``G`` = 7);
        at 512 tokens 1.04x after the prefix and 1.47x without, so they stop at 128 (chained, H100,
        2026-12-06, benchmarks/results/mosaic/README.md). Over fp8 alike: 0.38 / 0.43x after 4,096 cached tokens,
        0.86 / 1.16x without (H100, 2026-12-06, the same page).
      uniform_decode: the caller knows that no sequence has more than one new token (an engine's decode
        step). Such a launch runs ``paged_attention_mgpu_decode`` (keys on wgmma's M, a program a token):
        over bf16 0.86-0.99x the query tiles' time at 1-256 sequences, contexts 64-1,024, and in the
        engine (Qwen3-0.6B shapes) 0.92x the tiles' ITL at batch 256, 0.97x Triton's (H100, 2026-12-06,
        benchmarks/results/mosaic/README.md). Not inferred from shapes over bf16: an engine pads a short prompt's step
        to as many sequences as tokens too, and there a program a token reads the prompt's cached
        prefix once a token (over fp8 alike).
    Returns ``[T, Hq, D]`` in ``q.dtype``; zeros for padding tokens.
    Raises ValueError for what the kernel does not support (module docstring, "Scope").
    """
    decode_shaped = q.ndim == 3 and q.shape[0] <= 2 * kv_lens.shape[0]  # at most two tokens a sequence
    if uniform_decode:
        decode = True
    if decode is None:
        decode = decode_shaped or (q.ndim == 3 and q.shape[0] <= SMALL_LAUNCH_TOKENS)
    prefill = not decode and block_q is None and num_splits in (None, 1)  # the warp-specialised kernel
    if prefill and interpret:
        from jaxpaged.kernels.paged_attention_mgpu_prefill import NUM_COMPUTE

        prefill = interpreter_threads() >= NUM_COMPUTE + 2  # (its docstring)
    if block_kv is None:  # (over fp8 one pool block: kv_tile)
        tiles = prefill_kv_tile if prefill and not is_fp8(kv_pool.dtype) else kv_tile
        block_kv = tiles(block_size_of(kv_pool)) if kv_pool.ndim == 6 else MIN_KV_TILE
    if prefill and is_fp8(kv_pool.dtype) and q.ndim == 3:
        from jaxpaged.kernels.paged_attention_mgpu_prefill import prefill_smem_bytes

        # Over fp8 the prefill kernel needs two slots or more, and room for its f16 tiles beside the fp8
        # slots (blocks of 128 at head_dim 128 have none): its docstring. Else the one-warpgroup kernel.
        prefill = num_slots >= 2 and (
            prefill_smem_bytes(q.shape[-1], block_kv, num_slots, q.dtype, False, fp8=True) <= SMEM_BYTES)
    _validate(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, interpret, block_kv, num_slots, block_q,
              num_splits, prefill)
    if prefill:
        from jaxpaged.kernels.paged_attention_mgpu_prefill import paged_prefill_mgpu

        return paged_prefill_mgpu(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                                  scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
                                  interpret=_interpret_params(interpret), block_kv=block_kv, num_slots=num_slots)
    # Keys on wgmma's M, a token a program (paged_attention_mgpu_decode): a uniform decode launch (a decode
    # step: its shapes cannot tell it from a short prompt's, on which a program a token would read a
    # cached prefix once a token), or over fp8 one asked for with block_q 1.
    keys_on_m = (is_fp8(kv_pool.dtype) and block_q == 1) or (
        block_q is None and uniform_decode and (is_fp8(kv_pool.dtype) or kv_pool.dtype == jnp.bfloat16))
    if block_q is None:
        block_q = min(BLOCK_M // (q.shape[1] // kv_pool.shape[4]), MAX_TILE_TOKENS)
    if num_splits is None:
        # Programs before the split: a token each on the decode kernel; on the query tiles as many as the
        # launch's tokens fill (not its padded sequences: an engine pads a prompt chunk's step to as many
        # sequences as tokens, and its decode steps, a tile a sequence, are marked).
        tiles = q.shape[0] if keys_on_m else min(kv_lens.shape[0], -(-q.shape[0] // block_q))
        num_splits = choose_splits(q.shape[0], tiles, kv_pool.shape[4], block_kv,
                                   block_tables.shape[1] * block_size_of(kv_pool), decode)
    if keys_on_m:
        from jaxpaged.kernels.paged_attention_mgpu_decode import paged_decode_mgpu

        return paged_decode_mgpu(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                                 scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
                                 interpret=_interpret_params(interpret), block_kv=block_kv, num_slots=num_slots,
                                 num_splits=num_splits)
    return _paged_attention_mgpu(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                                 scale=None if scale is None else float(scale),
                                 interpret=_interpret_params(interpret), block_kv=block_kv, num_slots=num_slots,
                                 block_q=block_q, num_splits=num_splits)


def one_token_rows(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale: float, interpret) -> jax.Array:
    """The outputs of the sequences that have one new token, ``[S, Hq, D]`` in sequence order (zeros
    for the others), by the decode tiles: a program a (sequence, KV head) computes that token's ``G``
    query heads in one wgmma tile, reading its queries in place. The prefill kernel
    (``paged_attention_mgpu_prefill``) leaves such sequences (the decode rows of a mixed step) to this
    launch where ``G`` is at least its ``DECODE_TILES_MIN_GROUP``: its items are a query head each, so
    a one-token sequence costs it ``G`` programs' arithmetic, one a head, for every KV head's keys (a
    step of 255 decode rows at 4k tokens and a 512-token prompt, Qwen2.5-7B's shapes: 3.3x the tiled
    kernel's time, 0.99x with this launch; H100, ``benchmarks/results/mosaic/README.md``). Unsplit: where a prefill
    launch has no such sequences every program exits at once, and split-K's merge would be one more
    kernel (launches of 2,048 tokens and one sequence took 1.07-1.16x the time with the decode
    launches' splits, 0.98x without). ``layer`` an ``i32[]``, the rest validated by
    :func:`paged_attention_mgpu`; the decode launches' KV tile and slots."""
    block_kv = kv_tile(block_size_of(kv_pool))
    return _paged_attention_mgpu(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, scale=scale, interpret=interpret,
                                 block_kv=block_kv, num_slots=NUM_SLOTS, block_q=1, num_splits=1, by_sequence=True)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_kv", "num_slots", "block_q", "num_splits",
                                             "by_sequence"))
def _paged_attention_mgpu(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale, interpret, block_kv,
                          num_slots, block_q, num_splits, by_sequence: bool = False):
    """:func:`paged_attention_mgpu` after validation; ``layer`` an ``i32[]`` operand (one compiled kernel
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
    tile = lambda shape, dt=dtype: plgpu.SMEM(shape, dt, transforms=_transforms(dt, shape[-1]))
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
