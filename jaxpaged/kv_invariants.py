"""The KV manager's invariants, recomputed from scratch (for property tests and debugging).

* every block is exactly one of: free, referenced, cached-unreferenced (in the LRU pool);
* a block's ref count equals the number of admitted block tables that hold it;
* no block table holds a block twice;
* a block is flagged cached exactly when the prefix trie holds it, and every LRU block is in the trie;
* under ``max_len``: a block is reserved exactly when one block table holds it;
* the numpy block-table mirror holds each admitted table in its own row, zeros elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.block_allocator import BlockStateError

if TYPE_CHECKING:
    from jaxpaged.kv_manager import KVCacheManager


def check_invariants(manager: KVCacheManager) -> None:
    """Raises ``BlockStateError`` naming the first block (or request) that breaks an invariant."""
    holders = [0] * manager.num_blocks
    mirror = manager.block_table_rows
    rows = []
    for seq in manager.sequences:
        if len(set(seq.block_table)) != len(seq.block_table):
            raise BlockStateError(f"request {seq.request_id!r} holds a block twice")
        n = len(seq.block_table)
        if seq._bt_rows is not mirror or mirror.table[seq._bt_row, :n].tolist() != seq.block_table:
            raise BlockStateError(f"request {seq.request_id!r}: block-table mirror out of sync")
        rows.append(seq._bt_row)
        for block_id in seq.block_table:
            holders[block_id] += 1
    held = np.zeros(mirror.table.shape, dtype=bool)
    for seq in manager.sequences:
        held[seq._bt_row, : len(seq.block_table)] = True
    if len(set(rows)) != len(rows) or mirror.table[~held].any():
        raise BlockStateError("block-table mirror: a row is shared or an unused entry is not 0")
    if manager.reserver is not None:
        used = manager.reserver.is_used
        bad = [b for b in range(manager.num_blocks) if used(b) != (holders[b] == 1) or holders[b] > 1]
        if bad:
            raise BlockStateError(f"reserved blocks disagree with block tables at {bad[:10]}")
        return
    alloc, trie = manager.allocator, manager.trie
    free, lru = set(alloc.free_block_ids()), set(alloc.evictable_block_ids())
    if len(free) != alloc.num_free_blocks:
        raise BlockStateError("a block is on the free list twice")
    in_trie = set(trie.block_ids()) if trie is not None else set()
    for b in range(manager.num_blocks):
        refs = alloc.ref_count(b)
        if refs != holders[b] or (b in free) + (b in lru) + (refs > 0) != 1:
            raise BlockStateError(
                f"block {b}: ref_count {refs}, held by {holders[b]} block tables, "
                f"free={b in free}, lru={b in lru}"
            )
        if alloc.is_cached(b) != (b in in_trie):
            raise BlockStateError(f"block {b}: cached flag {alloc.is_cached(b)} disagrees with the trie")
