"""Run the model over the paged pool without the engine: for tests, checks and experiments.

``build_step`` lays out hand-made ragged steps (each sequence's new tokens, start position and
block table); ``forward_all_logits`` returns the logits at every token, which is what a comparison
with Hugging Face needs (the engine computes logits only where it samples).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kernels.metadata import AttentionMetadata
from ..kernels.reference import paged_attention_reference, write_kv_reference
from .qwen import DEFAULT_OPS, ModelOps


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8), donate_argnums=(2,))
def _forward(graphdef, state, kv_pool, token_ids, positions, meta, attention_fn, write_kv_fn, ops):
    model = nnx.merge(graphdef, state)
    hidden, kv_pool = model(token_ids, positions, kv_pool, meta, attention_fn=attention_fn,
                            write_kv_fn=write_kv_fn, ops=ops)
    return model.compute_logits(hidden, ops), kv_pool


def forward_all_logits(graphdef: nnx.GraphDef, state: nnx.State, kv_pool, token_ids: jax.Array,
                       positions: jax.Array, meta: AttentionMetadata,
                       attention_fn: Callable = paged_attention_reference,
                       write_kv_fn: Callable = write_kv_reference, ops: ModelOps = DEFAULT_OPS):
    """fp32 logits ``[T, vocab]`` at every token of a ragged step, and the updated (donated) pool.
    ``ops``: the model's matmul / RMSNorm / RoPE (``kernels.backend.get_model_ops``)."""
    return _forward(graphdef, state, kv_pool, token_ids, positions, meta, attention_fn, write_kv_fn, ops)


def build_step(chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]], block_size: int, width: int,
               pad_tokens: int = 0, pad_seqs: int = 0):
    """``chunks``: one ``(new_token_ids, start_pos, block_table)`` per sequence.

    Returns ``(token_ids i32[T], positions i32[T], AttentionMetadata)`` with optional padding tokens
    (slot -1) and padding sequences (no tokens).
    """
    token_ids, positions, slots, cu, kv_lens, tables = [], [], [], [0], [], []
    for ids, start, table in chunks:
        n = len(ids)
        pos = np.arange(start, start + n)
        token_ids += list(ids)
        positions += list(pos)
        slots += list(np.asarray(table)[pos // block_size] * block_size + pos % block_size)
        cu.append(cu[-1] + n)
        kv_lens.append(start + n)
        tables.append(list(table) + [0] * (width - len(table)))
    token_ids += [0] * pad_tokens
    positions += [0] * pad_tokens
    slots += [-1] * pad_tokens
    for _ in range(pad_seqs):
        cu.append(cu[-1])
        kv_lens.append(0)
        tables.append([0] * width)
    meta = AttentionMetadata(slot_mapping=jnp.asarray(slots, jnp.int32), cu_q_lens=jnp.asarray(cu, jnp.int32),
                             kv_lens=jnp.asarray(kv_lens, jnp.int32), block_tables=jnp.asarray(tables, jnp.int32))
    return jnp.asarray(token_ids, jnp.int32), jnp.asarray(positions, jnp.int32), meta
