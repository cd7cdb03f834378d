"""Run the model over the paged pool without the engine: for tests, checks and experiments.

``forward_all_logits`` returns the logits at every token of a step, which is what a comparison with
Hugging Face needs (the engine computes logits only where it samples). Lay hand-made ragged steps out
with ``jaxpaged.engine.step_inputs.build_chunk_step`` (the engine's own step builder).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx

from ..kernels.kv_write import write_kv
from ..kernels.metadata import AttentionMetadata
from ..kernels.paged_attention_reference import paged_attention_reference
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
                       write_kv_fn: Callable = write_kv, ops: ModelOps = DEFAULT_OPS):
    """fp32 logits ``[T, vocab]`` at every token of a ragged step, and the updated (donated) pool.
    ``ops``: the model's matmul / RMSNorm / RoPE (``models.ops.get_model_ops``)."""
    return _forward(graphdef, state, kv_pool, token_ids, positions, meta, attention_fn, write_kv_fn, ops)
