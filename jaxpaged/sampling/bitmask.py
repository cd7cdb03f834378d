"""Structured outputs on the device: a packed token bitmask applied to the logits (``features.resample_rows``).

``bitmask i32[S, W]`` (``W = ceil(V / 32)``): bit ``j % 32`` of word ``j // 32`` of row ``s`` is set when
token ``j`` may be sampled in row ``s`` (llguidance's layout, ``grammar.py``). Rows without a constraint
are all ones (-1), so their logits pass unchanged. Packed, the mask of a row is 1/32 of its logits'
bytes on the way to the device; it is unpacked here, where it costs one elementwise pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """``i32[S, W]`` -> ``bool[S, vocab_size]``: which tokens each row allows."""
    words = lax.bitcast_convert_type(bitmask, jnp.uint32)[:, :, None]  # [S, W, 1]
    bits = jnp.right_shift(words, jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)  # [S, W, 32] (logical: unsigned)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """``logits f32[S, V]`` with every token its row's ``bitmask`` does not allow set to -inf (before the
    penalties, the temperature and the filters, as vLLM applies it). Tokens past ``32 * W`` are masked."""
    vocab = logits.shape[-1]
    width = bitmask.shape[-1]
    if 32 * width < vocab:
        bitmask = jnp.pad(bitmask, ((0, 0), (0, -(-vocab // 32) - width)))
    return jnp.where(unpack_bitmask(bitmask, vocab), logits, -jnp.inf)
