"""Ragged paged attention on GPU: one Pallas (Triton lowering) kernel, two launch configurations.

Same contract as :func:`jaxpaged.kernels.paged_attention_reference.paged_attention_reference` (read its module
docstring): ``q[T, Hq, D]`` new tokens of ``S`` sequences (``cu_q_lens``), ``kv_lens`` including the new
tokens, layer ``layer`` of the pool ``[L, num_blocks, block_size, 2, Hkv, D]`` (one array for every
layer, see ``kv_write.py``) read through ``block_tables[S, W]``; causal; padding tokens give zeros; keys
at or past ``kv_lens`` are never used (stale NaN cannot leak).

How the work is cut (the scheme of vLLM's Triton "unified attention", written for Pallas):
  * A *query tile* is ``block_q`` consecutive new tokens of one sequence times the ``G = Hq // Hkv``
    query heads that share one KV head, i.e. ``block_m = block_q * G`` rows (padded up to a power of two,
    at least 16 for Triton's ``dot``). Every K/V tile loaded from the pool serves all those rows.
  * Sequence ``i`` owns tiles ``cu_q_lens[i] // block_q + i + j`` for ``j < cdiv(q_len_i, block_q)``;
    a program finds its sequence by a binary search over ``cu_q_lens`` (no host-side metadata). A
    virtual sequence ``S`` covers the padding tokens ``[cu_q_lens[S], T)`` and writes their zeros, so
    every output element is written by exactly one program. Unowned tiles exit at once.
  * Grid ``(Hkv, num_tiles, num_splits)``: the KV head is the fastest launch axis, so the programs of one
    sequence read neighbouring bytes of each pool block at the same time.
  * KV tiles of ``block_k`` tokens (``block_k / block_size`` pool blocks, physical ids gathered from the
    block table inside the kernel). Tiles entirely at or before the tile's first query position need no
    mask; only the causal diagonal / the ``kv_len`` tail is masked, and there K and V are loaded with a
    mask at the tile's ``kv_end`` (masked positions read as zeros and cost no memory traffic), so stale
    slots never enter the arithmetic (an fp8 pool's masked tile is read whole; its stale values are
    zeroed and its stale keys reach only scores the causal mask replaces, see below). Tiles past the
    last query position are never loaded.
  * Decode configuration (``T <= 2 S``): ``block_m = 16``, the context split over ``num_splits``
    programs (split-K) when the batch is too small to fill the GPU; each split writes a normalised
    partial output and its log-sum-exp, merged by a few XLA ops. Prefill configuration: ``block_m``
    64-128, no split, query tiles processed last-first (longest causal rows start first).
Softmax in base 2 with fp32 scores, running max and sum; ``P`` is cast to the pool dtype for ``P @ V``
(fp32 pools use IEEE fp32 dots: ``DotAlgorithmPreset.F32_F32_F32``, Triton ``input_precision="ieee"``).

An fp8 pool (``kernels/fp8.py``) is read in KV tiles of ``FP8_TILE`` = 64 slots (``block_k``). With a
block size of 64 or more (an fp8 pool's default) a tile lies in one pool block: its block id is one
scalar, and its keys (``[64, D]``), its values, stored transposed (``[D, 64]``, each dimension's slots
consecutive bytes) and its two scale vectors are contiguous loads. Smaller blocks are read with a
block id per slot (correct, slower: gathered columns). The tiles are converted exactly to f16
(bf16/f16 queries, each row first brought into f16's range by a power of two; float32 queries:
float32); the K scales multiply the scores' columns and the V scales, relative to each row's largest
in the tile, the probabilities' columns (docs/NUMERICS.md). A masked tile inside one block is read whole
and its values and V scales past ``kv_end`` zeroed (stale keys only reach scores the causal mask
replaces). Why: f16 tiles over a block-64 pool in this layout were the fastest of the variants measured
(bf16 tiles, values in key order, whose 8-bit ``P @ V`` operand is strided along its contracted axis,
block-16 tiles with scalar ids, load masks on the masked tiles: docs/DECISIONS.md), faster than the
bf16 pool itself. The tile is 64 slots whatever the block size, so block sizes 8-128 give the same
arithmetic (batch-invariant mode keeps agreeing across block sizes).

Batch-invariant configuration (:func:`invariant_config`, ``batch_invariant=True``): one launch
configuration for every step, prefill or decode: fixed ``block_m``, ``block_k`` fixed in tokens (tile
``t`` always covers positions ``[t*block_k, (t+1)*block_k)`` whatever the pool's block size, up to 64),
no split-K (every row reduces its context from tile 0 upwards in one program), and every KV tile
through the same masked code path (``mask_all``). A query row then sees the same tiles, the same
values and the same instructions whether it is decoded alone, batched, or computed inside a prefill
chunk of any length: tiles past its position contribute exact zeros (``p = 0``, ``alpha = 1``), and a
shared code path means the compiler cannot contract ``s * scale - m`` into an FMA in one place and
not in another.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpaged.kernels.fp8 import is_fp8, power_of_two, scale_rows, v_slab_index
from jaxpaged.kernels.kv_write import block_size_of, check_pool, check_triton_addressable
from jaxpaged.kernels.metadata import check_ragged_metadata
from jaxpaged.kernels.shapes import next_pow2, num_cores as device_num_cores
from jaxpaged.kernels.split_k import decode_splits, merge_splits
from jaxpaged.kernels.matmul import kernel_dot_precision

LOG2E = math.log2(math.e)
FP8_TILE = 64  # slots of an fp8 pool's KV tile (``block_k``; module docstring)
_MASKED = -1e30  # initial running max: finite, so fully masked rows give exp2(-inf) = 0, never NaN


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static launch configuration of :func:`_ragged_attention_call`.

    block_m: query rows per program (power of two >= 16, >= G); ``block_q = block_m // G`` tokens.
    block_k: KV tokens per inner step (power of two, multiple of the pool's block size, >= 16; an fp8
      pool's: ``FP8_TILE``).
    num_splits: programs sharing one query tile's context (split-K); 1 writes the final output.
    reverse_tiles: launch query tiles last-first (prefill load balance).
    mask_all: process every KV tile through the masked path (batch-invariant mode; see module doc).
    mask_loads: the masked path's K/V loads skip positions at or past the tile's ``kv_end`` (no memory
      traffic for the tail of the last tile; they read as zeros) instead of loading and zeroing them.
      The same values either way, so the same outputs bitwise; ``False`` only for benchmarks (an fp8
      pool's masked tiles are read whole when inside one block, else with masked loads).
    """

    block_m: int
    block_k: int
    num_splits: int
    num_warps: int
    num_stages: int
    reverse_tiles: bool = False
    mask_all: bool = False
    mask_loads: bool = True


def _dot(a, b, b_contract: int, precision):
    """``a [M, K] @ b`` with ``b`` as ``[K, N]`` (``b_contract=0``) or ``[N, K]`` (1); fp32 result."""
    return lax.dot_general(a, b, (((1,), (b_contract,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def online_softmax(carry, s, pos, row_pos, pv):
    """One KV tile's update of the running ``(acc, max, sum)``: scores ``s [block_m, tile]`` (base 2,
    scaled) at key positions ``pos [tile]``, causal against ``row_pos [block_m]`` (``None``: the tile
    needs no mask); ``pv(p)`` is the tile's ``P @ V [block_m, D]`` in f32."""
    acc, m_i, l_i = carry
    if row_pos is not None:
        s = jnp.where(pos[None, :] <= row_pos[:, None], s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l_new = l_i * alpha + jnp.sum(p, axis=1)
    return acc * alpha[:, None] + pv(p), m_new, l_new


def _ragged_attention_kernel(
    layer_ref, cu_ref, kv_lens_ref, tables_ref, q_ref, kv_ref, *out_refs,
    scale_log2: float, block_m: int, group: int, block_k: int, num_splits: int,
    reverse_tiles: bool, mask_all: bool, mask_loads: bool, precision, fp8: bool,
):
    """One program: KV head ``program_id(0)``, query tile ``program_id(1)``, split ``program_id(2)``.

    Refs: ``layer_ref i32[1]`` (the pool layer to read), ``cu_ref i32[S+1]``, ``kv_lens_ref i32[S]``,
    ``tables_ref i32[S, W]``, ``q_ref [T, Hq, D]``, ``kv_ref [L, N, bs, 2, Hkv, D]`` (``fp8``: ``bs + 1``
    rows a block, the last holding each slot's K and V scales, ``kernels/fp8.py``); outputs ``o_ref [T, Hq, D]`` (one split) or
    ``o_ref f32[splits, T, Hq, D]`` and ``lse_ref f32[splits, T, Hq]`` (base-2 log-sum-exp).
    """
    num_tokens, _, head_dim = q_ref.shape
    block_size = kv_ref.shape[2] - scale_rows(kv_ref.dtype)
    num_seqs = kv_lens_ref.shape[0]
    width = tables_ref.shape[1]
    block_q = block_m // group
    h = pl.program_id(0)
    tile = pl.program_id(1)
    if reverse_tiles:
        tile = pl.num_programs(1) - 1 - tile
    split = pl.program_id(2)
    layer = layer_ref[0]

    # Sequence of this tile: the largest i in [0, S] with cu[i] // block_q + i <= tile (that start is
    # increasing in i). One vector load of cu_q_lens instead of a chain of dependent scalar loads.
    idx = lax.broadcasted_iota(jnp.int32, (next_pow2(num_seqs + 1),), 0)
    cu = plgpu.load(cu_ref.at[idx], mask=idx <= num_seqs, other=0)
    owns = (idx <= num_seqs) & (cu // block_q + idx <= tile)
    seq = jnp.sum(owns.astype(jnp.int32)) - 1
    is_pad = seq == num_seqs  # the virtual sequence of padding tokens
    seq_c = jnp.minimum(seq, num_seqs - 1)
    seq_start = jnp.sum(jnp.where(idx == seq, cu, 0))
    seq_end = jnp.where(is_pad, num_tokens, jnp.sum(jnp.where(idx == seq + 1, cu, 0)))
    kv_len = jnp.where(is_pad, 0, kv_lens_ref[seq_c])
    q_start = seq_start + (tile - (seq_start // block_q + seq)) * block_q
    first_pos = kv_len - (seq_end - seq_start) + (q_start - seq_start)  # position of token q_start

    rows = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    row_tok = q_start + rows // group
    row_ok = (rows < block_q * group) & (row_tok < seq_end)
    row_pos = jnp.where(row_ok & ~is_pad, first_pos + rows // group, -1)
    # Full integer indexers (rows x dims) work both in the Triton lowering and in interpret mode.
    # Masked-off rows may point past T: they are never accessed on GPU and dropped by the interpreter.
    dims = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    tok_ix = row_tok[:, None]
    head_ix = (h * group + rows % group)[:, None]
    q = plgpu.load(q_ref.at[tok_ix, head_ix, dims], mask=row_ok[:, None], other=0)  # [block_m, D]

    last_tok = jnp.minimum(q_start + block_q, seq_end) - 1
    kv_end = jnp.where(last_tok >= q_start, jnp.minimum(kv_len, first_pos + last_tok - q_start + 1), 0)
    kv_end = jnp.maximum(kv_end, 0)
    num_kv_tiles = pl.cdiv(kv_end, block_k)
    per_split = pl.cdiv(num_kv_tiles, num_splits)
    t0 = split * per_split
    t1 = jnp.minimum(t0 + per_split, num_kv_tiles)
    n_full = jnp.maximum(first_pos + 1, 0) // block_k  # tiles every row sees entirely
    cols = lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def step(t, carry, masked):
        pos = t * block_k + cols
        blk = jnp.minimum(pos // block_size, width - 1)
        phys = tables_ref[seq_c, blk]  # [block_k] physical block ids
        off = pos % block_size
        kv_ok = (pos < kv_end)[:, None] if masked else None
        if masked and mask_loads:  # the tail past kv_end is never read; it loads as zeros
            k = plgpu.load(kv_ref.at[layer, phys[:, None], off[:, None], 0, h, dims], mask=kv_ok, other=0)
            v = plgpu.load(kv_ref.at[layer, phys[:, None], off[:, None], 1, h, dims], mask=kv_ok, other=0)
        else:
            k = kv_ref[layer, phys[:, None], off[:, None], 0, h, dims]  # [block_k, D]
            v = kv_ref[layer, phys[:, None], off[:, None], 1, h, dims]
            if masked:  # (mask_loads=False, benchmarks only: the whole tile read, its tail zeroed)
                k = jnp.where(kv_ok, k, jnp.zeros_like(k))
                v = jnp.where(kv_ok, v, jnp.zeros_like(v))
        s = _dot(q, k, 1, precision) * scale_log2  # [block_m, block_k] f32
        return online_softmax(carry, s, pos, row_pos if masked else None,
                              lambda p: _dot(p.astype(v.dtype), v, 0, precision))

    def step_fp8(t, carry, masked):
        """One KV tile of an fp8 pool: ``FP8_TILE`` slots, one pool block's or part of one when the
        block size allows (module docstring)."""
        pos = t * block_k + cols
        if block_size >= block_k:  # the tile lies in one block: one block id, contiguous loads
            phys = tables_ref[seq_c, jnp.minimum(t * block_k // block_size, width - 1)]
            # The tile's first slot, written so Triton sees it is a multiple of block_k (``%`` of a
            # traced value hides that, and the 8-bit loads then go one byte at a time).
            off = cols if block_size == block_k else (t % (block_size // block_k)) * block_k + cols
            phys_k = phys_v = phys
        else:  # smaller blocks: a block id per slot
            phys = tables_ref[seq_c, jnp.minimum(pos // block_size, width - 1)]
            off = pos % block_size
            phys_k, phys_v = phys[:, None], phys[None, :]
        dcol = lax.broadcasted_iota(jnp.int32, (head_dim, 1), 0)
        row, col = v_slab_index(dcol, off[None, :], block_size, head_dim)  # [D, 1], [D, tile]
        k_at = kv_ref.at[layer, phys_k, off[:, None], 0, h, dims]  # [tile, D]
        vt_at = kv_ref.at[layer, phys_v, row, 1, h, col]  # [D, tile]: values stored transposed
        ks_at = kv_ref.at[layer, phys, block_size, 0, h, off]
        vs_at = kv_ref.at[layer, phys, block_size, 1, h, off]
        if masked and block_size >= block_k:  # whole tile (inside one allocated block), its tail zeroed
            # Stale slots may hold anything, NaN included. Their keys only reach scores that the causal
            # mask replaces by -inf; their values and V scales are zeroed so that p = 0 meets 0, not NaN.
            ok = pos < kv_end
            k, ks = plgpu.load(k_at).astype(cdt), plgpu.load(ks_at).astype(jnp.float32)
            vt = jnp.where(ok[None, :], plgpu.load(vt_at).astype(cdt), 0)
            vs = jnp.where(ok, plgpu.load(vs_at).astype(jnp.float32), 0.0)
        elif masked:  # a block id per slot: slots past kv_end may lie in no allocated block, never read
            ok = pos < kv_end  # (Triton has no fp8 fill value: zeroed after the cast)
            k = jnp.where(ok[:, None], plgpu.load(k_at, mask=ok[:, None]).astype(cdt), 0)
            vt = jnp.where(ok[None, :], plgpu.load(vt_at, mask=ok[None, :]).astype(cdt), 0)
            ks = jnp.where(ok, plgpu.load(ks_at, mask=ok).astype(jnp.float32), 0.0)
            vs = jnp.where(ok, plgpu.load(vs_at, mask=ok).astype(jnp.float32), 0.0)
        else:
            k, vt = plgpu.load(k_at).astype(cdt), plgpu.load(vt_at).astype(cdt)
            ks, vs = plgpu.load(ks_at).astype(jnp.float32), plgpu.load(vs_at).astype(jnp.float32)
        if not to_f16:
            s = _dot(q_c, k, 1, precision) * (scale_log2 * ks)[None, :]  # [block_m, tile]
            return online_softmax(carry, s, pos, row_pos if masked else None,
                                  lambda p: _dot((p * vs[None, :]).astype(cdt), vt, 1, precision))
        s = _dot(q_c, k, 1, precision) * q_scale[:, None] * (scale_log2 * ks)[None, :]
        # f16 P: each row's V scales relative to the largest that row sees in the tile (powers of two,
        # so exactly; per row, so a row's bits never depend on other rows' positions), which then
        # scales the row of P @ V. P x scale stays in [0, 1], where f16 keeps 11 significant bits.
        if masked:
            v_max = jnp.max(jnp.where(pos[None, :] <= row_pos[:, None], vs[None, :], 0.0), axis=1)
            v_max = jnp.where(v_max > 0, v_max, 1.0)
            v_rel = vs[None, :] * (1.0 / v_max)[:, None]
        else:  # every row sees the whole tile
            v_max = jnp.max(vs)
            v_max = jnp.where(v_max > 0, v_max, 1.0)
            v_rel = (vs * (1.0 / v_max))[None, :]
            v_max = jnp.full((block_m,), v_max)
        return online_softmax(carry, s, pos, row_pos if masked else None,
                              lambda p: _dot((p * v_rel).astype(cdt), vt, 1, precision) * v_max[:, None])

    if fp8:
        step = step_fp8
        # Tiles are converted to f16 for 16-bit queries: on sm_90 an fp8 pair becomes an f16 pair in one
        # instruction, a bf16 pair takes several (measured: docs/DECISIONS.md). Each query row is first
        # multiplied by a power of two (exact) that brings its largest element to [2**14, 2**15), in
        # f16's range with f16's full precision; the row's scores are multiplied back.
        to_f16 = jnp.dtype(q.dtype).itemsize == 2
        cdt = jnp.float16 if to_f16 else q.dtype
        if to_f16:
            q32 = q.astype(jnp.float32)
            row_max = jnp.max(jnp.abs(q32), axis=1)
            # floor(log2(row_max)) read from the float's exponent bits (exact; zero rows: -127)
            row_exp = ((lax.bitcast_convert_type(row_max, jnp.int32) >> 23) & 0xFF) - 127
            q_exp = jnp.clip(row_exp - 14, -100, 113)
            q_c = (q32 * power_of_two(-q_exp)[:, None]).astype(cdt)
            q_scale = power_of_two(q_exp)  # [block_m]
        else:
            q_c = q

    carry = (
        jnp.zeros((block_m, head_dim), jnp.float32),
        jnp.full((block_m,), _MASKED, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )
    mid = t0 if mask_all else jnp.clip(n_full, t0, t1)
    carry = lax.fori_loop(t0, mid, functools.partial(step, masked=False), carry)
    acc, m_i, l_i = lax.fori_loop(mid, t1, functools.partial(step, masked=True), carry)

    has = l_i > 0
    out = acc / jnp.where(has, l_i, 1.0)[:, None]
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[tok_ix, head_ix, dims], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, lse_ref = out_refs
        plgpu.store(o_ref.at[split, tok_ix, head_ix, dims], out, mask=row_ok[:, None])
        lse = jnp.where(has, m_i + jnp.log2(jnp.where(has, l_i, 1.0)), -jnp.inf)
        plgpu.store(lse_ref.at[split, row_tok, head_ix[:, 0]], lse, mask=row_ok)


def _ragged_attention_call(q, kv_pool, layer: jax.Array, cu_q_lens, kv_lens, block_tables, *, scale: float,
                           config: AttentionConfig, interpret: bool):
    """pallas_call wrapper. Returns ``[T, Hq, D]`` (one split) or ``(o f32[P,T,Hq,D], lse f32[P,T,Hq])``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    num_seqs = kv_lens.shape[0]
    group = num_q_heads // num_kv_heads
    block_q = config.block_m // group
    num_tiles = pl.cdiv(num_tokens, block_q) + num_seqs + 1
    splits = config.num_splits
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_tokens, num_q_heads), jnp.float32),
        )
    kernel = functools.partial(
        _ragged_attention_kernel, scale_log2=scale * LOG2E, block_m=config.block_m, group=group,
        block_k=config.block_k, num_splits=splits, reverse_tiles=config.reverse_tiles,
        mask_all=config.mask_all, mask_loads=config.mask_loads, fp8=is_fp8(kv_pool.dtype),
        precision=kernel_dot_precision(q.dtype if is_fp8(kv_pool.dtype) else kv_pool.dtype),
    )
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_tiles, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_m{config.block_m}_k{config.block_k}_p{splits}",
    )(jnp.reshape(layer, (1,)), cu_q_lens, kv_lens, block_tables, q, kv_pool)


def kv_tile(block_size: int, fp8: bool) -> int:
    """``block_k`` of every configuration: 64 tokens (or one block, if larger); ``FP8_TILE`` for an fp8 pool."""
    return FP8_TILE if fp8 else max(64, block_size)


def choose_config(num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                  block_size: int, max_context: int, num_cores: int | None = None,
                  decode: bool | None = None, fp8: bool = False) -> AttentionConfig:
    """Static launch configuration: the decode one (small query tiles, split-K) or the prefill one.

    ``decode``: an explicit choice; ``None`` (the engine's) decides from the padded shapes
    (``T <= 2 S``), so a 256-slot engine runs every step of <= 512 tokens, prefill chunks included,
    with the decode configuration: for prefill chunks of <= 512 tokens the 16-row decode tiles are as
    fast as the prefill tiles, and telling the kernel what each step holds would double the compiled
    step variants (a longer warm-up), so the engine does not (docs/DECISIONS.md). ``fp8``: the pool is
    fp8 (``block_k`` is ``FP8_TILE``).
    """
    group = num_q_heads // num_kv_heads
    if decode is None:
        decode = num_tokens <= 2 * num_seqs
    if num_cores is None:
        num_cores = device_num_cores()
    if decode:
        block_m = max(16, next_pow2(group))
        block_k = kv_tile(block_size, fp8)
        splits = decode_splits(num_tokens, num_seqs, num_kv_heads, block_k, max_context, num_cores)
        return AttentionConfig(block_m, block_k, splits, num_warps=4, num_stages=3)
    block_m = max(128 if num_tokens >= 1024 else 64, next_pow2(group))
    return AttentionConfig(block_m, kv_tile(block_size, fp8), 1, num_warps=8 if block_m >= 128 else 4,
                           num_stages=2, reverse_tiles=True)


def invariant_config(num_q_heads: int, num_kv_heads: int, block_size: int, fp8: bool = False) -> AttentionConfig:
    """The batch-invariant launch configuration: the same for every step of an engine, prefill or
    decode, whatever the batch (a function of the model's head counts and the pool's block size only;
    ``block_k = 64`` tokens for every block size up to 64, ``FP8_TILE`` for an fp8 pool, so those
    block sizes agree bitwise too).

    It is the decode configuration of a large batch (16-row query tiles, no split), so batched decode,
    most of a serving workload's steps, costs what it costs by default; prefill gets small query
    tiles (each KV tile serves fewer tokens, mostly from L2) and small decode batches lose split-K."""
    group = num_q_heads // num_kv_heads
    return AttentionConfig(block_m=max(16, next_pow2(group)), block_k=kv_tile(block_size, fp8),
                           num_splits=1, num_warps=4, num_stages=3, reverse_tiles=True, mask_all=True)


def _validate(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables):
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    check_pool(kv_pool, layer)
    check_triton_addressable(kv_pool)
    num_q_heads, head_dim = q.shape[1:]
    _, _, _, _, num_kv_heads, d = kv_pool.shape
    block_size = block_size_of(kv_pool)
    if d != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) != head_dim of the pool ({d})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    for name, n in (("head_dim", head_dim), ("block_size", block_size)):
        if n & (n - 1) or n < 8:
            raise ValueError(f"{name} must be a power of two >= 8 (Triton tiles), got {n}")
    check_ragged_metadata(cu_q_lens, kv_lens, block_tables)


def paged_attention(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool = False,
    config: AttentionConfig | None = None,
    decode: bool | None = None,
    batch_invariant: bool = False,
) -> jax.Array:
    """Ragged paged attention (decode and prefill with cached prefix) with Pallas on GPU.

    Args:
      q: ``[T, Hq, D]``; kv_pool: ``[L, num_blocks, block_size, 2, Hkv, D]`` (bf16 or fp32), read at
        layer ``layer`` (a Python int);
      cu_q_lens ``i32[S+1]``, kv_lens ``i32[S]``, block_tables ``i32[S, W]``: as in the reference.
      scale: softmax scale, default ``1/sqrt(D)``.
      interpret: run the kernel in Pallas interpret mode (CPU tests).
      config: launch configuration; default :func:`choose_config` from the static shapes and ``decode``.
      decode: force the decode (True) or prefill (False) configuration (see :func:`choose_config`).
      batch_invariant: with no ``config``, use :func:`invariant_config` (``decode`` is then ignored):
        each token's output is bitwise independent of the batch and of prefill chunking.
    Returns ``[T, Hq, D]`` in ``q.dtype``; zeros for padding tokens.

    The layer reaches the kernel as an operand, not a constant: every layer of a step then calls one
    traced and lowered kernel (a model's step traces and lowers its attention once, not once a layer,
    which was most of a cold start's lowering time).
    """
    _validate(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables)
    return _paged_attention(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                            scale=scale, interpret=interpret, config=config, decode=decode,
                            batch_invariant=batch_invariant)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "decode", "batch_invariant"))
def _paged_attention(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, scale, interpret, config, decode,
                     batch_invariant):
    """:func:`paged_attention` after validation; ``layer`` an ``i32[]`` operand."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_pool.shape[4], block_size_of(kv_pool)
    if scale is None:
        scale = head_dim**-0.5
    fp8 = is_fp8(kv_pool.dtype)
    if config is None and batch_invariant:
        config = invariant_config(num_q_heads, num_kv_heads, block_size, fp8)
    if config is None:
        config = choose_config(num_tokens, kv_lens.shape[0], num_q_heads, num_kv_heads, block_size,
                               block_tables.shape[1] * block_size, decode=decode, fp8=fp8)
    group = num_q_heads // num_kv_heads
    if config.block_m < max(16, group) or config.block_m & (config.block_m - 1):
        raise ValueError(f"block_m={config.block_m} must be a power of two >= max(16, G={group})")
    if fp8 and config.block_k != FP8_TILE:
        raise ValueError(f"block_k={config.block_k}: an fp8 pool is read in tiles of {FP8_TILE} slots")
    if not fp8 and (config.block_k < max(16, block_size) or config.block_k % block_size or
                    config.block_k & (config.block_k - 1)):
        raise ValueError(f"block_k={config.block_k} must be a power of two multiple of "
                         f"block_size={block_size} and >= 16")
    res = _ragged_attention_call(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables,
                                 scale=float(scale), config=config, interpret=interpret)
    if config.num_splits == 1:
        return res
    return merge_splits(*res, q.dtype)
