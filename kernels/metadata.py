"""AttentionMetadata: the per-step arrays that place a ragged batch's tokens in the paged KV pool."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes and which blocks each sequence reads.

    Fields (``T`` tokens in the step, ``S`` sequences, ``W`` block-table width):
      slot_mapping: ``i32[T]`` pool slot ``block_id * block_size + offset`` of each token; -1 = padding.
      cu_q_lens: ``i32[S+1]`` cumulative new-token counts (see ``kernels/paged_attention_reference.py``).
      kv_lens: ``i32[S]`` context length of each sequence including its new tokens.
      block_tables: ``i32[S, W]`` physical block of each logical block.
    """

    slot_mapping: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array


def check_ragged_metadata(cu_q_lens: jax.Array, kv_lens: jax.Array, block_tables: jax.Array) -> None:
    """Raises a ValueError unless ``cu_q_lens i32[S+1]``, ``kv_lens i32[S]``, ``block_tables i32[S, W]``
    agree on ``S >= 1`` (the attention kernels' ragged-batch arguments)."""
    num_seqs = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    if num_seqs < 1 or cu_q_lens.shape != (num_seqs + 1,) or block_tables.ndim != 2 \
            or block_tables.shape[0] != num_seqs:
        raise ValueError(f"need cu_q_lens i32[S+1], kv_lens i32[S], block_tables i32[S, W]; got "
                         f"{cu_q_lens.shape}, {kv_lens.shape}, {block_tables.shape}")
    for name, a in (("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens), ("block_tables", block_tables)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
