"""Split-K for decode attention, shared by the Triton and Mosaic GPU kernels: how many programs share
one query tile's keys, and how their partial results are merged.

A decode step of a few sequences has too few (query tile, KV head) programs to fill the GPU; each of
``P`` splits reads a contiguous share of the keys and writes its output normalised by its own softmax
sum, in fp32, with that sum's log-sum-exp (base 2). Merging weighs each split by ``exp2(lse - max)``:
the exact softmax over all keys, to rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.kernels.shapes import next_pow2

MAX_SPLITS = 32


def decode_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, block_k: int, max_context: int,
                  num_cores: int) -> int:
    """Programs sharing one decode query tile's context (split-K), for both attention kernels: enough
    that the launch has about two programs per core (``min(S, T) * Hkv`` query-tile programs without a
    split), never more KV tiles' worth than the longest context has, at most ``MAX_SPLITS``; a power
    of two."""
    programs = min(num_seqs, num_tokens) * num_kv_heads
    ctx_tiles = -(-max_context // block_k)
    splits = min(MAX_SPLITS, ctx_tiles, max(1, -(-2 * num_cores // max(1, programs))))
    return next_pow2(splits) if splits > 1 else 1


def merge_splits(o: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Merges split-K partials ``o f32[P, *rows, D]`` and ``lse f32[P, *rows]`` (base 2; ``-inf`` for a
    split with no keys) -> ``[*rows, D]`` in ``dtype``. ``rows``: ``(T, Hq)``, the Triton and Mosaic GPU
    kernels' (the fp8 decode kernel's after a gather of its columns)."""
    lse_max = jnp.max(lse, axis=0)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    w = jnp.exp2(lse - lse_max[None])  # 0 for empty splits
    denom = jnp.sum(w, axis=0)
    out = jnp.sum(o * w[..., None], axis=0) / jnp.where(denom == 0, 1.0, denom)[..., None]
    return out.astype(dtype)
