"""``KVCacheManager``: the one object the scheduler asks about KV memory.

It ties together the block allocator, the prefix trie and the reservation policy, and keeps every
``Sequence``'s block table and counters consistent with them. The scheduler's protocol:

1. ``can_admit(seq)`` / ``admit(seq)``: prefix-match the sequence's tokens (prompt, plus any tokens
   generated before a preemption), take the hit blocks, allocate blocks for all remaining known
   tokens. Sets ``num_cached_tokens`` and ``num_computed_tokens`` to the hit length.
2. Each step, before computing ``n`` tokens of a sequence: ``can_append(seq, n)`` / ``append(seq, n)``
   make room for ``num_computed_tokens + n`` tokens (a no-op during a chunked prefill, since
   admission covered the whole prompt; one new block every ``block_size`` decode steps).
3. After the step, the scheduler advances ``seq.num_computed_tokens`` and calls
   ``cache_full_blocks(seq)``: blocks that are now full of computed K/V enter the prefix trie.
4. ``free(seq)`` when the request finishes or is preempted: its full blocks stay cached (LRU pool).

Under ``reservation="max_len"`` admission reserves a contiguous run of ``ceil(max_model_len / bs)``
blocks instead (a contiguous KV cache; see ``reservation.MaxLenReservation``, which also offers
per-request maximum lengths); such blocks are never shared, so prefix caching must be off.
"""

from __future__ import annotations

from jaxpaged.block_allocator import (
    BlockAllocator, BlockStateError, DoubleFreeError, OutOfBlocksError, check_block_size,
)
from jaxpaged.block_table import BlockTableRows
from jaxpaged.kv_invariants import check_invariants
from jaxpaged.kv_stats import EventLog, KVCounters, KVStats, make_stats
from jaxpaged.prefix_trie import PrefixTrie, TrieNode
from jaxpaged.reservation import ContiguousReserver, MaxLenReservation
from jaxpaged.sequence import Sequence


class RequestTooLargeError(ValueError):
    """A request that can never be scheduled: more blocks than the pool, or past ``max_model_len``."""


class KVCacheManager:
    """Block tables, prefix caching and reservation for all admitted sequences (see module doc)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        reservation: str = "paged",
        max_model_len: int | None = None,
        event_log: bool | int = False,
        bytes_per_token_slot: int | None = None,
        reserve_request_max_len: bool = False,
    ) -> None:
        self.block_size = check_block_size(block_size)
        if reservation not in ("paged", "max_len"):
            raise ValueError(f"reservation must be 'paged' or 'max_len', got {reservation!r}")
        if reservation == "max_len" and enable_prefix_caching:
            raise ValueError(
                "reservation='max_len' emulates a contiguous KV cache, whose blocks are never shared; "
                "pass enable_prefix_caching=False with it"
            )
        self.num_blocks = num_blocks
        self.reservation = reservation
        self.max_model_len = max_model_len
        self._token_cap = max_model_len if max_model_len is not None else 1 << 62
        self.enable_prefix_caching = enable_prefix_caching
        self.bytes_per_token_slot = bytes_per_token_slot
        self.counters = KVCounters()
        self.events: EventLog | None = None
        if event_log:
            self.events = EventLog(None if event_log is True else int(event_log))
        self.allocator: BlockAllocator | None = None
        self.trie: PrefixTrie | None = None
        self.max_len: MaxLenReservation | None = None
        self.reserver: ContiguousReserver | None = None
        if reservation == "paged":
            self.allocator = BlockAllocator(num_blocks, block_size, on_evict=self._on_evict)
            self.trie = PrefixTrie(block_size) if enable_prefix_caching else None
        else:
            self.max_len = MaxLenReservation(
                num_blocks, block_size, max_model_len, reserve_request_max_len, self.counters
            )
            self.reserver, self.run_length = self.max_len.pool, self.max_len.run_length
        self._seqs: dict[str, Sequence] = {}  # admitted, holding blocks
        self.block_table_rows = BlockTableRows()  # numpy mirror of the admitted block tables
        self._cursors: dict[str, tuple[int, TrieNode | None]] = {}  # blocks in trie, deepest node
        self._last_match: tuple | None = None  # (seq, num_tokens, num_evictions, hits, node)

    # ---- pool state ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (max_len: unreserved)."""
        pool = self.allocator or self.reserver
        return pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still holding cached prefixes (evictable)."""
        return self.allocator.num_cached_blocks if self.allocator else 0

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by block tables."""
        pool = self.allocator or self.reserver
        return pool.num_used_blocks

    @property
    def sequences(self) -> list[Sequence]:
        """Admitted sequences (holding blocks), in admission order."""
        return list(self._seqs.values())

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission -----------------------------------------------------------------------------
    def _check_fits(self, seq: Sequence, num_tokens: int) -> None:
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise RequestTooLargeError(
                f"request {seq.request_id!r} needs {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        if self.num_blocks_for(num_tokens) > self.num_blocks:
            raise RequestTooLargeError(
                f"request {seq.request_id!r} needs {self.num_blocks_for(num_tokens)} blocks of "
                f"{self.block_size} tokens for {num_tokens} tokens, but the pool has only "
                f"{self.num_blocks} blocks: it can never be scheduled"
            )

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
        """Full blocks of ``seq`` that admission would take from the prefix cache right now."""
        return len(self._match(seq)[0])

    def _blocks_short(self, seq: Sequence) -> tuple[list[int], TrieNode | None, int, int]:
        """(hits, node, blocks to allocate, blocks available for them) for admitting ``seq``."""
        hits, node = self._match(seq)
        alloc = self.allocator
        need = self.num_blocks_for(seq.num_tokens) - len(hits)
        available = alloc.num_available_blocks - sum(map(alloc.is_evictable, hits))
        return hits, node, need, available

    def can_admit(self, seq: Sequence) -> bool:
        """True if ``admit(seq)`` would succeed now. Raises ``RequestTooLargeError`` if it never can.

        Under ``max_len`` a refusal is counted (``max_len_admission_failures``).
        """
        if seq.num_tokens == 0:
            raise ValueError(f"request {seq.request_id!r} has no tokens")
        self._check_fits(seq, seq.num_tokens)
        if self.max_len is not None:
            return self.max_len.can_reserve(seq)
        _, _, need, available = self._blocks_short(seq)
        return need <= available

    def admit(self, seq: Sequence) -> None:
        """Gives ``seq`` a block table covering all its known tokens, reusing cached prefix blocks.

        Raises ``OutOfBlocksError`` (nothing changed) if the pool cannot hold it now.
        """
        rid = seq.request_id
        if rid in self._seqs or seq.block_table:
            raise BlockStateError(f"request {rid!r} already holds blocks; free it before re-admitting")
        if seq.num_tokens == 0:
            raise ValueError(f"request {rid!r} has no tokens")
        self._check_fits(seq, seq.num_tokens)
        if self.max_len is not None:
            hits: list[int] = []
            new = self.max_len.reserve(seq)
        else:
            hits, node, need, available = self._blocks_short(seq)
            if need > available:
                raise OutOfBlocksError(
                    f"request {rid!r} needs {need} new blocks, {available} free or evictable"
                )
            for block_id in hits:
                self.allocator.incref(block_id)
            new = self.allocator.allocate(need)
            if self.trie is not None:
                c = self.counters
                c.prefix_queries += 1
                c.prefix_query_tokens += seq.num_tokens
                c.prefix_hit_blocks += len(hits)
                c.prefix_hit_tokens += len(hits) * self.block_size
                self._cursors[rid] = (len(hits), node)
        self._last_match = None
        seq.block_table = hits + new
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self._seqs[rid] = seq
        self.block_table_rows.attach(seq)
        self.counters.blocks_allocated += len(new)
        self._update_peak()
        if self.events is not None:
            if hits:
                self.events.record("hit", hits, rid)
            self.events.record("allocate", new, rid)

    # ---- growth --------------------------------------------------------------------------------
    def _blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        required = seq.num_computed_tokens + num_new_tokens
        if self.max_model_len is not None and required > self.max_model_len:
            self._check_fits(seq, required)
        missing = self.num_blocks_for(required) - len(seq.block_table)
        if missing <= 0:
            return 0
        if self.reserver is not None:
            raise RequestTooLargeError(
                f"request {seq.request_id!r} needs {required} tokens, more than its max_len "
                f"reservation of {len(seq.block_table) * self.block_size}"
            )
        self._check_fits(seq, required)
        return missing

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """True if ``num_new_tokens`` more tokens of ``seq`` can get slots now."""
        required = seq.num_computed_tokens + num_new_tokens  # fast path: room in the last block
        if required <= len(seq.block_table) * self.block_size and required <= self._token_cap:
            return True
        missing = self._blocks_to_grow(seq, num_new_tokens)
        return missing == 0 or missing <= self.allocator.num_available_blocks

    def append(self, seq: Sequence, num_new_tokens: int = 1) -> list[int]:
        """Grows the block table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        Returns the new block ids (usually none). Raises ``OutOfBlocksError`` (nothing changed) if
        the pool is exhausted: the scheduler should preempt someone and retry.
        """
        required = seq.num_computed_tokens + num_new_tokens  # fast path: room in the last block
        if required <= len(seq.block_table) * self.block_size and required <= self._token_cap:
            return []
        missing = self._blocks_to_grow(seq, num_new_tokens)
        if missing == 0:
            return []
        rid = seq.request_id
        if self._seqs.get(rid) is not seq:
            raise BlockStateError(f"request {rid!r} is not admitted")
        if missing > self.allocator.num_available_blocks:
            raise OutOfBlocksError(
                f"request {rid!r} needs {missing} more blocks, "
                f"{self.allocator.num_available_blocks} free or evictable"
            )
        new = self.allocator.allocate(missing)
        seq.block_table.extend(new)
        self.block_table_rows.sync(seq)
        self.counters.blocks_allocated += missing
        self._update_peak()
        if self.events is not None:
            self.events.record("allocate", new, rid)
        return new

    def cache_full_blocks(self, seq: Sequence) -> list[int]:
        """Inserts the blocks of ``seq`` that are full of computed K/V into the prefix trie.

        Covers prompt and generated tokens alike; call it after advancing ``num_computed_tokens``.
        O(1) when no block filled since the last call. Returns the newly cached block ids.
        """
        if self.trie is None:
            return []
        rid = seq.request_id
        num_full = seq.num_computed_tokens // self.block_size
        start, node = self._cursors[rid]
        if num_full <= start:
            return []
        new, node = self.trie.insert(
            seq.token_ids, seq.block_table, seq.cache_salt,
            num_blocks=num_full, start_block=start, parent=node,
        )
        for block_id in new:
            self.allocator.mark_cached(block_id)
        self._cursors[rid] = (num_full, node)
        self.counters.blocks_inserted += len(new)
        if new and self.events is not None:
            self.events.record("insert", new, rid)
        return new

    # ---- release -------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Releases all blocks of a finished or preempted sequence; cached ones stay findable."""
        rid = seq.request_id
        if self._seqs.get(rid) is not seq:
            raise DoubleFreeError(f"request {rid!r} holds no blocks (already freed or never admitted)")
        del self._seqs[rid]
        self._cursors.pop(rid, None)
        self.block_table_rows.detach(seq)
        blocks = seq.block_table
        if self.reserver is not None:
            self.reserver.release(blocks)
        else:
            self.allocator.free(blocks)
        if self.events is not None:
            self.events.record("free", blocks, rid)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _on_evict(self, block_id: int) -> list[int]:
        detached = self.trie.evict(block_id)
        self.counters.evictions += 1
        if self.events is not None:
            self.events.record("evict", [block_id, *detached])
        return detached

    # ---- observability -------------------------------------------------------------------------
    def _update_peak(self) -> None:
        used = self.num_used_blocks
        if used > self.counters.peak_blocks_used:
            self.counters.peak_blocks_used = used

    def stats(self) -> KVStats:
        """A snapshot of block usage, utilisation, prefix hits and evictions."""
        bs = self.block_size
        filled = sum(min(s.num_tokens, len(s.block_table) * bs) for s in self._seqs.values())
        if self.allocator is not None:  # a block shared by r tables is full and counted r times
            filled -= bs * self.allocator.num_shared_references()
        return make_stats(
            self.counters, num_blocks=self.num_blocks, block_size=bs,
            blocks_used=self.num_used_blocks, blocks_free=self.num_free_blocks,
            blocks_cached=self.num_cached_blocks, filled_slots=filled,
            bytes_per_token_slot=self.bytes_per_token_slot,
        )

    def check_invariants(self) -> None:
        """Recomputes the bookkeeping from the block tables; raises ``BlockStateError`` on a mismatch.

        O(num_blocks + held blocks): for tests and debugging, not for the hot path.
        """
        check_invariants(self)
