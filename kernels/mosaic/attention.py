"""Ragged paged attention for Hopper with Pallas' Mosaic GPU backend: TMA copies of pool blocks, wgmma.

Same contract as :func:`jaxpaged.kernels.paged_attention_reference.paged_attention_reference` (read its
module docstring): ``q[T, Hq, D]`` new tokens of ``S`` sequences (``cu_q_lens``), ``kv_lens`` including
the new tokens, layer ``layer`` of the pool ``[L, num_blocks, block_size, 2, Hkv, D]`` read through
``block_tables[S, W]``; causal; padding tokens give zeros; keys at or past ``kv_lens`` are never used
(stale NaN cannot leak). The Pallas-Triton kernel (``kernels/paged_attention.py``) computes the same
thing; these kernels are written for the backend Pallas develops for Hopper (Triton's is deprecated):
operands reach shared memory by the bulk tensor copy engine (TMA) and both matmuls run on wgmma.

:func:`paged_attention_mgpu` picks one of three kernels per launch:

* ``tiles.py``, the one-warpgroup kernel: query tiles of a sequence and a KV head, split-K for
  decode-shaped launches (at most two tokens a sequence) and launches of at most
  ``SMALL_LAUNCH_TOKENS`` tokens, or where ``block_q``/``num_splits`` are given.
* ``prefill.py``, the warp-specialised kernel (prefill, chunked prefill, mixed steps): two compute
  warpgroups share each K/V tile and a third issues the copies.
* ``decode.py``, keys on wgmma's M (``uniform_decode``: the caller says no sequence has more than one
  new token; bf16 and fp8 pools): a decode token's ``G`` query rows cost wgmma ``N = 8`` columns
  instead of 64 rows.

docs/DECISIONS.md has the measurements behind each boundary.

Scope: bf16 pools on the GPU. A float32 pool runs in interpret mode only: Hopper's wgmma has no
fp32 inputs (float32 operands run as TF32, about 10 mantissa bits, not the reference's fp32), and
Mosaic GPU does not lower a float32 ``P V`` at all ("Only f16 WGMMA supports transposes": the
values' tile is N-major, 32-bit wgmma operands must be K-major). fp8 pools (kernels/fp8.py) with
bf16 queries, one pool block a KV tile (block size 64 or 128; ``fp8.py`` has the arithmetic): prefill
and mixed launches on the warp-specialised kernel where it fits (two slots or more), else on the
one-warpgroup kernel. ``head_dim`` 64 or 128; block sizes 8 to 128 (powers of two); ``G <= 64``.

In a profile the kernels are ``<name>_mosaic_gpu_kernel``: ``paged_attention_tiles`` (the query
tiles: decode and short launches), ``one_token_rows`` (the decode rows of a prefill launch),
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

import jax
import jax.numpy as jnp

from jaxpaged.kernels.fp8 import is_fp8
from jaxpaged.kernels.kv_write import block_size_of, check_pool
from jaxpaged.kernels.metadata import check_ragged_metadata
from jaxpaged.kernels.mosaic.common import (BLOCK_M, BLOCK_SIZES, HEAD_DIMS, MAX_KV_TILE, MIN_KV_TILE, NUM_SLOTS,
                                            SMEM_BYTES, interpret_params, interpreter_threads, kv_tile,
                                            pool_dtypes)
from jaxpaged.kernels.mosaic.decode import paged_decode_mgpu
from jaxpaged.kernels.mosaic.layout import choose_splits
from jaxpaged.kernels.mosaic.prefill import NUM_COMPUTE, paged_prefill_mgpu, prefill_kv_tile, prefill_smem_bytes
from jaxpaged.kernels.mosaic.tiles import MAX_TILE_TOKENS, paged_attention_tiles, smem_bytes
from jaxpaged.kernels.shapes import is_pow2
from jaxpaged.kernels.split_k import MAX_SPLITS

# Launches of at most this many tokens run the query tiles with split-K even where they are not decode-shaped
# (a short prompt alone, a chat turn after its cached history): see paged_attention_mgpu's docstring.
SMALL_LAUNCH_TOKENS = 128


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
        ``block_q`` 1 runs ``decode.py``'s kernel: a token a tile).
        num_splits: programs sharing a query tile's keys (split-K, a power of two <= 32); default
        :func:`choose_splits`. All for tuning: any value gives the same result (to rounding).
      decode: the decode configuration (the query tiles, split-K by :func:`choose_splits` over the
        tiles the launch's tokens fill) or, ``False``, the prefill kernel; by default decode
        where the launch has at most two tokens a sequence or at most ``SMALL_LAUNCH_TOKENS`` tokens.
        On the prefill kernel a short launch that is not decode-shaped (a 32-token prompt alone, padded
        to 8 sequences) pays the copies around it (queries into 128 rows, the side output's scatter, the
        output's copy back), and its few programs read a cached prefix unsplit: the tiles with split-K
        are faster there, up to ``SMALL_LAUNCH_TOKENS`` (docs/DECISIONS.md).
      uniform_decode: the caller knows that no sequence has more than one new token (an engine's decode
        step). Such a launch runs ``decode.py``'s kernel (keys on wgmma's M, a program a token). Not
        inferred from shapes over bf16: an engine pads a short prompt's step to as many sequences as
        tokens too, and there a program a token reads the prompt's cached prefix once a token (over fp8
        alike).
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
        prefill = interpreter_threads() >= NUM_COMPUTE + 2  # (its docstring)
    if block_kv is None:  # (over fp8 one pool block: kv_tile)
        tiles = prefill_kv_tile if prefill and not is_fp8(kv_pool.dtype) else kv_tile
        block_kv = tiles(block_size_of(kv_pool)) if kv_pool.ndim == 6 else MIN_KV_TILE
    if prefill and is_fp8(kv_pool.dtype) and q.ndim == 3:
        # Over fp8 the prefill kernel needs two slots or more, and room for its f16 tiles beside the fp8
        # slots (blocks of 128 at head_dim 128 have none): its docstring. Else the one-warpgroup kernel.
        prefill = num_slots >= 2 and (
            prefill_smem_bytes(q.shape[-1], block_kv, num_slots, q.dtype, False, fp8=True) <= SMEM_BYTES)
    _validate(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, interpret, block_kv, num_slots, block_q,
              num_splits, prefill)
    if prefill:
        return paged_prefill_mgpu(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                                  scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
                                  interpret=interpret_params(interpret), block_kv=block_kv, num_slots=num_slots)
    # Keys on wgmma's M, a token a program (decode.py): a uniform decode launch (a decode
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
        return paged_decode_mgpu(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                                 scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
                                 interpret=interpret_params(interpret), block_kv=block_kv, num_slots=num_slots,
                                 num_splits=num_splits)
    return paged_attention_tiles(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                                 scale=None if scale is None else float(scale),
                                 interpret=interpret_params(interpret), block_kv=block_kv, num_slots=num_slots,
                                 block_q=block_q, num_splits=num_splits)
