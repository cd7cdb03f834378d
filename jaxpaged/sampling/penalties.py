"""Logits processors that run inside the step, per row: vLLM's penalties and min_tokens.

All take ``logits f32[S, V]`` and return the processed logits; nothing reduces across rows, so each
row's result is independent of the batch (batch-invariant mode included). Token histories arrive as
``history i32[S, H]``: row ``s`` holds its request's tokens, prompt first (``num_prompt[s]`` of them),
then the generated ones, padded with -1. Counts are built on the device by a scatter-add (integers:
exact, order-free).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_counts(history: jax.Array, num_prompt: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """``(output_counts i32[S, V], seen bool[S, V])``: how often each token was generated, and
    whether it occurs anywhere (prompt or output). ``history i32[S, H]`` (-1 = padding)."""
    s, h = history.shape
    valid = history >= 0
    is_output = valid & (jnp.arange(h)[None, :] >= num_prompt[:, None])
    ids = jnp.where(valid, history, 0)
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], (s, h))
    counts = jnp.zeros((s, vocab_size), jnp.int32).at[rows, ids].add(is_output.astype(jnp.int32))
    seen = jnp.zeros((s, vocab_size), jnp.bool_).at[rows, ids].max(valid)
    return counts, seen


def apply_penalties(logits: jax.Array, history: jax.Array, num_prompt: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's penalties, in vLLM's order. ``presence, frequency, repetition f32[S]``.

    1. repetition (tokens seen in the prompt or the output): ``l / r`` if ``l > 0`` else ``l * r``;
    2. ``l -= frequency * output_count``;  3. ``l -= presence * (output_count > 0)``.
    Neutral values (0, 0, 1) leave a row's logits bitwise unchanged.
    """
    counts, seen = token_counts(history, num_prompt, logits.shape[-1])
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts.astype(logits.dtype)
    return logits - presence[:, None] * (counts > 0).astype(logits.dtype)


def mask_stop_tokens(logits: jax.Array, stop_ids: jax.Array, active: jax.Array) -> jax.Array:
    """min_tokens: in rows where ``active bool[S]``, the tokens ``stop_ids i32[S, K]`` (EOS and the
    request's stop_token_ids, -1 = padding) get -inf, so they cannot be sampled yet."""
    s, k = stop_ids.shape
    valid = (stop_ids >= 0) & active[:, None]
    rows = jnp.broadcast_to(jnp.arange(s)[:, None], (s, k))
    mask = jnp.zeros(logits.shape, jnp.bool_).at[rows, jnp.where(stop_ids >= 0, stop_ids, 0)].max(valid)
    return jnp.where(mask, -jnp.inf, logits)
