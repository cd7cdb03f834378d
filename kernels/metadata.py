"""AttentionMetadata: the per-step arrays that place a ragged batch's tokens in the paged KV pool."""

from __future__ import annotations

import dataclasses

import jax


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
