"""Run the model over the paged pool without the engine, for the model checks (``check_model_vs_hf.py``,
``check_fp8_kv.py``) and their tests.

``forward_all_logits`` returns the logits at every token of a step, which is what a comparison with
Hugging Face needs (the engine computes logits only where it samples). ``build_chunk_step`` lays
hand-made ragged steps out with the engine's own step builder.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx

from jaxpaged.engine.step_inputs import StepInputs, build_step_inputs
from jaxpaged.kernels.kv_write import write_kv
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
from jaxpaged.kv import BlockTables
from jaxpaged.models.qwen import DEFAULT_OPS, ModelOps
from jaxpaged.request import Sequence
from jaxpaged.sampling import SamplingParams


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


def build_chunk_step(chunks: list[tuple[list[int], int, list[int]]], block_size: int,
                     width: int | None = None) -> StepInputs:
    """The engine's step builder (``build_step_inputs``) for hand-made steps: one ``(new_token_ids, start_pos,
    block_table)`` per sequence, the tokens before ``start_pos`` already in the pool. Greedy sampling."""
    tables, scheduled = BlockTables(), []
    for i, (ids, start, table) in enumerate(chunks):
        seq = Sequence(f"chunk-{i}", [0] * start + [int(t) for t in ids], SamplingParams(temperature=0))
        seq.block_table_row, seq.num_computed_tokens = tables.add([int(b) for b in table]), start
        scheduled.append((seq, len(ids)))
    return build_step_inputs(scheduled, tables, block_size, width=width)
