"""Reservation policies: how a request's blocks are found, behind one small protocol.

The ``KVCacheManager`` owns the block tables and asks its policy for physical blocks:

* ``paged`` (:class:`PagedReservation`, here): blocks on demand from the ``BlockAllocator``, full
  blocks shared through the token-exact ``PrefixTrie`` (prefix caching, optional);
* ``max_len`` (:class:`jaxpaged.kv.max_len.MaxLenReservation`): one contiguous run of
  ``ceil(max_model_len / bs)`` blocks reserved at admission, like a contiguous KV cache.

Same kernel, same model, same manager: only the policy differs, so the memory experiments compare
like with like. Nothing outside a policy branches on which policy is in use.
"""

from __future__ import annotations

from typing import Protocol

from jaxpaged.kv.allocator import BlockAllocator
from jaxpaged.kv.errors import BlockStateError, OutOfBlocksError
from jaxpaged.kv.prefix_trie import PrefixTrie, TrieNode
from jaxpaged.kv.stats import EventLog, KVCounters
from jaxpaged.engine.sequence import Sequence


class ReservationPolicy(Protocol):
    """What the manager asks of a policy. Block tables are the manager's; a policy sees copies."""

    name: str
    num_blocks: int
    trie: PrefixTrie | None
    allocator: BlockAllocator | None

    @property
    def num_free_blocks(self) -> int: ...  # handed out first
    @property
    def num_used_blocks(self) -> int: ...  # held by block tables
    @property
    def num_cached_blocks(self) -> int: ...  # unreferenced, still holding a cached prefix
    @property
    def num_shared_references(self) -> int: ...  # sum over blocks of (holders - 1)

    def prefix_hit_blocks(self, seq: Sequence) -> int:
        """Full blocks of ``seq`` admission would take from a cache right now."""
    def can_admit(self, seq: Sequence) -> bool:
        """True if ``admit(seq)`` would succeed now."""
    def admit(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """``(hit blocks, new blocks)`` covering all known tokens of ``seq``; ``OutOfBlocksError``."""
    def can_grow(self, seq: Sequence, num_blocks: int, missing: int) -> bool:
        """True if a table of ``num_blocks`` can get ``missing`` more blocks now."""
    def grow(self, seq: Sequence, num_blocks: int, missing: int) -> list[int]:
        """``missing`` new block ids; ``OutOfBlocksError`` (nothing changed) if there are none."""
    def has_new_full_blocks(self, seq: Sequence) -> bool:
        """True if ``cache_full_blocks`` has something to register for ``seq`` (a cheap check)."""
    def cache_full_blocks(self, seq: Sequence, block_table: list[int]) -> list[int]:
        """Registers the blocks of ``seq`` full of computed K/V; returns the newly cached ids."""
    def release(self, seq: Sequence, block_table: list[int]) -> None:
        """Gives back a finished or preempted request's blocks."""
    def check(self, holders: list[int]) -> None:
        """Invariants against ``holders[b]`` = block tables holding ``b``; ``BlockStateError``."""


class PagedReservation:
    """The ``paged`` policy: blocks on demand, shared full blocks through the prefix trie."""

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool,
                 counters: KVCounters, events: EventLog | None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.counters = counters
        self.events = events
        self.allocator = BlockAllocator(num_blocks, block_size, on_evict=self._on_evict)
        self.trie = PrefixTrie(block_size) if enable_prefix_caching else None
        self._cursors: dict[str, tuple[int, TrieNode | None]] = {}  # blocks in trie, deepest node
        self._last_match: tuple | None = None  # (seq, num_tokens, version, hits, node)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.allocator.num_cached_blocks

    @property
    def num_shared_references(self) -> int:
        return self.allocator.num_shared_references

    # ---- admission -------------------------------------------------------------------------------
    def _match(self, seq: Sequence) -> tuple[list[int], TrieNode | None]:
        """Prefix hit for ``seq`` (memoised between ``can_admit`` and ``admit``)."""
        if self.trie is None:
            return [], None
        last = self._last_match
        # The trie changes on evictions and on insertions: either makes a remembered match stale.
        version = (self.allocator.num_evictions, self.counters.blocks_inserted)
        if last is not None and last[0] is seq and last[1] == seq.num_tokens and last[2] == version:
            return last[3], last[4]
        hits, node = self.trie.longest_prefix(seq.token_ids, seq.cache_salt)
        self._last_match = (seq, seq.num_tokens, version, hits, node)
        return hits, node

    def prefix_hit_blocks(self, seq: Sequence) -> int:
        return len(self._match(seq)[0])

    def _shortfall(self, seq: Sequence) -> tuple[list[int], TrieNode | None, int, int]:
        """(hits, node, blocks to allocate, blocks available for them) for admitting ``seq``."""
        hits, node = self._match(seq)
        alloc = self.allocator
        need = -(-seq.num_tokens // self.block_size) - len(hits)
        available = alloc.num_available_blocks - sum(map(alloc.is_evictable, hits))
        return hits, node, need, available

    def can_admit(self, seq: Sequence) -> bool:
        _, _, need, available = self._shortfall(seq)
        return need <= available

    def admit(self, seq: Sequence) -> tuple[list[int], list[int]]:
        hits, node, need, available = self._shortfall(seq)
        if need > available:
            raise OutOfBlocksError(f"request {seq.request_id!r} needs {need} new blocks, {available} free or evictable")
        for block_id in hits:
            self.allocator.incref(block_id)
        new = self.allocator.allocate(need)
        if self.trie is not None:
            c = self.counters
            c.prefix_queries += 1
            c.prefix_query_tokens += seq.num_tokens
            c.prefix_hit_blocks += len(hits)
            c.prefix_hit_tokens += len(hits) * self.block_size
            self._cursors[seq.request_id] = (len(hits), node)
        self._last_match = None
        return hits, new

    # ---- growth ----------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_blocks: int, missing: int) -> bool:
        return missing <= self.allocator.num_available_blocks

    def grow(self, seq: Sequence, num_blocks: int, missing: int) -> list[int]:
        if missing > self.allocator.num_available_blocks:
            raise OutOfBlocksError(
                f"request {seq.request_id!r} needs {missing} more blocks, "
                f"{self.allocator.num_available_blocks} free or evictable"
            )
        return self.allocator.allocate(missing)

    # ---- caching ---------------------------------------------------------------------------------
    def has_new_full_blocks(self, seq: Sequence) -> bool:
        return self.trie is not None and seq.num_computed_tokens // self.block_size > self._cursors[seq.request_id][0]

    def cache_full_blocks(self, seq: Sequence, block_table) -> list[int]:
        """O(1) when no block filled since the last call. ``block_table``: the row (list or array view)."""
        if self.trie is None:
            return []
        rid = seq.request_id
        num_full = seq.num_computed_tokens // self.block_size
        start, node = self._cursors[rid]
        if num_full <= start:
            return []
        new, node = self.trie.insert(seq.token_ids, block_table, seq.cache_salt,
                                     num_blocks=num_full, start_block=start, parent=node)
        for block_id in new:
            self.allocator.mark_cached(block_id)
        self._cursors[rid] = (num_full, node)
        self.counters.blocks_inserted += len(new)
        if new and self.events is not None:
            self.events.record("insert", new, rid)
        return new

    def _on_evict(self, block_id: int) -> list[int]:
        detached = self.trie.evict(block_id)
        self.counters.evictions += 1
        if self.events is not None:
            self.events.record("evict", [block_id, *detached])
        return detached

    # ---- release ---------------------------------------------------------------------------------
    def release(self, seq: Sequence, block_table: list[int]) -> None:
        self._cursors.pop(seq.request_id, None)
        self.allocator.free(block_table)

    def check(self, holders: list[int]) -> None:
        """Every block is free xor referenced xor cached-unreferenced; ref counts equal holders; a block
        is flagged cached exactly when the trie holds it."""
        alloc, trie = self.allocator, self.trie
        free, lru = set(alloc.free_block_ids()), set(alloc.evictable_block_ids())
        if len(free) != alloc.num_free_blocks:
            raise BlockStateError("a block is on the free list twice")
        in_trie = set(trie.block_ids()) if trie is not None else set()
        shared = 0
        for b in range(self.num_blocks):
            refs = alloc.ref_count(b)
            shared += max(0, refs - 1)
            if refs != holders[b] or (b in free) + (b in lru) + (refs > 0) != 1:
                raise BlockStateError(
                    f"block {b}: ref_count {refs}, held by {holders[b]} block tables, "
                    f"free={b in free}, lru={b in lru}"
                )
            if alloc.is_cached(b) != (b in in_trie):
                raise BlockStateError(f"block {b}: cached flag {alloc.is_cached(b)} disagrees with the trie")
        if shared != alloc.num_shared_references:
            raise BlockStateError(f"shared-reference count {alloc.num_shared_references} != {shared}")
