"""Physical KV block allocator: free list, ref counts, and an LRU pool of cached blocks.

Every physical block of the KV pool is in exactly one of three states:

* ``FREE``: on the free list, holds nothing anyone can find; handed out first.
* ``REFERENCED``: ``ref_count >= 1``, held by that many block tables.
* ``CACHED``: ``ref_count == 0`` but its (full) contents are still registered in the prefix trie, so a
  later request with the same prefix can take it back (``incref``) without recomputing. These blocks
  sit in an LRU pool and are evicted, least recently released first, only once the free list is empty.

A block becomes "cached" when the prefix trie registers it (``mark_cached``) while it is referenced;
when its last holder releases it, it moves to the LRU pool instead of the free list. Evicting it
notifies the trie through ``on_evict`` so no stale trie node can hand the reused block out again.

Every operation is O(1) per block, and so is building an allocator, whatever ``num_blocks``: blocks
never handed out are a counter (``[next_fresh, num_blocks)``), not a list; released ones go on a deque;
ref counts and the cached mark are kept for blocks that have them only; the LRU pool is an
``OrderedDict``. (A 16-million-block pool is built in microseconds and a few hundred bytes.)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Iterable

from jaxpaged.config import check_block_size
from jaxpaged.kv.errors import BlockStateError, DoubleFreeError, OutOfBlocksError


class BlockAllocator:
    """Hands out physical block ids of a pool of ``num_blocks`` blocks of ``block_size`` token slots.

    ``on_evict(block_id)`` is called when an unreferenced cached block is reclaimed, before it is handed
    out again; it returns the ids of any other blocks that stopped being findable as a consequence
    (descendants detached from the trie; normally none), which this allocator then uncaches.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_evict: Callable[[int], Iterable[int] | None] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = check_block_size(block_size)
        self.on_evict = on_evict
        self._ref_counts: dict[int, int] = {}  # blocks with ref_count >= 1
        self._cached: set[int] = set()  # blocks the prefix trie holds
        self._next_fresh = 0  # blocks [_next_fresh, num_blocks) were never handed out (free, in id order)
        self._free: deque[int] = deque()  # released blocks, handed out after the fresh ones
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.num_evictions = 0
        self._shared_refs = 0  # sum over blocks of max(0, ref_count - 1), kept up to date in O(1)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (hold nothing findable)."""
        return self.num_blocks - self._next_fresh + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix (the LRU pool)."""
        return len(self._lru)

    @property
    def num_available_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus evictable."""
        return self.num_free_blocks + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one block table."""
        return self.num_blocks - self.num_free_blocks - len(self._lru)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts.get(block_id, 0)

    def is_cached(self, block_id: int) -> bool:
        """True if the prefix trie holds this block (referenced or in the LRU pool)."""
        return block_id in self._cached

    def is_evictable(self, block_id: int) -> bool:
        """True if the block sits unreferenced in the LRU pool."""
        return block_id in self._lru

    @property
    def num_shared_references(self) -> int:
        """References beyond the first, summed over blocks: ``sum(max(0, ref_count - 1))``. O(1)."""
        return self._shared_refs

    def free_block_ids(self) -> list[int]:
        """The free list in hand-out order (O(free blocks): for tests and debugging)."""
        return list(range(self._next_fresh, self.num_blocks)) + list(self._free)

    def evictable_block_ids(self) -> list[int]:
        """The LRU pool, least recently released first (the eviction order)."""
        return list(self._lru)

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Returns ``n`` block ids with ``ref_count == 1``; free list first, then LRU eviction.

        All or nothing: raises ``OutOfBlocksError`` without touching any state if fewer than ``n``
        blocks are free plus evictable.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks + len(self._lru):
            raise OutOfBlocksError(
                f"need {n} blocks, only {self.num_free_blocks} free + {len(self._lru)} evictable "
                f"of {self.num_blocks}"
            )
        fresh = min(n, self.num_blocks - self._next_fresh)
        out = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        free, refs = self._free, self._ref_counts
        while len(out) < n:
            if not free:
                self._evict_lru()
                continue
            out.append(free.popleft())
        for block_id in out:
            refs[block_id] = 1
        return out

    def _evict_lru(self) -> None:
        block_id, _ = self._lru.popitem(last=False)
        self._cached.discard(block_id)
        self.num_evictions += 1
        detached = self.on_evict(block_id) if self.on_evict is not None else None
        self._free.append(block_id)
        for other in detached or ():
            self.uncache(other)

    def incref(self, block_id: int) -> None:
        """Adds a holder. A cached block in the LRU pool is taken back out of it (a prefix hit)."""
        refs = self._ref_counts
        count = refs.get(block_id, 0)
        if count == 0:
            if block_id not in self._cached:
                raise BlockStateError(f"incref of free block {block_id}: allocate it first")
            del self._lru[block_id]
        else:
            self._shared_refs += 1
        refs[block_id] = count + 1

    def decref(self, block_id: int) -> None:
        """Drops a holder; at zero a cached block joins the LRU pool, any other the free list."""
        refs = self._ref_counts
        count = refs.get(block_id, 0)
        if count <= 0:
            raise DoubleFreeError(f"block {block_id} released more often than it was taken")
        if count > 1:
            refs[block_id] = count - 1
            self._shared_refs -= 1
        else:
            del refs[block_id]
            if block_id in self._cached:
                self._lru[block_id] = None  # most recently released: evicted last
            else:
                self._free.append(block_id)

    def free(self, block_ids: list[int]) -> None:
        """Releases a block table's blocks, tail first, so a sequence's deepest blocks evict first."""
        for block_id in reversed(block_ids):
            self.decref(block_id)

    # ---- cache registration --------------------------------------------------------------------
    def mark_cached(self, block_id: int) -> None:
        """Registers a referenced block as holding a cached prefix (called on trie insert)."""
        if block_id not in self._ref_counts:
            raise BlockStateError(f"only a referenced block can be cached, block {block_id} is not")
        self._cached.add(block_id)

    def uncache(self, block_id: int) -> None:
        """The trie dropped this block: an unreferenced one goes to the free list at once."""
        if block_id not in self._cached:
            return
        self._cached.discard(block_id)
        if block_id not in self._ref_counts:
            del self._lru[block_id]
            self._free.append(block_id)
