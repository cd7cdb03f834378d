"""Log-probabilities inside the step (device); ``io.outputs.to_logprob_dict`` makes vLLM's ``Logprob`` dicts
of them on the host.

Logprobs are those of the model's raw distribution, ``log_softmax(logits)`` before penalties,
temperature and filters (vLLM V1's default ``raw_logprobs``). Per row: the ``k`` largest (ids and
values, ``lax.top_k``), the chosen token's value and its rank, 1-based, counted as vLLM does
(``#{v : lp_v >= lp_token}``). Per-row reductions only; in batch-invariant mode the softmax
denominator is a fixed-order sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .sampler import fixed_order_sum


def log_softmax(logits: jax.Array, batch_invariant: bool = False) -> jax.Array:
    """``f32[N, V] -> f32[N, V]``."""
    logits = logits.astype(jnp.float32)
    if not batch_invariant:
        return jax.nn.log_softmax(logits, axis=-1)
    top = jnp.max(logits, axis=-1, keepdims=True)  # max is exact in any order
    shifted = logits - top
    return shifted - jnp.log(fixed_order_sum(jnp.exp(shifted)))


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int, batch_invariant: bool = False) -> dict:
    """``logits f32[N, V]``, ``tokens i32[N]``, static ``k >= 0`` -> ``{"ids": i32[N, k], "values":
    f32[N, k], "token": f32[N], "rank": i32[N]}`` (the top-k and the given token's logprob and rank)."""
    lp = log_softmax(logits, batch_invariant)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp >= chosen[:, None], axis=-1).astype(jnp.int32)
    values, ids = jax.lax.top_k(lp, k) if k > 0 else (lp[:, :0], jnp.zeros((lp.shape[0], 0), jnp.int32))
    return {"ids": ids.astype(jnp.int32), "values": values, "token": chosen, "rank": rank}

