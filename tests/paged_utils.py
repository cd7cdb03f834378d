"""Test helpers: run the model on ragged batches through the paged pool, without the engine."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import paged_attention_reference, write_kv_reference


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def forward_all_logits(graphdef, state, kv_pool, token_ids, positions, meta):
    """Logits at every token of a ragged step (reference attention); returns ``(logits, kv_pool)``."""
    model = nnx.merge(graphdef, state)
    hidden, kv_pool = model(token_ids, positions, kv_pool, meta,
                            attention_fn=paged_attention_reference, write_kv_fn=write_kv_reference)
    return model.compute_logits(hidden), kv_pool


def build_step(chunks, block_size, width, pad_tokens=0, pad_seqs=0):
    """``chunks``: list of ``(new_token_ids, start_pos, block_table)``, one per sequence.

    Returns ``(token_ids, positions, meta)`` numpy/jax arrays with optional padding tokens/sequences.
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
