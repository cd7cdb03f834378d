"""How a Mosaic GPU attention launch's work is cut into programs, as arrays the kernels read: the query
tiles of a ragged batch (:func:`tile_layout`, the one-warpgroup kernel's and the prefill kernel's), a
tile a token (:func:`token_layout`, the decode kernel's), a tile a sequence of one new token
(:func:`one_token_layout`), and split-K: how many programs share a tile's keys
(:func:`choose_splits`), which keys each reads (:func:`split_range`) and the (tile, split) items that
have any (:func:`work_list`). Plain ``jnp`` on the step's metadata, computed once a step (every
layer's launch reads the same). The cutting itself is described in ``tiles.py``'s module docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpaged.kernels.shapes import num_cores
from jaxpaged.kernels.split_k import decode_splits


def choose_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, block_kv: int, max_context: int,
                  decode: bool) -> int:
    """Split-K factor: 1 for prefill (its query tiles fill the GPU); for decode launches
    :func:`jaxpaged.kernels.split_k.decode_splits` (the Triton kernel's rule: about two programs per
    core, rounded up to a power of two), halved where that rounding gives more programs than two a
    core: a split-K program needs 80 KiB of shared memory, so two fit on an SM and the rest would wait
    for a second wave."""
    if not decode:
        return 1
    cores = num_cores()
    splits = decode_splits(num_tokens, num_seqs, num_kv_heads, block_kv, max_context, cores)
    if splits > 1 and min(num_seqs, num_tokens) * num_kv_heads * splits > 2 * cores:
        splits //= 2
    return splits


def tile_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, block_q: int):
    """The query tiles of a ragged batch (``tiles.py``'s module docstring): sequence ``i``
    owns tiles ``cu_q_lens[i] // block_q + i + j`` for ``j < cdiv(q_len_i, block_q)``, and the padding
    tokens after the last sequence are tiled the same way, as one more sequence (its tiles only write
    zeros). ``cdiv(T, block_q) + S`` tiles bound them; the others are unowned. Returns ``meta i32[tiles, 4]`` = (the tile's sequence,
    ``-1`` for padding and unowned tiles; the position of its first token; ``kv_end``, that + its number
    of tokens: one past its last token's position, the keys it needs; the index of its first token in
    ``q``), and ``tile_of i32[T]``, each token's tile."""
    num_seqs = kv_lens.shape[0]
    num_tiles = pl.cdiv(num_tokens, block_q) + num_seqs
    cu = jnp.concatenate([cu_q_lens.astype(jnp.int32), jnp.full((1,), num_tokens, jnp.int32)])
    # the padding tokens as sequence S, at positions 0, 1, ...: a kv_len of their count
    kv = jnp.concatenate([kv_lens.astype(jnp.int32), (num_tokens - cu_q_lens[num_seqs:]).astype(jnp.int32)])
    starts = cu[:-1] // block_q + jnp.arange(num_seqs + 1, dtype=jnp.int32)
    u = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.sum(starts[None, :] <= u[:, None], axis=1, dtype=jnp.int32) - 1  # starts[0] == 0
    j = u - starts[seq]
    q_len = cu[seq + 1] - cu[seq]
    ntok = jnp.clip(q_len - j * block_q, 0, block_q)
    pos0 = kv[seq] - q_len + j * block_q
    owned = (ntok > 0) & (seq < num_seqs)
    meta = jnp.stack([jnp.where(owned, seq, -1), pos0, pos0 + ntok, cu[seq] + j * block_q], axis=1)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_t = jnp.sum(cu[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32)  # pseudo-sequences ending at or before t
    return meta.astype(jnp.int32), starts[seq_t] + (t - cu[seq_t]) // block_q


def token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> jax.Array:
    """The query tiles of one token each (the decode kernel's, ``decode.py``): tile
    ``t`` is token ``t``. Returns ``meta i32[T, 3]`` = (its sequence, ``-1`` for padding tokens; its position; its
    position + 1, the ``kv_end`` of :func:`tile_layout`)."""
    num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.sum(cu_q_lens[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32)  # sequences ending at or before t
    s = jnp.minimum(seq, num_seqs - 1)
    pos = kv_lens[s] - (cu_q_lens[s + 1] - t)
    return jnp.stack([jnp.where(seq < num_seqs, seq, -1), pos, pos + 1], axis=1).astype(jnp.int32)


def one_token_seqs(cu_q_lens: jax.Array) -> jax.Array:
    """``bool[S]``: the sequences with exactly one new token (a mixed step's decode rows)."""
    return cu_q_lens[1:] - cu_q_lens[:-1] == 1


def one_token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array) -> jax.Array:
    """A tile per *sequence*, owned where the sequence has exactly one new token (the decode rows of a
    prefill launch: ``tiles.one_token_rows``). Returns ``meta i32[S, 4]`` = (the
    sequence, ``-1`` where it has no or several new tokens; its token's position; that + 1; the token's
    index in ``q``)."""
    num_seqs = kv_lens.shape[0]
    pos = kv_lens - 1
    seq = jnp.where(one_token_seqs(cu_q_lens), jnp.arange(num_seqs, dtype=jnp.int32), -1)
    return jnp.stack([seq, pos, pos + 1, cu_q_lens[:-1]], axis=1).astype(jnp.int32)


def split_range(kv_end, split, block_kv: int, num_splits: int):
    """KV tiles ``[lo, hi)`` that split ``split`` of a query tile needing keys ``[0, kv_end)`` reads:
    ``cdiv(num_kv, num_splits)`` consecutive tiles each (the last splits may be short or empty)."""
    num_kv = lax.div(kv_end + (block_kv - 1), block_kv)
    per = lax.div(num_kv + (num_splits - 1), num_splits)
    lo = split * per
    return lo, jnp.minimum(num_kv, lo + per)


def work_list(meta: jax.Array, block_kv: int, num_splits: int) -> jax.Array:
    """The items of a split launch that have keys: ``i32[tiles * P + 1, 2]``, row 0 ``(count, 0)``, then
    ``(tile, split)`` of each owned tile's non-empty splits (:func:`split_range`), tile by tile. A
    persistent launch takes them in turn, so a split count chosen for a long context costs a launch
    with a short one only the items it has (a grid of tiles x splits launched a program for each,
    empty or not)."""
    tiles = meta.shape[0]
    split = jnp.arange(num_splits, dtype=jnp.int32)
    lo, hi = split_range(meta[:, 2:3], split[None, :], block_kv, num_splits)  # [tiles, P]
    valid = ((meta[:, 0:1] >= 0) & (lo < hi)).reshape(-1)
    rank = jnp.cumsum(valid.astype(jnp.int32))  # 1-based row of each valid item
    pairs = jnp.stack([jnp.repeat(jnp.arange(tiles, dtype=jnp.int32), num_splits), jnp.tile(split, tiles)], axis=1)
    work = jnp.zeros((tiles * num_splits + 1, 2), jnp.int32)
    work = work.at[jnp.where(valid, rank, tiles * num_splits + 1)].set(pairs, mode="drop")
    return work.at[0, 0].set(rank[-1])
