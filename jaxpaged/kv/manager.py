"""``KVCacheManager``: the one object the scheduler asks about KV memory (the facade of ``jaxpaged.kv``).

It owns the block tables (``BlockTables``), the counters and the event log, and asks its reservation
policy (``paged`` or ``max_len``, see ``kv/reservation.py``) for physical blocks. The scheduler's
protocol:

1. ``can_admit(seq)`` / ``admit(seq)``: the policy finds blocks for all known tokens of the sequence
   (prompt, plus any tokens generated before a preemption), reusing cached prefix blocks under
   ``paged``. Sets ``num_cached_tokens`` and ``num_computed_tokens`` to the hit length.
2. Each step, before computing ``n`` tokens of a sequence: ``can_append(seq, n)`` / ``append(seq, n)``
   make room for ``num_computed_tokens + n`` tokens (a no-op during a chunked prefill, since
   admission covered the whole prompt; one new block every ``block_size`` decode steps).
   With a host tier, a hit may be on blocks that were offloaded: admission allocates device blocks
   for them and queues their reloads; ``take_transfers()`` hands the queued copies (reloads and
   the offloads of evicted blocks) to the engine, which runs them before the next step.
3. After the step, the scheduler advances ``seq.num_computed_tokens`` and calls
   ``cache_full_blocks(seq)``: blocks that are now full of computed K/V enter the prefix cache.
4. ``free(seq)`` when the request finishes or is preempted: its full blocks stay cached (LRU pool).

With ``kv_events``, the prefix cache's changes are recorded as vLLM's KV-cache events
(``kv/kv_events.py``); ``take_kv_events()`` hands over those since the last call.
"""

from __future__ import annotations

from jaxpaged.config import check_block_size
from jaxpaged.kv.allocator import BlockAllocator
from jaxpaged.kv.block_tables import BlockTables
from jaxpaged.kv.errors import BlockStateError, DoubleFreeError, RequestTooLargeError
from jaxpaged.kv.invariants import check_invariants
from jaxpaged.kv.kv_events import KVCacheEvent, KVEventRecorder
from jaxpaged.kv.max_len import MaxLenReservation
from jaxpaged.kv.prefix_trie import PrefixTrie
from jaxpaged.kv.reservation import PagedReservation, ReservationPolicy
from jaxpaged.kv.stats import EventLog, KVCounters, KVStats, block_utilisation, make_stats
from jaxpaged.request import Sequence


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
        num_host_blocks: int = 0,
        kv_events: bool = False,
    ) -> None:
        """``num_host_blocks``: slots of the host tier under the prefix cache (0: none; ``paged`` with
        prefix caching only). ``kv_events``: record the prefix cache's changes (``take_kv_events``)."""
        self.block_size = check_block_size(block_size)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self._token_cap = max_model_len if max_model_len is not None else 1 << 62
        self.bytes_per_token_slot = bytes_per_token_slot
        self.counters = KVCounters()
        self.events: EventLog | None = None
        if event_log:
            self.events = EventLog(None if event_log is True else int(event_log))
        self.kv_events = KVEventRecorder(self.block_size) if kv_events else None
        self.policy: ReservationPolicy
        if reservation == "paged":
            self.policy = PagedReservation(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                           counters=self.counters, events=self.events, num_host_slots=num_host_blocks,
                                           kv_events=self.kv_events)
        elif reservation == "max_len":
            if enable_prefix_caching:
                raise ValueError(
                    "reservation='max_len' emulates a contiguous KV cache, whose blocks are never shared; "
                    "pass enable_prefix_caching=False with it"
                )
            self.policy = MaxLenReservation(num_blocks, block_size, max_model_len, reserve_request_max_len,
                                            self.counters)
            if num_host_blocks:
                raise ValueError("a host tier (num_host_blocks) holds prefix-cache blocks: it needs reservation='paged'")
        else:
            raise ValueError(f"reservation must be 'paged' or 'max_len', got {reservation!r}")
        self.tables = BlockTables()
        self._seqs: dict[str, Sequence] = {}  # admitted, holding blocks
        # ``has_new_full_blocks(seq)``: True if ``cache_full_blocks(seq)`` has something to do (O(1)).
        # The policy's own check, bound once: the scheduler calls it for every sequence of every step.
        self.has_new_full_blocks = self.policy.has_new_full_blocks

    # ---- pool state ----------------------------------------------------------------------------
    @property
    def reservation(self) -> str:
        return self.policy.name

    @property
    def enable_prefix_caching(self) -> bool:
        return self.policy.trie is not None

    @property
    def allocator(self) -> BlockAllocator | None:
        """The paged policy's allocator (``None`` under ``max_len``): for inspection."""
        return self.policy.allocator

    @property
    def trie(self) -> PrefixTrie | None:
        """The prefix trie (``None`` when prefix caching is off): for inspection."""
        return self.policy.trie

    @property
    def host(self):
        """The host tier's slots (``kv.host_tier.HostBlockPool``; ``None`` without one): for inspection."""
        return getattr(self.policy, "host", None)

    def set_reload_cost(self, cost) -> None:
        """From now on reload a host-tier hit only where copying it back beats recomputing it
        (``kv.host_tier.ReloadCost``; ``None``: always), and offload no block when that can never pay."""
        if self.host is not None:
            self.policy.reload_cost = cost

    def take_transfers(self) -> list:
        """Block copies between the tiers decided since the last call (``kv.host_tier.Transfer``), in
        the order they must run, before the next step reads or writes the pool."""
        return self.policy.take_transfers() if self.host is not None else []

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, as vLLM's KV-cache events (none unless
        ``kv_events``; none without prefix caching, which caches nothing)."""
        return self.kv_events.take() if self.kv_events is not None and self.kv_events.events else []

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (max_len: unreserved)."""
        return self.policy.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still holding cached prefixes (evictable)."""
        return self.policy.num_cached_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by block tables."""
        return self.policy.num_used_blocks

    @property
    def sequences(self) -> list[Sequence]:
        """Admitted sequences (holding blocks), in admission order."""
        return list(self._seqs.values())

    def block_table(self, seq: Sequence) -> list[int]:
        """``seq``'s block table (a copy; empty when it holds no blocks)."""
        return self.tables.blocks(seq.block_table_row) if seq.block_table_row >= 0 else []

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

    def _check_admissible(self, seq: Sequence) -> None:
        if seq.num_tokens == 0:
            raise ValueError(f"request {seq.request_id!r} has no tokens")
        self._check_fits(seq, seq.num_tokens)

    def prefix_hit_blocks(self, seq: Sequence) -> int:
        """Full blocks of ``seq`` that admission would take from the prefix cache right now."""
        return self.policy.prefix_hit_blocks(seq)

    def can_admit(self, seq: Sequence) -> bool:
        """True if ``admit(seq)`` would succeed now. Raises ``RequestTooLargeError`` if it never can.

        Under ``max_len`` a refusal is counted (``max_len_admission_failures``).
        """
        self._check_admissible(seq)
        return self.policy.can_admit(seq)

    def admit(self, seq: Sequence) -> None:
        """Gives ``seq`` a block table covering all its known tokens, reusing cached prefix blocks.

        Raises ``OutOfBlocksError`` (nothing changed) if the pool cannot hold it now.
        """
        rid = seq.request_id
        if rid in self._seqs or seq.block_table_row >= 0:
            raise BlockStateError(f"request {rid!r} already holds blocks; free it before re-admitting")
        self._check_admissible(seq)
        hits, new = self.policy.admit(seq)
        seq.block_table_row = self.tables.add(hits + new)
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self._seqs[rid] = seq
        self.counters.blocks_allocated += len(new)
        self._update_peak()
        if self.events is not None:
            if hits:
                self.events.record("hit", hits, rid)
            self.events.record("allocate", new, rid)

    # ---- growth --------------------------------------------------------------------------------
    def _missing_blocks(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int]:
        """(blocks held, blocks missing) for ``num_computed_tokens + num_new_tokens`` tokens."""
        required = seq.num_computed_tokens + num_new_tokens
        if self.max_model_len is not None and required > self.max_model_len:
            self._check_fits(seq, required)
        have = self.tables.num_blocks(seq.block_table_row)
        missing = self.num_blocks_for(required) - have
        if missing > 0:
            self._check_fits(seq, required)
        return have, missing

    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The new tokens fit in the blocks ``seq`` already holds (then ``append`` has nothing to do):
        the scheduler's fast path for decoding sequences."""
        required = seq.num_computed_tokens + num_new_tokens
        return required <= self.tables.row_lengths[seq.block_table_row] * self.block_size and required <= self._token_cap

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        """True if ``num_new_tokens`` more tokens of ``seq`` can get slots now."""
        if self.has_room(seq, num_new_tokens):
            return True
        have, missing = self._missing_blocks(seq, num_new_tokens)
        return missing <= 0 or self.policy.can_grow(seq, have, missing)

    def append(self, seq: Sequence, num_new_tokens: int = 1) -> list[int]:
        """Grows the block table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        Returns the new block ids (usually none). Raises ``OutOfBlocksError`` (nothing changed) if
        the pool is exhausted: the scheduler should preempt someone and retry.
        """
        rid = seq.request_id
        if self._seqs.get(rid) is not seq:
            raise BlockStateError(f"request {rid!r} is not admitted")
        if self.has_room(seq, num_new_tokens):
            return []
        have, missing = self._missing_blocks(seq, num_new_tokens)
        if missing <= 0:
            return []
        new = self.policy.grow(seq, have, missing)
        self.tables.append(seq.block_table_row, new)
        self.counters.blocks_allocated += len(new)
        self._update_peak()
        if self.events is not None:
            self.events.record("allocate", new, rid)
        return new

    def cache_full_blocks(self, seq: Sequence) -> list[int]:
        """Inserts the blocks of ``seq`` that are full of computed K/V into the prefix cache.

        Covers prompt and generated tokens alike; call it after advancing ``num_computed_tokens``.
        O(1) when no block filled since the last call. Returns the newly cached block ids.
        """
        if not self.policy.has_new_full_blocks(seq):  # the usual decode step: skip the row lookup
            return []
        return self.policy.cache_full_blocks(seq, self.tables.table[seq.block_table_row])

    # ---- release -------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Releases all blocks of a finished or preempted sequence; cached ones stay findable."""
        rid = seq.request_id
        if self._seqs.get(rid) is not seq:
            raise DoubleFreeError(f"request {rid!r} holds no blocks (already freed or never admitted)")
        del self._seqs[rid]
        blocks = self.tables.remove(seq.block_table_row)
        seq.block_table_row = -1
        self.policy.release(seq, blocks)
        if self.events is not None:
            self.events.record("free", blocks, rid)
        seq.num_computed_tokens = 0

    # ---- observability -------------------------------------------------------------------------
    def _update_peak(self) -> None:
        used = self.num_used_blocks
        if used > self.counters.peak_blocks_used:
            self.counters.peak_blocks_used = used

    def filled_slots(self) -> int:
        """Token slots of held blocks that hold (or are about to hold) a token; a block shared by
        several tables counts once. O(admitted sequences)."""
        bs, lengths = self.block_size, self.tables.row_lengths  # Python ints: no numpy scalar per row
        filled = 0
        for s in self._seqs.values():
            tokens, slots = len(s.token_ids), lengths[s.block_table_row] * bs
            filled += tokens if tokens < slots else slots
        return filled - bs * self.policy.num_shared_references  # shared blocks are full

    def block_utilisation(self) -> float:
        """See :func:`jaxpaged.kv.stats.block_utilisation` (the one definition)."""
        return block_utilisation(self.filled_slots(), self.num_used_blocks, self.block_size)

    def stats(self) -> KVStats:
        """A snapshot of block usage, utilisation, prefix hits and evictions."""
        return make_stats(
            self.counters, num_blocks=self.num_blocks, block_size=self.block_size,
            blocks_used=self.num_used_blocks, blocks_free=self.num_free_blocks,
            blocks_cached=self.num_cached_blocks, filled_slots=self.filled_slots(),
            bytes_per_token_slot=self.bytes_per_token_slot,
            host_blocks=self.host.num_slots if self.host is not None else 0,
            host_blocks_used=self.host.num_used_slots if self.host is not None else 0,
        )

    def check_invariants(self) -> None:
        """Recomputes the bookkeeping from the block tables; raises ``BlockStateError`` on a mismatch.

        O(num_blocks + held blocks): for tests and debugging, not for the hot path.
        """
        check_invariants(self.tables, self._seqs.values(), self.policy)
