"""Reservation policies: how a request's blocks are found, behind one small protocol.

The ``KVCacheManager`` owns the block tables and asks its policy for physical blocks:

* ``paged`` (:class:`PagedReservation`, here): blocks on demand from the ``BlockAllocator``, full
  blocks shared through the token-exact ``PrefixTrie`` (prefix caching, optional), evicted cached
  blocks kept in a host tier (``kv/host_tier.py``, optional);
* ``max_len`` (:class:`jaxpaged.kv.max_len.MaxLenReservation`): one contiguous run of
  ``ceil(max_model_len / bs)`` blocks reserved at admission, like a contiguous KV cache.

Same kernel, same model, same manager: only the policy differs, so the memory experiments compare
like with like. Nothing outside a policy branches on which policy is in use.
"""

from __future__ import annotations

from typing import Protocol

from jaxpaged.kv.allocator import BlockAllocator
from jaxpaged.kv.errors import BlockStateError, OutOfBlocksError
from jaxpaged.kv.host_tier import HostBlockPool, ReloadCost, Transfer
from jaxpaged.kv.kv_events import KVEventRecorder
from jaxpaged.kv.prefix_trie import PrefixTrie, TrieNode
from jaxpaged.kv.stats import EventLog, KVCounters
from jaxpaged.request import Sequence


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
    """The ``paged`` policy: blocks on demand, shared full blocks through the prefix trie.

    ``num_host_slots > 0`` (prefix caching on) adds the host tier: an evicted cached block is copied to
    a host slot and stays findable; a hit on it allocates a device block and copies it back. The
    copies are queued in ``transfers`` (in decision order) for the engine to run before its next step.
    """

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool,
                 counters: KVCounters, events: EventLog | None, num_host_slots: int = 0,
                 kv_events: KVEventRecorder | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.counters = counters
        self.events = events
        self.allocator = BlockAllocator(num_blocks, block_size, on_evict=self._on_evict)
        self.trie = PrefixTrie(block_size, kv_events) if enable_prefix_caching else None
        self.host = (HostBlockPool(num_host_slots, on_evict=self._on_host_evict)
                     if enable_prefix_caching and num_host_slots > 0 else None)
        self.transfers: list[Transfer] = []
        # Set by the engine once measured (``None``: every host hit is reloaded, every eviction offloaded).
        self.reload_cost: ReloadCost | None = None
        self._cursors: dict[str, tuple[int, TrieNode | None]] = {}  # blocks in trie, deepest node
        self._last_match: tuple | None = None  # (seq, num_tokens, version, hits)

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
    def _match(self, seq: Sequence) -> list[TrieNode]:
        """Prefix hit for ``seq``, in either tier (memoised between ``can_admit`` and ``admit``)."""
        if self.trie is None:
            return []
        last = self._last_match
        # The trie changes on evictions (of either tier) and on insertions: each makes a remembered
        # match stale.
        version = (self.allocator.num_evictions, self.counters.blocks_inserted, self.counters.host_evictions)
        if last is not None and last[0] is seq and last[1] == seq.num_tokens and last[2] == version:
            return last[3]
        hits, recomputed = self._worth_reloading(self.trie.longest_prefix(seq.token_ids, seq.cache_salt))
        self._last_match = (seq, seq.num_tokens, version, hits, recomputed)
        return hits

    def _worth_reloading(self, hits: list[TrieNode]) -> tuple[list[TrieNode], int]:
        """``(hits, host blocks left out)``: ``hits`` cut at their first host-only block where reloading
        the host-only blocks would cost more than computing their tokens again (``reload_cost``)."""
        cost = self.reload_cost
        on_host = sum(1 for node in hits if node.block_id < 0)
        if cost is None or on_host == 0 or cost.worth_reloading(on_host):
            return hits, 0
        first = next(i for i, node in enumerate(hits) if node.block_id < 0)
        return hits[:first], on_host

    def prefix_hit_blocks(self, seq: Sequence) -> int:
        return len(self._match(seq))

    def _shortfall(self, seq: Sequence) -> tuple[list[TrieNode], int, int]:
        """(hit nodes, blocks to allocate, blocks available for them) for admitting ``seq``. A hit on
        the host tier needs a device block too (its reload's destination)."""
        hits = self._match(seq)
        alloc = self.allocator
        on_gpu = [node.block_id for node in hits if node.block_id >= 0]
        need = -(-seq.num_tokens // self.block_size) - len(on_gpu)
        available = alloc.num_available_blocks - sum(map(alloc.is_evictable, on_gpu))
        return hits, need, available

    def can_admit(self, seq: Sequence) -> bool:
        _, need, available = self._shortfall(seq)
        return need <= available

    def admit(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """``(hit blocks in prefix order, new blocks)``; the hits include blocks reloaded from the host
        tier, whose copies are queued in ``transfers`` (``seq.num_host_cached_tokens`` counts them)."""
        hits, need, available = self._shortfall(seq)
        if need > available:
            raise OutOfBlocksError(f"request {seq.request_id!r} needs {need} new blocks, {available} free or evictable")
        self.counters.host_hits_recomputed += self._last_match[4] if self._last_match is not None else 0
        on_host = [node for node in hits if node.block_id < 0]
        for node in hits:
            if node.block_id >= 0:
                self.allocator.incref(node.block_id)
            else:  # (its own allocation below may evict on the host: not these)
                self.host.pin(node.host_slot)
        new = self.allocator.allocate(need)
        if on_host:
            self._reload(seq, on_host, new[: len(on_host)])
            new = new[len(on_host):]
        seq.num_host_cached_tokens = len(on_host) * self.block_size
        if self.trie is not None:
            c = self.counters
            c.prefix_queries += 1
            c.prefix_query_tokens += seq.num_tokens
            c.prefix_hit_blocks += len(hits)
            c.prefix_hit_tokens += len(hits) * self.block_size
            c.host_hit_blocks += len(on_host)
            self._cursors[seq.request_id] = (len(hits), hits[-1] if hits else None)
        self._last_match = None
        return [node.block_id for node in hits], new

    def _reload(self, seq: Sequence, nodes: list[TrieNode], blocks: list[int]) -> None:
        """Host-only hit ``nodes`` get device ``blocks`` (cached again at once) and a reload each."""
        for node, block_id in zip(nodes, blocks):
            self.trie.attach_gpu(node, block_id)
            self.allocator.mark_cached(block_id)
            self.transfers.append(Transfer("reload", block_id, node.host_slot))
        for node in reversed(nodes):  # the prefix's first block most recently used: evicted last
            self.host.unpin(node.host_slot)
        self.counters.blocks_reloaded += len(nodes)
        if self.events is not None:
            self.events.record("reload", blocks, seq.request_id)

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
        """The allocator reclaims cached device block ``block_id``. With a host tier its node moves
        there (copied now unless a host copy exists); otherwise, or when no host slot can be had, the
        node and its subtree leave the trie and the subtree's device blocks are returned."""
        self.counters.evictions += 1
        node = self.trie.node(block_id)
        detached = [] if self.host is not None and self._to_host(node, block_id) else self._remove(node)
        if self.events is not None:
            self.events.record("evict", [block_id, *detached])
        return detached

    def _to_host(self, node: TrieNode, block_id: int) -> bool:
        """Moves an evicted block's node to the host tier (an offload queued unless it has a host copy).
        True if the node is settled: on the host now, or removed meanwhile with an ancestor whose host
        slot was reclaimed to make room; False if no slot could be had."""
        if node.host_slot >= 0:
            self.host.touch(node.host_slot)
        else:
            if self.reload_cost is not None and not self.reload_cost.ever_worth_reloading:
                return False  # a copy no hit would ever use
            slot = self.host.allocate()  # (evicting on the host may remove this very node)
            if slot is None:
                return False
            if not node.alive:
                self.host.release(slot)
                return True
            self.trie.set_host(node, slot)
            self.transfers.append(Transfer("offload", block_id, slot))
            self.counters.blocks_offloaded += 1
            if self.events is not None:
                self.events.record("offload", [block_id])
        self.trie.drop_gpu(block_id)
        return True

    def _remove(self, node: TrieNode) -> list[int]:
        """Removes ``node`` and its subtree from the trie, frees their host slots and returns the
        descendants' device blocks (for the allocator to uncache)."""
        removed = self.trie.remove(node)
        gpu = []
        for child in removed:
            if child.block_id >= 0:
                gpu.append(child.block_id)
            if child.host_slot >= 0:
                self.host.release(child.host_slot)
        return gpu

    def _on_host_evict(self, slot: int) -> None:
        """The host tier reclaims ``slot``: a node also on the device keeps that copy; a host-only node
        leaves the trie with its subtree (whose device blocks the allocator uncaches)."""
        self.counters.host_evictions += 1
        node = self.trie.host_node(slot)
        if node.block_id >= 0:
            self.trie.drop_host(slot)
        else:  # (its own slot is the one being handed out: not released)
            for block_id in self._remove(node):
                self.allocator.uncache(block_id)
        if self.events is not None:
            self.events.record("host_evict", [slot])

    def take_transfers(self) -> list[Transfer]:
        """The copies decided since the last call, in order (the engine runs them before its next step)."""
        out, self.transfers = self.transfers, []
        return out

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
        if self.host is not None:
            used = self.host.used_slots()
            if used != set(trie.host_slots()) or len(used) != self.host.num_used_slots:
                raise BlockStateError(f"host slots in use {sorted(used)} differ from the trie's {sorted(trie.host_slots())}")
        if trie is not None:
            for node in trie.walk():
                if not node.alive or (node.block_id < 0 and node.host_slot < 0):
                    raise BlockStateError(f"{node!r}: a trie node in no tier (or dead but linked)")
                if (node.block_id >= 0 and trie.node(node.block_id) is not node) or \
                        (node.host_slot >= 0 and trie.host_node(node.host_slot) is not node):
                    raise BlockStateError(f"{node!r}: the trie's index disagrees")
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
