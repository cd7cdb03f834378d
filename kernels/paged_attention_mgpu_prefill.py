"""Ragged paged prefill for Hopper with Mosaic GPU: two compute warpgroups share every K/V tile, a third
warpgroup only issues the copies (warp specialisation, as in FlashAttention-3).

Same contract as :func:`jaxpaged.kernels.paged_attention_mgpu.paged_attention_mgpu` (and the
reference): ``q[T, Hq, D]`` new tokens of ragged sequences over the paged pool, causal, zeros for
padding tokens, stale (even NaN) keys and values at or past ``kv_lens`` never reach an output. That
kernel gives each program one warpgroup and 64 query rows, and the warpgroup itself issues its K/V
copies, waits for them and then computes; this one is for launches with many new tokens a sequence
(prefill, chunked prefill, prefix hits), where a program's arithmetic, not its reads, sets the pace:

  * A program owns a *pair* of query tiles of one sequence for one KV head: ``2 * block_q`` tokens
    (``block_q = 64 // G``), the first ``block_q`` in compute warpgroup 0's 64 rows, the next in
    warpgroup 1's. Both read the same K/V tiles from shared memory, so a tile copied once serves 128
    query rows (half the copies a query row needs in the one-warpgroup kernel).
  * Warpgroup 2 (the memory warpgroup, its registers handed to the compute warpgroups with
    ``set_max_registers``) issues each K/V tile's TMA copies, one per pool block, as soon as both
    compute warpgroups have released the slot the tile goes to (a ``*_free`` barrier per warpgroup
    and slot: a warpgroup that needs fewer tiles, the first one on the causal diagonal, stops
    releasing, and the memory warpgroup stops waiting for it, at the same tile).
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
    last token zeroes them in shared memory and signals ``zeroed``; the other warpgroup, where its
    keys reach that tile, waits for that signal before its ``P V``. Keys are only ever selected
    away (``-inf`` scores), never multiplied.
  * Programs start with the tile pairs that read the most keys (:func:`launch_order`): in tile order
    a causal prefill's longest tiles ran in the last wave.
  * Each phase of a step is a ``jax.named_scope`` (``wait_k``, ``qk``, ``softmax``, ``wait_v``, ``pv``;
    the memory warpgroup's ``wait_free``), which Mosaic GPU's profiler records per warpgroup when a
    launch sets ``profile_space`` (``benchmarks/results/mosaic/prefill_schedule/prefill_regions.py``).

Scope: as the one-warpgroup kernel (bf16 pools on the GPU, float32 in interpret mode; head_dim 64 or
128; block sizes 8-128), without split-K. Decode launches stay on that kernel
(:func:`jaxpaged.kernels.paged_attention_mgpu.paged_attention_mgpu` picks this one for the others; in
interpret mode only where the interpreter has a thread for each warpgroup and the caller:
``paged_attention_mgpu.interpreter_threads``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels.kv_write import block_size_of
from jaxpaged.kernels.shapes import num_cores

NUM_COMPUTE = 2  # compute warpgroups a program; warpgroup NUM_COMPUTE issues the copies
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40  # per thread: 2 x 128 x 232 + 128 x 40 <= 64K registers


def prefill_smem_bytes(head_dim: int, block_kv: int, num_slots: int, dtype, p_in_smem: bool) -> int:
    """Shared memory of one program: two Q (later output) tiles, ``num_slots`` K and V tiles, and in the
    interpreter the two warpgroups' P tiles."""
    rows = NUM_COMPUTE * 64
    return (rows * head_dim + 2 * num_slots * block_kv * head_dim + rows * block_kv * p_in_smem) * jnp.dtype(dtype).itemsize


def _prefill_kernel(layer_ref, order_ref, meta_ref, tables_ref, q_ref, kv_ref, o_ref, q_smem, k_smem,
                    v_smem, *refs, scale_log2: float, group: int, block_q: int, block_kv: int, block_size: int,
                    num_slots: int, p_in_registers: bool):
    """One program: KV head ``axis_index("kv_head")``, tile pair ``order_ref[axis_index("tile")]``
    (:func:`launch_order`), warpgroup ``axis_index("wg")``. GMEM refs as in the one-warpgroup kernel
    (and ``order_ref i32[tiles]``), with queries and outputs ``[Hkv, tiles, 2, R, D]`` (a warpgroup's
    ``R <= 64`` rows). Shared memory: ``q_smem [2, 64, D]``, ``k_smem/v_smem [slots, block_kv, D]``,
    in the interpreter ``p_smem [2, 64, block_kv]``; barriers
    ``q_bar[2]``, ``k_bar/v_bar[slots]`` (copies landed), ``k_free/v_free[2 * slots]`` (warpgroup ``w``
    released slot ``s``: index ``w * slots + s``), ``zeroed`` (the last tile's stale values are zero),
    ``schedule`` (the compute warpgroups' turns, two arrivals a phase)."""
    from jaxpaged.kernels.paged_attention_mgpu import BLOCK_M, _MASKED

    if p_in_registers:
        q_bar, k_bar, v_bar, k_free, v_free, zeroed, schedule = refs
        p_smem = None
    else:
        p_smem, q_bar, k_bar, v_bar, k_free, v_free, zeroed, schedule = refs

    def rendezvous():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    head_dim = q_smem.shape[-1]
    num_rows = q_ref.shape[3]
    width = tables_ref.shape[1]
    blocks_per_tile = block_kv // block_size
    wg = lax.axis_index("wg")
    h = lax.axis_index("kv_head")
    tile = order_ref[lax.axis_index("tile")]
    seq = meta_ref[tile, 0]
    pos0 = meta_ref[tile, 1]
    kv_end = meta_ref[tile, 2]
    num_kv = lax.div(kv_end + (block_kv - 1), block_kv)
    tail = lax.rem(kv_end, block_kv) != 0  # the last tile holds keys at or past kv_end (maybe stale)
    owner = (kv_end - pos0 > block_q).astype(jnp.int32)  # the warpgroup holding the pair's last token

    def key_range(w):
        """Warpgroup ``w``'s first query position, one past its last, and its KV tiles ``[0, hi)``."""
        first = pos0 + w * block_q
        end = jnp.minimum(first + block_q, kv_end)
        hi = jnp.where(first < kv_end, lax.div(end + (block_kv - 1), block_kv), 0)
        return first, end, hi

    @pl.when(seq >= 0)  # an unowned tile: nothing to do
    def _owned_tile():
        layer = layer_ref[0]

        @pl.when(wg == NUM_COMPUTE)
        def _memory_warpgroup():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            his = [key_range(w)[2] for w in range(NUM_COMPUTE)]

            def fetch(t, slot, which: int, bars):
                for b in range(blocks_per_tile):
                    blk = jnp.minimum(t * blocks_per_tile + b, width - 1)  # past the table: masked anyway
                    phys = tables_ref[seq, blk]
                    dst = (k_smem if which == 0 else v_smem).at[slot, pl.ds(b * block_size, block_size)]
                    plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, which, h, :], dst, bars.at[slot])

            for i in range(num_slots):
                @pl.when(i < num_kv)
                def _first_tiles():
                    fetch(i, i, 0, k_bar)
                    fetch(i, i, 1, v_bar)

            @pl.loop(0, jnp.maximum(num_kv - num_slots, 0))
            def _refill(t):
                slot = lax.rem(t, num_slots)
                for free, which, bars in ((k_free, 0, k_bar), (v_free, 1, v_bar)):
                    with jax.named_scope("wait_free"):
                        for w in range(NUM_COMPUTE):
                            pl.when(t < his[w])(lambda w=w, free=free: plgpu.barrier_wait(free.at[w * num_slots + slot]))
                    fetch(t + num_slots, slot, which, bars)

        @pl.when(wg < NUM_COMPUTE)
        def _compute_warpgroup():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            first, end, hi = key_range(wg)
            n_full = jnp.minimum(lax.div(first + 1, block_kv), hi)  # tiles every row sees entirely
            q_tile = q_smem.at[wg]
            q_rows = q_tile if num_rows == BLOCK_M else q_tile.at[pl.ds(0, num_rows)]
            if num_rows < BLOCK_M:  # rows past R: zeros, not stale shared memory (their outputs are dropped)
                q_tile[...] = plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), q_smem.dtype), plgpu.Layout.WGMMA)
                plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(q_ref.at[h, tile, wg], q_rows, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

            def step(t, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(t, num_slots)
                with jax.named_scope("wait_k"):
                    plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                    rendezvous()  # the other warpgroup's turn on the tensor cores
                    return acc_ref[...]

                with jax.named_scope("qk"):
                    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_M, block_kv), jnp.float32))  # unscaled scores
                plgpu.barrier_arrive(k_free.at[wg * num_slots + slot])
                with jax.named_scope("softmax"):
                    if masked:
                        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)
                        key = t * block_kv + iota((BLOCK_M, block_kv), 1)
                        last_key = jnp.minimum(first + lax.div(iota((BLOCK_M, block_kv), 0), group), end - 1)
                        s = jnp.where(key <= last_key, s, -jnp.inf)
                    # The scale is applied to the row maxima and inside exp2's argument, where the multiply
                    # and the subtraction fuse into one FMA a score (the maxima are the same: scale > 0).
                    m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_new = l_i * alpha + p.sum(axis=1)
                    if p_in_registers:
                        p16 = p.astype(v_smem.dtype)
                        acc, l_new, m_new, p16 = lax.optimization_barrier((acc, l_new, m_new, p16))
                plgpu.barrier_arrive(schedule)  # done with the softmax
                with jax.named_scope("wait_v"):
                    plgpu.barrier_wait(v_bar.at[slot])
                if masked:
                    last = jnp.logical_and(t == num_kv - 1, tail)

                    @pl.when(jnp.logical_and(last, wg == owner))
                    def _zero_stale_values():
                        v_key = t * block_kv + plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0,
                                                                      layout=plgpu.Layout.WGMMA)
                        v_smem[slot] = jnp.where(v_key < kv_end, v_smem[slot], jnp.zeros((), v_smem.dtype))
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(zeroed)

                if masked:
                    pl.when(jnp.logical_and(last, wg != owner))(lambda: plgpu.barrier_wait(zeroed))
                plgpu.barrier_wait(schedule)  # the tensor cores are free
                if p_in_registers:
                    p_op = p16
                else:
                    p_op = p_smem.at[wg]
                    p_op[...] = p.astype(p_smem.dtype)
                    plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_op, v_smem.at[slot])
                    if not p_in_registers:
                        return acc_ref[...]

                with jax.named_scope("pv"):
                    if p_in_registers:  # the wgmma accumulates into the rescaled output in place
                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    else:  # (the interpreter does not run an accumulator initialised from registers)
                        acc = acc + pl.run_scoped(pv, plgpu.ACC((BLOCK_M, head_dim), jnp.float32))
                plgpu.barrier_arrive(v_free.at[wg * num_slots + slot])
                return acc, m_new, l_new

            rows = plgpu.Layout.WGMMA.reduce(1)
            carry = (
                plgpu.layout_cast(jnp.zeros((BLOCK_M, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((BLOCK_M,), _MASKED, jnp.float32), rows),
                plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), rows),
            )
            pl.when(wg == 1)(rendezvous)  # warpgroup 1 starts a turn behind
            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
            acc, _, l_i = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), carry)

            @pl.loop(hi, num_kv)
            def _idle_steps(t):  # a warpgroup whose keys end a tile early keeps the turns paired
                rendezvous()
                rendezvous()

            pl.when(wg == 0)(rendezvous)
            out = acc / lax.broadcast_in_dim(jnp.where(l_i > 0, l_i, 1.0), acc.shape, [0])
            q_tile[...] = out.astype(q_smem.dtype)  # Q is done
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_rows, o_ref.at[h, tile, wg])
            plgpu.wait_smem_to_gmem(0)


def launch_order(meta: jax.Array, num_kv_heads: int, interpret) -> jax.Array:
    """The tile pairs in the order their programs start (``meta`` from ``tile_layout``): the most
    keys first (longest processing time first), unowned tiles last. A causal tile's work grows with
    its ``kv_end``, and Pallas starts a grid's programs in index order, so in tile order a prefill's
    longest tiles ran in the last wave with most SMs idle: 1.29x this order's time over 2,048 new
    tokens, 1.43x in a ragged step of mixed lengths and prefixes (H200, ``benchmarks/RESULTS.md``).

    On the GPU, launches of at most one program per SM keep tile order (they all start at once, and
    the sort costs a few microseconds); the interpreter always sorts, so the CPU tests run the
    reordered launch. (Decode launches, on the one-warpgroup kernel, need no sort: the engine orders a
    step's rows longest context first, docs/DECISIONS.md.)"""
    num_tiles = meta.shape[0]
    if interpret is None and num_tiles * num_kv_heads <= num_cores():
        return jnp.arange(num_tiles, dtype=jnp.int32)
    work = jnp.where(meta[:, 0] >= 0, meta[:, 2], -1)
    return jnp.argsort(-work, stable=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_kv", "num_slots"))
def paged_prefill_mgpu(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale: float, interpret,
                       block_kv: int, num_slots: int):
    """The prefill kernel after :func:`jaxpaged.kernels.paged_attention_mgpu.paged_attention_mgpu`'s
    validation; ``layer`` an ``i32[]``, ``interpret`` ``None`` or an ``InterpretGPUParams``."""
    from jaxpaged.kernels.paged_attention_mgpu import BLOCK_M, LOG2E, _transforms, tile_layout, tile_rows

    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    block_size = block_size_of(kv_pool)
    group = num_q_heads // num_kv_heads
    block_q = BLOCK_M // group  # tokens a warpgroup
    rows = tile_rows(block_q, group)
    meta, tok0, ntok, starts = tile_layout(cu_q_lens, kv_lens, num_tokens, NUM_COMPUTE * block_q)
    num_tiles = meta.shape[0]

    # Queries as [Hkv, tiles, 2, R, D]: row r of warpgroup w is token w * block_q + r // G, head r % G.
    r = jnp.arange(rows, dtype=jnp.int32)
    row_tok = jnp.arange(NUM_COMPUTE, dtype=jnp.int32)[:, None] * block_q + r[None, :] // group  # [2, R]
    row_ok = (r < block_q * group)[None, None, :] & (row_tok[None] < ntok[:, None, None])  # [tiles, 2, R]
    tok = jnp.clip(tok0[:, None, None] + row_tok[None], 0, num_tokens - 1)
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_tiles = q4[tok, :, jnp.broadcast_to(r % group, tok.shape), :]  # [tiles, 2, R, Hkv, D]
    q_tiles = jnp.where(row_ok[..., None, None], q_tiles, jnp.zeros((), q.dtype)).transpose(3, 0, 1, 2, 4)

    dtype = kv_pool.dtype
    p_in_registers = interpret is None  # the interpreter's wgmma reads shared memory only
    scratch = [
        plgpu.SMEM((NUM_COMPUTE, BLOCK_M, head_dim), dtype, transforms=_transforms(dtype)),
        plgpu.SMEM((num_slots, block_kv, head_dim), dtype, transforms=_transforms(dtype)),
        plgpu.SMEM((num_slots, block_kv, head_dim), dtype, transforms=_transforms(dtype)),
    ]
    if not p_in_registers:
        scratch.append(plgpu.SMEM((NUM_COMPUTE, BLOCK_M, block_kv), dtype, transforms=_transforms(dtype)))
    per_tile = block_kv // block_size
    kernel = plgpu.kernel(
        functools.partial(_prefill_kernel, scale_log2=scale * LOG2E, group=group, block_q=block_q,
                          block_kv=block_kv, block_size=block_size, num_slots=num_slots,
                          p_in_registers=p_in_registers),
        out_type=jax.ShapeDtypeStruct((num_kv_heads, num_tiles, NUM_COMPUTE, rows, head_dim), q.dtype),
        scratch_types=scratch + [
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_COMPUTE),
            plgpu.Barrier(num_arrivals=per_tile, num_barriers=num_slots),
            plgpu.Barrier(num_arrivals=per_tile, num_barriers=num_slots),
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_COMPUTE * num_slots),
            plgpu.Barrier(num_arrivals=1, num_barriers=NUM_COMPUTE * num_slots),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=NUM_COMPUTE),
        ],
        grid=(num_tiles, num_kv_heads),  # the last axis varies fastest: a tile's KV heads run side by side
        grid_names=("tile", "kv_head"),
        num_threads=NUM_COMPUTE + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),  # exp2 as ex2.approx.ftz: no denormal fix-up
        interpret=interpret,
    )
    order = launch_order(meta, num_kv_heads, interpret)
    o_tiles = kernel(jnp.reshape(layer, (1,)), order, meta, block_tables, q_tiles, kv_pool)

    # Back to token order: token t is row ((t - cu[s]) % block_q) * G + g of warpgroup
    # ((t - cu[s]) % (2 block_q)) // block_q of tile starts[s] + (t - cu[s]) // (2 block_q).
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = kv_lens.shape[0]
    seq_t = jnp.clip(jnp.sum(cu_q_lens[None, :] <= t[:, None], axis=1, dtype=jnp.int32) - 1, 0, num_seqs - 1)
    off = t - cu_q_lens[seq_t]
    pair = NUM_COMPUTE * block_q
    tile_t = jnp.clip(starts[seq_t] + off // pair, 0, num_tiles - 1)
    wg_t = (off % pair) // block_q
    row_t = jnp.clip((off % block_q) * group, 0, rows - group)
    o = o_tiles.transpose(1, 2, 3, 0, 4)  # [tiles, 2, R, Hkv, D]
    g = jnp.arange(group, dtype=jnp.int32)[None, :]
    out = o[tile_t[:, None], wg_t[:, None], row_t[:, None] + g]  # [T, G, Hkv, D]
    out = out.transpose(0, 2, 1, 3).reshape(num_tokens, num_q_heads, head_dim)
    valid = t < cu_q_lens[num_seqs]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))
