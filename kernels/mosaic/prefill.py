"""Ragged paged prefill for Hopper with Mosaic GPU: two compute warpgroups share every K/V tile, a third
warpgroup only issues the copies (warp specialisation, as in FlashAttention-3).

Same contract as :func:`jaxpaged.kernels.mosaic.attention.paged_attention_mgpu` (and the
reference): ``q[T, Hq, D]`` new tokens of ragged sequences over the paged pool, causal, zeros for
padding tokens, stale (even NaN) keys and values at or past ``kv_lens`` never reach an output. That
kernel gives each program one warpgroup and 64 query rows, and the warpgroup itself issues its K/V
copies, waits for them and then computes; this one is for launches with many new tokens a sequence
(prefill, chunked prefill, prefix hits), where a program's arithmetic, not its reads, sets the pace:

  * A work item is a *pair* of query tiles of one sequence for one query head: 128 tokens, the first
    64 in compute warpgroup 0's rows, the next 64 in warpgroup 1's. Both read the same K/V tiles (of
    the head's KV head) from shared memory, so a tile copied once serves 128 query rows (half the
    copies a query row needs in the one-warpgroup kernel); the ``G`` query heads of a KV head are
    items side by side in the launch order, so their reads of the same keys meet in the L2.
  * Queries are read and outputs written in place, in ``q``'s ``[T, Hq, D]``: a warpgroup's tile is
    one TMA box of 64 rows of its head. A swizzled tile takes boxes that start at multiples of 8
    rows, so a sequence's pairs start at its first token rounded down to a multiple of 8
    (:func:`pair_layout`; rows before the sequence's are computed and not stored). A tile whose rows
    are all its sequence's is stored in one box, the others by groups of 8 rows, where a group shared
    with the sequence before or after goes to a small side output that XLA scatters
    (:func:`side_rows`). Laying the queries out in tiles before the launch and gathering the outputs
    back after would be two XLA copies of the queries' size around the kernel.
  * The launch is persistent: a program an SM, each taking its items in turn
    (:func:`program_items`), so one item's first copies (its Q tiles, its first K/V tiles) land while
    the item before it still computes, and no SM waits for a program to end and the next to start.
    An item's Q tiles go into one of two buffers (one where shared memory
    has no room for two: :func:`prefill_q_buffers`), its output over them.
  * Warpgroup 2 (the memory warpgroup, its registers handed to the compute warpgroups with
    ``set_max_registers``) issues each K/V tile's TMA copies, one per pool block, as soon as both
    compute warpgroups have released the slot the tile goes to (a ``*_free`` barrier per warpgroup
    and slot; the slots turn over the program's tiles of all its items). A warpgroup that needs
    fewer tiles than its partner (the first one on the causal diagonal) still waits for and releases
    the rest, without reading them: each thread counts a barrier's phases for itself, so it has to
    see every phase to stay in step over the items.
  * A compute warpgroup runs the one-warpgroup kernel's loop over its own key range: ``S = Q K^T``
    (wgmma), the online softmax in fp32, base 2 (``exp2`` as the approximate, flush-to-zero
    instruction), and ``P V`` with ``P`` from registers on the GPU (the interpreter takes wgmma
    operands from shared memory only, so there ``P`` goes through a shared-memory tile). Tiles before
    the warpgroup's first query position take the unmasked path.
  * The two compute warpgroups take turns on the tensor cores (FA3's ping-pong, in the form of jax's
    ``attention_mgpu``): a ``schedule`` barrier both arrive at twice a tile, once after issuing
    ``Q K^T`` and once after the softmax, with warpgroup 1 a turn behind, so one warpgroup's softmax
    runs while the other's matrix products do. The output's rescale and ``P``'s conversion to bf16 are
    part of the softmax turn, held there by an ``optimization_barrier`` (turns without that ordering
    timed the same as none). A warpgroup whose keys end a tile before its partner's still takes its
    turns for that tile, so both meet the barrier equally often.
  * Stale values: TMA copies whole pool blocks, so the tile holding the pair's last key may carry
    stale (NaN) values after it, and ``P = 0`` times NaN is NaN. The warpgroup holding the pair's
    last token zeroes them in shared memory and signals on its own ``zeroed`` barrier; the other
    warpgroup waits for that signal before its ``P V`` (or, where its keys end earlier, after its
    turns for that tile). Keys are only ever selected away (``-inf`` scores), never multiplied.
  * Items are taken longest first (:func:`launch_order`): in pair order a causal prefill's longest
    pairs ran in the last wave.
  * Where ``G >= DECODE_TILES_MIN_GROUP``, a sequence of one new token (a decode row of a mixed step)
    owns no pair: as an item a query head, it would cost ``G`` warpgroups of 64 rows, one for each of a
    KV head's query heads, each reading all its keys. A second launch computes those rows on the decode
    tiles, a KV head's ``G`` heads in one (``tiles.one_token_rows``),
    and the scatter that places the side output's rows places them too (not over fp8 pools, whose
    decode kernel has no tiles by sequence). At smaller ``G`` the rows stay items of this launch: the
    second launch, run by every prefill launch whether or not it has such rows, cost more than it saved
    (:data:`DECODE_TILES_MIN_GROUP`).
  * Each phase of a step is a ``jax.named_scope`` (``wait_k``, ``qk``, ``softmax``, ``wait_v``, ``pv``;
    the memory warpgroup's ``wait_free``), which Mosaic GPU's profiler records per warpgroup when a
    launch sets ``profile_space``.

Over an fp8 pool (kernels/fp8.py; blocks of 64 slots, a KV tile each) the memory warpgroup copies each
block as stored (keys with both scale rows, then ``V^T``), and each compute warpgroup does the
one-warpgroup kernel's fp8 arithmetic for itself: its queries once an item, then each tile's keys and
``V^T``, converted exactly to f16 tiles of its own (stale values zeroed as they are converted); the K
scales multiply the scores' columns, the V scales over the row's largest multiply ``P``'s, and the
output is kept in units of that largest scale, rescaled with the running maximum. Both scale rows
arrive with the keys, so the whole softmax stays in its turn. Faster than the one-warpgroup kernel
over fp8, slower than this kernel over bf16: the conversions.

Scope: as the one-warpgroup kernel (bf16 pools on the GPU, float32 in interpret mode, fp8 pools of block
size 64 with two K/V slots or more; head_dim 64 or 128; block sizes 8-128; any ``G``), without split-K. TMA boxes also need ``T`` a multiple of 8 and at
least 128 rows: other launches copy ``q`` into one that is (the engine's token counts are powers of
two, so only its launches of under 128 tokens do). Decode launches stay on that kernel
(``attention.paged_attention_mgpu`` picks this one for the others; in interpret mode only where the
interpreter has a thread for each warpgroup and the caller: ``common.interpreter_threads``).
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
from jaxpaged.kernels.mosaic.common import BLOCK_M, LOG2E, MASKED, SMEM_BYTES, TMA_ALIGN, transforms
from jaxpaged.kernels.mosaic.fp8 import copy_fp8_keys, copy_fp8_scales, copy_fp8_values, f16_queries, scales_f32
from jaxpaged.kernels.mosaic.layout import one_token_seqs
from jaxpaged.kernels.mosaic.tiles import one_token_rows
from jaxpaged.kernels.shapes import num_cores

NUM_COMPUTE = 2  # compute warpgroups a program; warpgroup NUM_COMPUTE issues the copies
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40  # per thread: 2 x 128 x 232 + 128 x 40 <= 64K registers
INTERPRET_PROGRAMS = 2  # programs of an interpreted launch (each takes several items)
PREFILL_KV_TILE = 128  # keys per inner step (docs/DECISIONS.md)
# The smallest GQA group whose decode rows a prefill launch leaves to the decode tiles (one_token_rows):
# a decode row costs this launch G items, while the second launch costs every prefill step one more
# launch a layer. Large groups gain from it, small ones lose a little (docs/DECISIONS.md).
DECODE_TILES_MIN_GROUP = 4


def prefill_kv_tile(block_size: int) -> int:
    """Default keys per inner step: ``PREFILL_KV_TILE``, or one pool block if larger."""
    return max(PREFILL_KV_TILE, block_size)


def prefill_smem_bytes(head_dim: int, block_kv: int, num_slots: int, dtype, p_in_smem: bool,
                       q_buffers: int = 1, fp8: bool = False) -> int:
    """Shared memory of one program: ``q_buffers`` buffers of two Q (later output) tiles, ``num_slots``
    K and V tiles, and in the interpreter the two warpgroups' P tiles. Over an fp8 pool (``dtype`` the
    queries'), the K/V slots are fp8 with their scale rows, and each compute warpgroup has f16 K, V^T and
    Q tiles."""
    rows = NUM_COMPUTE * 64
    tiles = q_buffers * rows * head_dim + rows * block_kv * p_in_smem
    if not fp8:
        return (tiles + 2 * num_slots * block_kv * head_dim) * jnp.dtype(dtype).itemsize
    staged = num_slots * 2 * (block_kv * head_dim + max(block_kv, TMA_ALIGN))  # one byte an element
    return (tiles + NUM_COMPUTE * (2 * block_kv + 64) * head_dim) * 2 + staged


def prefill_q_buffers(head_dim: int, block_kv: int, num_slots: int, dtype, fp8: bool = False) -> int:
    """Two Q buffers (the next item's Q copied while this one computes) where a Hopper block's shared
    memory holds them beside the K/V slots, else one (the next item's Q copied when this one's output
    is stored): at head_dim 128, 3 slots of 128 keys or 2 of 192 leave room for one. The same count
    in the interpreter, so the CPU tests run the GPU's choice."""
    need = prefill_smem_bytes(head_dim, block_kv, num_slots, dtype, False, q_buffers=2, fp8=fp8)
    return 2 if need <= SMEM_BYTES else 1


def program_items(num_items: int, num_programs: int, prog):
    """Program ``prog``'s share of a persistent launch: how many work items it takes, and the rank (in
    :func:`launch_order`) of its ``j``-th. Wave ``j`` hands ranks ``j * P .. (j + 1) * P - 1`` to the
    ``P`` programs, in program order on even waves and reversed on odd ones, so a program that drew a
    long item in one wave draws a short one in the next (the ranks fall with the work). Static
    round-robin, not a queue: Hopper has no launch-cancel to hand out work as programs finish."""
    full, rest = divmod(num_items, num_programs)

    def rank(j):
        return j * num_programs + jnp.where(lax.rem(j, 2) == 0, prog, num_programs - 1 - prog)

    count = full + (rank(full) < num_items).astype(jnp.int32) if rest else jnp.int32(full)
    return count, rank


def _prefill_kernel(layer_ref, order_ref, meta_ref, tables_ref, q_ref, kv_ref, o_ref, side_ref, q_smem, k_smem,
                    v_smem, *refs, scale_log2: float, group: int, block_kv: int, block_size: int, num_slots: int,
                    p_in_registers: bool, num_items: int, num_programs: int, q_buffers: int, fp8: bool = False):
    """One program of a persistent launch: work items (tile pair, query head) of ranks
    :func:`program_items` (a rank ``r`` is pair ``order_ref[r // Hq]``, query head ``r % Hq``, which
    reads KV head ``r % Hq // G``), warpgroup ``axis_index("wg")``. GMEM refs: ``meta_ref i32[pairs,
    6]`` (:func:`pair_layout`), queries and outputs ``[T, Hq, D]`` in place (``T`` a multiple of 8, at
    least 128), ``side_ref [2 (S + 1), Hq, 8, D]`` (the outputs of the groups of 8 rows that also hold
    another sequence's rows: :func:`side_rows`), the rest as in the one-warpgroup kernel.
    Shared memory: ``q_smem [B, 2, 64, D]`` (``B = q_buffers``: item ``j``'s Q tiles in buffer
    ``j % B``, its outputs written over them), ``k_smem/v_smem [slots, block_kv, D]`` (a program's ``n``-th K/V tile, over
    all its items, in slot ``n % slots``), in the interpreter ``p_smem [2, 64, block_kv]``; barriers
    ``q_bar[B * 2]`` (buffer ``b``'s Q tile of warpgroup ``w`` landed: ``b * 2 + w``), ``k_bar/v_bar[slots]``
    (copies landed), ``k_free/v_free[2 * slots]`` (warpgroup ``w`` released slot ``s``: ``w * slots + s``),
    ``zeroed[2]`` (the last tile's stale values are zero, signalled by the warpgroup ``w`` holding the
    pair's last token on ``zeroed[w]``), ``schedule`` (the compute warpgroups' turns,
    two arrivals a phase). Every compute warpgroup waits for and releases every tile of an item, the
    ones past its keys too (their turns taken without reading them), so each barrier's phases, which
    each thread counts for itself, stay in step over the items.

    Over an fp8 pool (``fp8``; a KV tile is one pool block): ``k_smem [slots, bs, D]`` and ``v_smem
    [slots, D, bs]`` hold the block's keys and ``V^T`` as stored, and after them come ``scale_smem
    [slots, 2, >= bs]`` (its K and V scale rows, both on ``k_bar``: the softmax takes both), ``k16
    f16[2, bs, D]``, ``vt16 f16[2, D, bs]`` and ``q16_smem f16[2, 64, D]`` (each compute warpgroup's keys,
    ``V^T`` and queries in f16); each compute warpgroup converts the tiles for itself and zeroes its own
    stale values, so ``zeroed`` is not used."""
    if fp8:
        scale_smem, k16, vt16, q16_smem, *refs = refs
    if p_in_registers:
        q_bar, k_bar, v_bar, k_free, v_free, zeroed, schedule = refs
        p_smem = None
    else:
        p_smem, q_bar, k_bar, v_bar, k_free, v_free, zeroed, schedule = refs

    def rendezvous():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    head_dim = q_smem.shape[-1]
    num_tokens, num_q_heads = q_ref.shape[:2]
    width = tables_ref.shape[1]
    blocks_per_tile = block_kv // block_size
    wg = lax.axis_index("wg")
    layer = layer_ref[0]
    my_items, rank = program_items(num_items, num_programs, lax.axis_index("program"))

    def first_row(w, tok0):
        """Warpgroup ``w``'s first query row of the pair from token ``tok0``: 64 rows from there, or the
        last 64 of ``q`` (the rows before its own computed again, not stored)."""
        return pl.multiple_of(jnp.minimum(tok0 + w * BLOCK_M, num_tokens - BLOCK_M), 8)

    def item(j):
        """Item ``j`` of this program: its tile pair and query head, sequence (-1: unowned), first token
        and its position, keys, KV tiles, whether the last tile holds keys at or past ``kv_end`` (maybe
        stale), the warpgroup holding the pair's last token, and the sequence's tokens ``[lo, hi)``."""
        r = jnp.minimum(rank(j), num_items - 1)  # (one past the last item is looked at, not taken)
        tile = order_ref[lax.div(r, num_q_heads)]
        seq, pos0, kv_end, tok0, lo, hi = (meta_ref[tile, c] for c in range(6))
        num_kv = jnp.where(seq >= 0, lax.div(kv_end + (block_kv - 1), block_kv), 0)
        tail = lax.rem(kv_end, block_kv) != 0
        owner = (pos0 + first_row(1, tok0) - tok0 < kv_end).astype(jnp.int32)
        return tile, lax.rem(r, num_q_heads), seq, pos0, kv_end, num_kv, tail, owner, tok0, lo, hi

    def key_range(w, tok0, pos0, kv_end):
        """Warpgroup ``w``'s first query position, one past its last, and its KV tiles ``[0, hi)``."""
        first = pos0 + first_row(w, tok0) - tok0
        end = jnp.minimum(first + BLOCK_M, kv_end)
        hi = jnp.where(first < kv_end, lax.div(end + (block_kv - 1), block_kv), 0)
        return first, end, hi

    @pl.when(wg == NUM_COMPUTE)
    def _memory_warpgroup():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def copy_item(j, n0):
            """Issue item ``j``'s K/V tiles, its ``t``-th into slot ``(n0 + t) % slots`` once both compute
            warpgroups have released that slot's previous tile."""
            _, hq, seq, _, _, num_kv, *_ = item(j)
            h = lax.div(hq, group)

            def fetch(t, slot, which: int, bars):
                if fp8:  # one pool block: its keys and both scale rows (the softmax uses both), or its V^T
                    phys = tables_ref[seq, jnp.minimum(t, width - 1)]
                    if which == 0:
                        copy_fp8_keys(kv_ref, layer, phys, h, slot, k_smem, bars)
                        for row in (0, 1):
                            copy_fp8_scales(kv_ref, layer, phys, h, slot, scale_smem, row, bars)
                    else:
                        copy_fp8_values(kv_ref, layer, phys, h, slot, v_smem, bars)
                    return
                for b in range(blocks_per_tile):
                    blk = jnp.minimum(t * blocks_per_tile + b, width - 1)  # past the table: masked anyway
                    phys = tables_ref[seq, blk]
                    dst = (k_smem if which == 0 else v_smem).at[slot, pl.ds(b * block_size, block_size)]
                    plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, which, h, :], dst, bars.at[slot])

            @pl.loop(0, num_kv)
            def _tiles(t):
                n = n0 + t
                slot = lax.rem(n, num_slots)
                for free, which, bars in ((k_free, 0, k_bar), (v_free, 1, v_bar)):
                    with jax.named_scope("wait_free"):
                        @pl.when(n >= num_slots)
                        def _slot_released():
                            for w in range(NUM_COMPUTE):
                                plgpu.barrier_wait(free.at[w * num_slots + slot])
                    fetch(t, slot, which, bars)

            return n0 + num_kv

        lax.fori_loop(0, my_items, copy_item, jnp.int32(0))

    @pl.when(wg < NUM_COMPUTE)
    def _compute_warpgroup():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        def q_buffer(j):
            """Item ``j``'s Q tile of this warpgroup (buffer ``j % q_buffers``) and the barrier its copy signals."""
            buf = lax.rem(j, q_buffers)
            return q_smem.at[buf, wg], q_bar.at[buf * NUM_COMPUTE + wg]

        def load_q(j):
            """Issue item ``j``'s Q tile of this warpgroup: 64 rows of its query head, in place."""
            _, hq, seq, *_, tok0, _, _ = item(j)

            @pl.when(jnp.logical_and(j < my_items, seq >= 0))
            def _copy():
                q_tile, landed = q_buffer(j)
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first_row(wg, tok0), BLOCK_M), hq], q_tile, landed)

        if q_buffers == 2:
            load_q(jnp.int32(0))

        def compute_item(j, n0):
            """Item ``j``, its ``t``-th K/V tile in slot ``(n0 + t) % slots``; its output written over its Q
            tile and stored. With two Q buffers, item ``j + 1``'s Q is copied into the other meanwhile."""
            _, hq, seq, pos0, kv_end, num_kv, tail, owner, tok0, lo, hi_tok = item(j)
            # The buffer held item j - 1 (two buffers) or item j - 1 itself (one), whose output store has read it.
            load_q(j + 1 if q_buffers == 2 else j)

            @pl.when(seq >= 0)
            def _owned_tile():
                first, end, hi = key_range(wg, tok0, pos0, kv_end)
                # Tiles every row sees entirely (none where the rows start before the sequence's first position).
                n_full = jnp.clip(lax.div(first + 1, block_kv), 0, hi)
                q_tile, q_landed = q_buffer(j)
                plgpu.barrier_wait(q_landed)
                q_op = q_tile
                if fp8:  # Q in f16, each row times the power of two that brings its largest element near 2^14
                    q16, q_unscale = f16_queries(plgpu.load(q_tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32),
                                                 scale_log2)
                    q_op = q16_smem.at[wg]
                    q_op[...] = q16
                    plgpu.commit_smem()
                iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)

                def step(t, carry, masked: bool):
                    acc, m_i, l_i, *c_i = carry  # over fp8 also the V scale acc is counted in
                    slot = lax.rem(n0 + t, num_slots)
                    with jax.named_scope("wait_k"):
                        plgpu.barrier_wait(k_bar.at[slot])
                    k_op = k_smem.at[slot].transpose((1, 0))
                    if fp8:  # the keys as stored, converted exactly to f16 in this warpgroup's tile
                        k16.at[wg][...] = plgpu.load(k_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float16)
                        plgpu.commit_smem()  # visible to wgmma
                        k_op = k16.at[wg].transpose((1, 0))

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_op, k_op)
                        rendezvous()  # the other warpgroup's turn on the tensor cores
                        return acc_ref[...]

                    with jax.named_scope("qk"):
                        s = pl.run_scoped(qk, plgpu.ACC((BLOCK_M, block_kv), jnp.float32))  # unscaled scores
                    if not fp8:  # (over fp8 the slot's scale rows are read in the softmax: released after P V)
                        plgpu.barrier_arrive(k_free.at[wg * num_slots + slot])
                    with jax.named_scope("softmax"):
                        if fp8:  # in log2 units: each row's scale (the softmax's included), each key's K scale
                            s = (s * lax.broadcast_in_dim(q_unscale, s.shape, [0])
                                 * scales_f32(scale_smem.at[slot, 0], s.shape))
                        if masked:
                            key = t * block_kv + iota((BLOCK_M, block_kv), 1)
                            last_key = jnp.minimum(first + iota((BLOCK_M, block_kv), 0), end - 1)
                            visible = key <= last_key
                            s = jnp.where(visible, s, -jnp.inf)
                        if fp8:
                            m_new = jnp.maximum(m_i, s.max(axis=1))
                            alpha = jnp.exp2(m_i - m_new)
                            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                            # P's columns times their V scales over the row's largest (powers of two: exact), so
                            # P stays in [0, 1] for f16; acc is kept in units of that largest scale.
                            v_scale = scales_f32(scale_smem.at[slot, 1], s.shape)
                            if masked:
                                v_scale = jnp.where(visible, v_scale, 0.0)  # (a stale scale may be NaN)
                            v_max = v_scale.max(axis=1)
                            c_new = jnp.where(v_max > 0, v_max, 1.0)
                            l_new = l_i * alpha + p.sum(axis=1)
                            p = p * v_scale * lax.broadcast_in_dim(1.0 / c_new, s.shape, [0])
                            acc = acc * lax.broadcast_in_dim(alpha * c_i[0] / c_new, acc.shape, [0])
                            c_new = [c_new]
                        else:
                            # The scale is applied to the row maxima and inside exp2's argument, where the
                            # multiply and the subtraction fuse into one FMA a score (the maxima are the same:
                            # scale > 0).
                            m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
                            alpha = jnp.exp2(m_i - m_new)
                            p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                            l_new = l_i * alpha + p.sum(axis=1)
                            c_new = []
                        if p_in_registers:
                            p16 = p.astype(jnp.float16 if fp8 else v_smem.dtype)
                            acc, l_new, m_new, c_new, p16 = lax.optimization_barrier((acc, l_new, m_new, c_new, p16))
                    plgpu.barrier_arrive(schedule)  # done with the softmax
                    with jax.named_scope("wait_v"):
                        plgpu.barrier_wait(v_bar.at[slot])
                    v_op = v_smem.at[slot]
                    if fp8:  # V^T as stored, converted exactly to f16
                        vt = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA).astype(jnp.float16)
                        if masked:  # stale values past kv_end (P = 0 there, but 0 * NaN = NaN)
                            vt = jnp.where(t * block_kv + iota(vt.shape, 1) < kv_end, vt, jnp.zeros((), vt.dtype))
                        vt16.at[wg][...] = vt
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(v_free.at[wg * num_slots + slot])  # (after the store that used it)
                        v_op = vt16.at[wg].transpose((1, 0))
                    elif masked:
                        last = jnp.logical_and(t == num_kv - 1, tail)

                        @pl.when(jnp.logical_and(last, wg == owner))
                        def _zero_stale_values():
                            v_key = t * block_kv + iota((block_kv, head_dim), 0)
                            v_smem[slot] = jnp.where(v_key < kv_end, v_smem[slot], jnp.zeros((), v_smem.dtype))
                            plgpu.commit_smem()
                            plgpu.barrier_arrive(zeroed.at[owner])

                        pl.when(jnp.logical_and(last, wg != owner))(lambda: plgpu.barrier_wait(zeroed.at[owner]))
                    plgpu.barrier_wait(schedule)  # the tensor cores are free
                    if p_in_registers:
                        p_op = p16
                    else:
                        p_op = p_smem.at[wg]
                        p_op[...] = p.astype(p_smem.dtype)
                        plgpu.commit_smem()

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p_op, v_op)
                        if not p_in_registers:
                            return acc_ref[...]

                    with jax.named_scope("pv"):
                        if p_in_registers:  # the wgmma accumulates into the rescaled output in place
                            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                        else:  # (the interpreter does not run an accumulator initialised from registers)
                            acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_M, head_dim), jnp.float32))
                    # Over fp8 the keys' slot is released here, after P V: the softmax read its scale rows, and
                    # the interpreter may run those loads as late as P's use (released after the softmax, its race
                    # detector saw the next tile's copy overwrite them). With one slot this order would deadlock
                    # (the next keys wait for the partner's P V, which waits for this warpgroup's next Q K^T), so
                    # fp8 launches take this kernel with two slots or more.
                    plgpu.barrier_arrive((k_free if fp8 else v_free).at[wg * num_slots + slot])
                    return acc, m_new, l_new, *c_new

                rows = plgpu.Layout.WGMMA.reduce(1)
                carry = (
                    plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((BLOCK_M,), MASKED, jnp.float32), rows),
                    plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), rows),
                ) + ((plgpu.layout_cast(jnp.ones((BLOCK_M,), jnp.float32), rows),) if fp8 else ())
                pl.when(wg == 1)(rendezvous)  # warpgroup 1 starts a turn behind
                carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
                acc, _, l_i, *c_i = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), carry)

                @pl.loop(hi, num_kv)
                def _idle_steps(t):
                    """Tiles past this warpgroup's keys: the turns, the copies' and the zeroing's
                    signals as if it read them, so every barrier's phases stay paired."""
                    slot = lax.rem(n0 + t, num_slots)
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_arrive(k_free.at[wg * num_slots + slot])
                    rendezvous()
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_arrive(v_free.at[wg * num_slots + slot])
                    rendezvous()  # (the owner zeroes the last tile in its turn after this one)
                    if not fp8:  # (over fp8 each warpgroup zeroes its own copy)
                        pl.when(jnp.logical_and(t == num_kv - 1, tail))(lambda: plgpu.barrier_wait(zeroed.at[owner]))

                pl.when(wg == 0)(rendezvous)
                l_i = jnp.where(l_i > 0, l_i, 1.0)
                out = acc / lax.broadcast_in_dim(l_i / c_i[0] if fp8 else l_i, acc.shape, [0])
                q_tile[...] = out.astype(q_smem.dtype)  # Q is done
                plgpu.commit_smem()
                row0 = first_row(wg, tok0)
                # Rows of the sequence go to the output in place: the tile in one box where all its rows are
                # the sequence's, else by groups of 8 rows (a swizzled tile's TMA boxes start at multiples of 8),
                # a group that also holds another sequence's rows to the sequence's slot of side_ref, from
                # which XLA scatters its rows (side_rows).
                # A warpgroup stores only the rows from its own first token (tok0 + 64 w) on: the rows of a box
                # moved back to stay in q are another tile's (every row has one writer).
                nominal = tok0 + wg * BLOCK_M
                inside = jnp.logical_and(jnp.logical_and(row0 == nominal, row0 >= lo), row0 + BLOCK_M <= hi_tok)
                pl.when(inside)(lambda: plgpu.copy_smem_to_gmem(q_tile, o_ref.at[pl.ds(row0, BLOCK_M), hq]))

                @pl.when(jnp.logical_not(inside))
                def _by_groups():
                    for g in range(BLOCK_M // 8):
                        row = pl.multiple_of(row0 + 8 * g, 8)
                        mine = row >= nominal
                        group_rows = q_tile.at[pl.ds(8 * g, 8)]
                        at_lo = jnp.logical_and(row < lo, lo < row + 8)
                        at_hi = jnp.logical_and(jnp.logical_and(jnp.logical_not(at_lo), row < hi_tok), hi_tok < row + 8)
                        full = jnp.logical_and(row >= lo, row + 8 <= hi_tok)
                        pl.when(jnp.logical_and(mine, full))(
                            lambda: plgpu.copy_smem_to_gmem(group_rows, o_ref.at[pl.ds(row, 8), hq]))
                        pl.when(jnp.logical_and(mine, at_lo))(
                            lambda: plgpu.copy_smem_to_gmem(group_rows, side_ref.at[2 * seq, hq]))
                        pl.when(jnp.logical_and(mine, at_hi))(
                            lambda: plgpu.copy_smem_to_gmem(group_rows, side_ref.at[2 * seq + 1, hq]))

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the buffer is free for the next Q copied into it

            return n0 + num_kv

        lax.fori_loop(0, my_items, compute_item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def pair_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, one_token_apart: bool = True):
    """The tile pairs of a ragged batch: a pair is ``2 * 64`` tokens of one sequence from a token
    ``tok0`` that is a multiple of 8 (a TMA copy into a swizzled tile starts there), so a sequence
    that starts between two multiples of 8 has its first pair start a few tokens of the sequence
    before it (rows whose outputs are not stored); the padding tokens ``[cu[S], T)`` are sequence
    ``S``, without keys, whose outputs are zeros. With ``one_token_apart`` a sequence of one new token
    owns no pair (its row is computed by ``tiles.one_token_rows``). Sequence ``s``'s pairs are
    ``cu[s] // 128 + s ...`` (as ``layout.tile_layout`` numbers tiles, which bounds them by
    ``cdiv(T, 128) + S + 1``). Returns ``meta i32[pairs, 6]`` = (sequence or -1 where unowned,
    position of ``tok0`` in its sequence, ``kv_end``: one past the pair's last position, ``tok0``,
    the sequence's tokens ``[lo, hi)``)."""
    pair = NUM_COMPUTE * 64
    num_seqs = kv_lens.shape[0] + 1
    cu = jnp.concatenate([cu_q_lens, jnp.full((1,), num_tokens, jnp.int32)])
    # The padding's positions are 0.. (as if it had only its own keys), so its warpgroups' first positions
    # stay within 8 of 0 and their tile counts at 0; kv_end 0 below: no keys are read.
    kv = jnp.concatenate([kv_lens, (num_tokens - cu_q_lens[-1:])])
    num_pairs = pl.cdiv(num_tokens, pair) + num_seqs
    starts = cu[:-1] // pair + jnp.arange(num_seqs, dtype=jnp.int32)
    u = jnp.arange(num_pairs, dtype=jnp.int32)
    seq = jnp.sum(starts[None, :] <= u[:, None], axis=1, dtype=jnp.int32) - 1  # starts[0] == 0
    lo, hi = cu[seq], cu[seq + 1]
    tok0 = lo // 8 * 8 + (u - starts[seq]) * pair
    # A sequence of one new token is left to the decode tiles (one_token_rows); the padding is not.
    owned = (tok0 < hi) & (((hi - lo > 1) if one_token_apart else (lo < hi)) | ((seq == num_seqs - 1) & (lo < hi)))
    pos0 = kv[seq] - (hi - lo) + (tok0 - lo)
    kv_end = jnp.where(seq < num_seqs - 1, pos0 + jnp.minimum(tok0 + pair, hi) - tok0, 0)
    return jnp.stack([jnp.where(owned, seq, -1), pos0, kv_end, tok0, lo, hi], axis=1).astype(jnp.int32)


def side_rows(cu_q_lens: jax.Array, num_tokens: int, one_token_apart: bool = True) -> jax.Array:
    """The token each row of the kernel's side output holds (``num_tokens``: none). Sequence ``s``
    (the padding ``s = S`` included) writes the group of 8 rows holding its first token to slot
    ``2 s`` where that group also holds the sequence before's rows, and the group holding its last
    token to slot ``2 s + 1`` where that group holds the next sequence's rows (and is not the one in
    slot ``2 s``); with ``one_token_apart`` a sequence of one new token (no pair of its own,
    :func:`pair_layout`) writes neither.
    Returns ``i32[2 (S + 1), 8]``."""
    lo = cu_q_lens
    hi = jnp.concatenate([cu_q_lens[1:], jnp.full((1,), num_tokens, jnp.int32)])
    first, last = lo // 8 * 8, hi // 8 * 8
    has_pairs = ((hi - lo != 1) if one_token_apart else jnp.ones(hi.shape, bool)).at[-1].set(True)
    at_lo = (lo % 8 != 0) & has_pairs
    used = jnp.stack([at_lo, (hi % 8 != 0) & has_pairs & ~(at_lo & (last == first))], axis=1)  # [S + 1, 2]
    tok = jnp.stack([first, last], axis=1)[:, :, None] + jnp.arange(8, dtype=jnp.int32)  # [S + 1, 2, 8]
    ok = used[:, :, None] & (tok >= lo[:, None, None]) & (tok < hi[:, None, None])
    return jnp.where(ok, tok, num_tokens).reshape(-1, 8)


def launch_order(meta: jax.Array, num_heads: int, interpret) -> jax.Array:
    """The tile pairs in the order the programs take them (``meta`` from :func:`pair_layout`; rank
    ``r`` is pair ``order[r // Hq]``, query head ``r % Hq``): the most keys first (longest processing
    time first), unowned pairs last. A causal pair's work grows with its ``kv_end``; in pair order a
    prefill's longest pairs ran in the last wave with most SMs idle.

    On the GPU, launches of at most one item per SM keep pair order (they all start at once, and
    the sort costs a few microseconds); the interpreter always sorts, so the CPU tests run the
    reordered launch. (Decode launches, on the one-warpgroup kernel, need no sort: the engine orders a
    step's rows longest context first, docs/DECISIONS.md.)"""
    num_pairs = meta.shape[0]
    if interpret is None and num_pairs * num_heads <= num_cores():
        return jnp.arange(num_pairs, dtype=jnp.int32)
    work = jnp.where(meta[:, 0] >= 0, meta[:, 2], -1)
    return jnp.argsort(-work, stable=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_kv", "num_slots"))
def paged_prefill_mgpu(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale: float, interpret,
                       block_kv: int, num_slots: int):
    """The prefill kernel after ``attention.paged_attention_mgpu``'s
    validation; ``layer`` an ``i32[]``, ``interpret`` ``None`` or an ``InterpretGPUParams``. Over an fp8
    pool ``block_kv`` is its block size."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    block_size = block_size_of(kv_pool)
    group = num_q_heads // num_kv_heads
    # The queries are read and the outputs written in place: TMA boxes of 64 rows from multiples of 8.
    padded = max(-(-num_tokens // 8) * 8, NUM_COMPUTE * BLOCK_M)
    if padded != num_tokens:  # (a copy, only of launches of under 128 tokens or not a multiple of 8)
        q = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, 0)))
    # Sequences of one new token go to the decode tiles (one_token_rows) at large GQA groups, except over
    # fp8 (whose decode kernel has no tiles by sequence).
    one_token_apart = group >= DECODE_TILES_MIN_GROUP and not is_fp8(kv_pool.dtype)
    meta = pair_layout(cu_q_lens, kv_lens, padded, one_token_apart)
    num_pairs = meta.shape[0]
    num_slots_side = 2 * (kv_lens.shape[0] + 1)

    dtype = q.dtype  # the pool's, or bf16 over an fp8 pool
    fp8 = is_fp8(kv_pool.dtype)
    p_in_registers = interpret is None  # the interpreter's wgmma reads shared memory only
    q_buffers = prefill_q_buffers(head_dim, block_kv, num_slots, dtype, fp8)
    tile = lambda shape, dt=dtype: plgpu.SMEM(shape, dt, transforms=transforms(dt, shape[-1]))
    scratch = [tile((q_buffers, NUM_COMPUTE, BLOCK_M, head_dim))]
    if fp8:  # slots as stored (swizzled, untiled: TMA boxes at any row) and their scale rows; f16 tiles
        staged = lambda shape: plgpu.SMEM(shape, kv_pool.dtype, transforms=(plgpu.SwizzleTransform(shape[-1]),))
        f16 = jnp.float16
        scratch += [staged((num_slots, block_kv, head_dim)), staged((num_slots, head_dim, block_kv)),
                    plgpu.SMEM((num_slots, 2, max(block_kv, TMA_ALIGN)), kv_pool.dtype),  # rows TMA-aligned
                    tile((NUM_COMPUTE, block_kv, head_dim), f16), tile((NUM_COMPUTE, head_dim, block_kv), f16),
                    tile((NUM_COMPUTE, BLOCK_M, head_dim), f16)]
        k_copies, v_copies = 3, head_dim // block_size  # keys and both scale rows; V^T's boxes
    else:
        scratch += [tile((num_slots, block_kv, head_dim)), tile((num_slots, block_kv, head_dim))]
        k_copies = v_copies = block_kv // block_size
    if not p_in_registers:
        scratch.append(tile((NUM_COMPUTE, BLOCK_M, block_kv), jnp.float16 if fp8 else dtype))
    num_items = num_pairs * num_q_heads
    # A program an SM, each looping over its items; in the interpreter a few, so that programs there
    # take several items too.
    num_programs = min(num_items, num_cores() if interpret is None else INTERPRET_PROGRAMS)
    build = functools.partial(  # (picklable: lowered_once may build it in a worker)
        plgpu.kernel,
        functools.partial(_prefill_kernel, scale_log2=scale * LOG2E, group=group, block_kv=block_kv,
                          block_size=block_size, num_slots=num_slots, p_in_registers=p_in_registers,
                          num_items=num_items, num_programs=num_programs, q_buffers=q_buffers, fp8=fp8),
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((num_slots_side, num_q_heads, 8, head_dim), q.dtype)),
        scratch_types=scratch + [
            plgpu.Barrier(num_arrivals=1, num_barriers=q_buffers * NUM_COMPUTE),
            plgpu.Barrier(num_arrivals=k_copies, num_barriers=num_slots),
            plgpu.Barrier(num_arrivals=v_copies, num_barriers=num_slots),
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_COMPUTE * num_slots),
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_COMPUTE * num_slots),
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_COMPUTE),
            plgpu.Barrier(num_arrivals=NUM_COMPUTE),
        ],
        grid=(num_programs,),
        grid_names=("program",),
        num_threads=NUM_COMPUTE + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),  # exp2 as ex2.approx.ftz: no denormal fix-up
        interpret=interpret,
        kernel_name="paged_prefill",  # (profiles name it)
    )
    order = launch_order(meta, num_q_heads, interpret)
    out, side = lowered_once.launch(build, jnp.reshape(layer, (1,)), order, meta, block_tables, q, kv_pool,
                                    interpret=interpret)
    # The rows of the groups of 8 that straddle a sequence boundary and those of the sequences of one new
    # token (the decode rows of a mixed step, from the decode tiles), each where it belongs, in one scatter
    # (``padded``: nowhere).
    rows = side_rows(cu_q_lens, padded, one_token_apart).reshape(-1)
    values = side.transpose(0, 2, 1, 3).reshape(-1, num_q_heads, head_dim)
    if one_token_apart:
        one = one_token_rows(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, scale=scale, interpret=interpret)
        rows = jnp.concatenate([rows, jnp.where(one_token_seqs(cu_q_lens), cu_q_lens[:-1], padded)])
        values = jnp.concatenate([values, one])
    out = out.at[rows].set(values, mode="drop")
    return out[:num_tokens]
