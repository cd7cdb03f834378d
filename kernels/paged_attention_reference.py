"""Ragged paged attention in plain jnp: the ground truth the Pallas kernel is tested against, and
the attention of the ``reference`` backend (any platform).

KV pool layout: one array for the whole model, ``kv_pool: [L, num_blocks, block_size, 2, Hkv, D]``
(``[..., 0, :, :]`` keys, ``[..., 1, :, :]`` values); attention reads layer ``layer`` (a static index:
never a slice of the pool, which XLA would copy) and each layer's K/V write is one in-place scatter
into the donated pool (:func:`jaxpaged.kernels.kv_write.write_kv`, the one K/V write every backend
uses; why one array: see that module).

A ragged batch of ``S`` sequences carries ``T`` query tokens (padding included):
  * ``cu_q_lens i32[S+1]``: token ``t`` in ``[cu_q_lens[i], cu_q_lens[i+1])`` belongs to sequence ``i``;
    tokens at or past ``cu_q_lens[S]`` are padding and produce zeros.
  * ``kv_lens i32[S]``: tokens of context of sequence ``i`` *including* its new tokens, so the new
    tokens sit at positions ``kv_lens[i] - q_len .. kv_lens[i] - 1`` (decode: ``q_len == 1``; a prefix
    hit or a later chunk: ``q_len < kv_len``). Padding sequences have ``q_len == 0``.
  * ``block_tables i32[S, W]``: logical block ``j`` of sequence ``i`` lives in physical block
    ``block_tables[i, j]``. Entries past the sequence's last block may hold anything in range.
Attention is causal: new token at position ``p`` sees keys ``0..p``. Keys at or past ``kv_lens[i]`` are
never used, even if they hold NaN (blocks are reused without zeroing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.kernels.fp8 import dequantize, is_fp8, values_from_slab
from jaxpaged.kernels.kv_write import block_size_of
from jaxpaged.kernels.matmul import dot_precision


def token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, ...]:
    """For each of ``num_tokens`` query tokens: its sequence index, its absolute position, validity.

    Returns ``(seq_ids i32[T], positions i32[T], valid bool[T])``.
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = kv_lens.shape[0]
    # searchsorted without its while loop (a loop's predicate is read back on the GPU): S+1 compares.
    seq_ids = jnp.sum(cu_q_lens[None, :] <= t[:, None], axis=1, dtype=jnp.int32) - 1
    seq_ids = jnp.clip(seq_ids, 0, num_seqs - 1)
    valid = t < cu_q_lens[num_seqs]
    q_start = cu_q_lens[seq_ids]
    q_len = cu_q_lens[seq_ids + 1] - q_start
    positions = kv_lens[seq_ids] - q_len + (t - q_start)
    return seq_ids, positions, valid


def paged_attention_reference(
    q: jax.Array,
    kv_pool: jax.Array,
    layer: int,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Ragged paged attention, computed token by token with a gather of each token's blocks.

    Args:
      q: ``[T, Hq, D]`` queries of the new tokens (``Hq`` a multiple of ``Hkv``; query head ``h``
        reads KV head ``h // (Hq // Hkv)``, Hugging Face's ``repeat_kv`` order).
      kv_pool: ``[L, num_blocks, block_size, 2, Hkv, D]``, layer ``layer`` already holding the new
        tokens' K/V (fp8: ``block_size + 1`` rows a block, the last the scales; ``kernels/fp8.py``).
      cu_q_lens, kv_lens, block_tables: see the module docstring.
      scale: softmax scale, default ``1/sqrt(D)``.
    Returns ``[T, Hq, D]`` in ``q.dtype``; scores, max and sum in fp32; padding tokens give zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    block_size = block_size_of(kv_pool)
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = head_dim**-0.5
    seq_ids, positions, valid = token_layout(cu_q_lens, kv_lens, num_tokens)
    tables = block_tables[seq_ids]  # [T, W]
    width = tables.shape[1]
    if is_fp8(kv_pool.dtype):  # row bs holds each slot's scales at [.., bs, kv, h, slot]: dequantise in fp32
        rows = kv_pool[layer, tables]  # [T, W, bs + 1, 2, Hkv, D]: a gather, never a copy of the layer
        scales = jnp.moveaxis(rows[:, :, block_size, :, :, :block_size], -1, 2)  # [T, W, bs, 2, Hkv]
        values = values_from_slab(rows[:, :, :block_size, 1])  # stored transposed per (block, head)
        rows = dequantize(jnp.stack([rows[:, :, :block_size, 0], values], axis=3), scales)
        keys, values = rows[:, :, :, 0], rows[:, :, :, 1]
    else:  # keys and values in a gather each, [T, W, bs, Hkv, D] (on a CPU faster than one gather of whole
        # rows and their slices)
        keys, values = kv_pool[layer, tables, :, 0], kv_pool[layer, tables, :, 1]
    keys = keys.reshape(num_tokens, width * block_size, num_kv_heads, head_dim).astype(jnp.float32)
    values = values.reshape(num_tokens, width * block_size, num_kv_heads, head_dim)
    key_pos = jnp.arange(width * block_size, dtype=jnp.int32)
    mask = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] < kv_lens[seq_ids][:, None])
    mask = mask & valid[:, None]  # [T, K]
    # Stale slots may hold NaN: their scores are replaced by -inf below (keys are only ever selected
    # away), and their values zeroed so that 0 * NaN never reaches the output.
    values = jnp.where(mask[:, :, None, None], values, 0).astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    hi = dot_precision(jnp.float32)  # fp32 math here whatever the storage: IEEE, never TF32
    scores = jnp.einsum("tkgd,tskd->tkgs", qf, keys, precision=hi) * scale
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tkgs,tskd->tkgd", p, values, precision=hi) / jnp.where(denom == 0, 1.0, denom)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
