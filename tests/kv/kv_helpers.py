"""What the KV tests ask of the KV structures beyond what the engine does, built on their public methods:
a block's state, a cached prefix as block ids, a block's eviction from the trie, block tables as a fresh
array."""

from __future__ import annotations

import enum

import numpy as np


class BlockState(enum.Enum):
    """Every block is exactly one of these (the allocator's invariant)."""

    FREE = "free"
    REFERENCED = "referenced"
    CACHED = "cached"  # unreferenced, in the LRU pool, still findable through the prefix trie


def block_state(allocator, block_id: int) -> BlockState:
    if allocator.ref_count(block_id):
        return BlockState.REFERENCED
    return BlockState.CACHED if allocator.is_cached(block_id) else BlockState.FREE


def trie_match(trie, tokens, cache_salt=None) -> list[int]:
    """Device block ids of the longest cached prefix of ``tokens`` (``PrefixTrie.longest_prefix``)."""
    return [node.block_id for node in trie.longest_prefix(tokens, cache_salt)]


def trie_evict(trie, block_id: int) -> list[int]:
    """Removes the node of ``block_id`` (``KeyError`` if the trie has none) and its subtree; returns the
    subtree's device block ids."""
    return [child.block_id for child in trie.remove(trie.node(block_id)) if child.block_id >= 0]


def gather(tables, rows, width: int) -> np.ndarray:
    """``i32[len(rows), width]``: the given block-table rows, cut or zero-padded to ``width``
    (``BlockTables.gather_into``; ``ValueError`` if a row holds more than ``width`` blocks)."""
    rows = np.asarray(rows, dtype=np.int64)
    out = np.empty((rows.size, width), dtype=np.int32)
    tables.gather_into(rows, out)
    return out
