"""Observability of the KV memory manager: counters, a stats snapshot, an event log, and
``explain_prefix`` (why did these two prompts not share more cached blocks?).

Block utilisation has one definition, :func:`block_utilisation`, used by ``KVCacheManager.stats()``
and by the engine's per-step records alike.

Kept separate from the engine's per-step metrics: everything here is about blocks.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Iterator, Sequence as SequenceT

import numpy as np

from jaxpaged.config import check_block_size


@dataclasses.dataclass
class KVCounters:
    """Monotonic counters the ``KVCacheManager`` bumps as it works."""

    prefix_queries: int = 0  # admissions looked up in the prefix trie
    prefix_query_tokens: int = 0  # tokens those admissions asked for
    prefix_hit_blocks: int = 0
    prefix_hit_tokens: int = 0
    blocks_allocated: int = 0  # fresh blocks handed out (hits excluded)
    blocks_inserted: int = 0  # blocks newly registered in the prefix trie
    evictions: int = 0  # cached blocks reclaimed from the LRU pool
    host_hit_blocks: int = 0  # of prefix_hit_blocks: found on the host tier only (reloaded)
    blocks_offloaded: int = 0  # evicted cached blocks copied to the host tier
    blocks_reloaded: int = 0  # host-tier blocks copied back into the device pool
    host_evictions: int = 0  # host slots reclaimed from the host tier's LRU
    host_hits_recomputed: int = 0  # host-tier hit blocks computed again: cheaper than copying them back
    max_len_admission_failures: int = 0  # max_len admissions refused (no contiguous run)
    max_len_fragmentation_failures: int = 0  # ... although enough blocks were free in total
    peak_blocks_used: int = 0


@dataclasses.dataclass(frozen=True)
class KVStats:
    """A snapshot of the pool. ``kv_bytes_*`` are ``None`` when bytes per token slot are unknown."""

    num_blocks: int
    block_size: int
    blocks_used: int  # referenced by a block table
    blocks_free: int  # on the free list
    blocks_cached: int  # unreferenced but still holding a cached prefix (evictable)
    peak_blocks_used: int
    kv_bytes_in_use: int | None
    peak_kv_bytes_in_use: int | None
    filled_slots: int  # token slots of used blocks that hold (or are about to hold) a token
    allocated_slots: int  # blocks_used * block_size
    block_utilisation: float  # filled_slots / allocated_slots (1.0 when nothing is allocated)
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_blocks: int
    prefix_hit_tokens: int
    prefix_hit_rate: float  # hit tokens / queried tokens
    blocks_allocated: int
    blocks_inserted: int
    evictions: int
    max_len_admission_failures: int
    max_len_fragmentation_failures: int
    host_blocks: int = 0  # the host tier's slots (0: no host tier)
    host_blocks_used: int = 0
    host_blocks_free: int = 0
    host_hit_blocks: int = 0
    host_hit_tokens: int = 0
    blocks_offloaded: int = 0
    blocks_reloaded: int = 0
    host_evictions: int = 0
    host_hits_recomputed: int = 0

    def as_dict(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        kv = "" if self.kv_bytes_in_use is None else (
            f", KV {self.kv_bytes_in_use / 2**20:.1f} MiB (peak {self.peak_kv_bytes_in_use / 2**20:.1f})"
        )
        return (
            f"blocks used {self.blocks_used}/{self.num_blocks} (peak {self.peak_blocks_used}), "
            f"free {self.blocks_free}, cached {self.blocks_cached}{kv}; utilisation "
            f"{self.block_utilisation:.1%}; prefix hit rate {self.prefix_hit_rate:.1%} "
            f"({self.prefix_hit_tokens}/{self.prefix_query_tokens} tokens); evictions {self.evictions}"
            + (
                f"; host tier {self.host_blocks_used}/{self.host_blocks} blocks, {self.host_hit_tokens} hit "
                f"tokens, offloaded {self.blocks_offloaded}, reloaded {self.blocks_reloaded}"
                if self.host_blocks
                else ""
            )
            + (
                f"; max_len refusals {self.max_len_admission_failures} "
                f"({self.max_len_fragmentation_failures} from fragmentation)"
                if self.max_len_admission_failures
                else ""
            )
        )


def block_utilisation(filled_slots: int, blocks_used: int, block_size: int) -> float:
    """Token slots holding a token over token slots of blocks held by block tables (1.0 if none).

    ``filled_slots`` counts a block shared by several tables once (``KVCacheManager.filled_slots``),
    so it never exceeds the allocated slots.
    """
    allocated = blocks_used * block_size
    return filled_slots / allocated if allocated else 1.0


def make_stats(
    c: KVCounters,
    *,
    num_blocks: int,
    block_size: int,
    blocks_used: int,
    blocks_free: int,
    blocks_cached: int,
    filled_slots: int,
    bytes_per_token_slot: int | None,
    host_blocks: int = 0,
    host_blocks_used: int = 0,
) -> KVStats:
    """Builds a ``KVStats`` snapshot from the counters and the pool's current state."""
    per_slot, allocated = bytes_per_token_slot, blocks_used * block_size
    return KVStats(
        num_blocks=num_blocks, block_size=block_size, blocks_used=blocks_used,
        blocks_free=blocks_free, blocks_cached=blocks_cached, peak_blocks_used=c.peak_blocks_used,
        kv_bytes_in_use=None if per_slot is None else allocated * per_slot,
        peak_kv_bytes_in_use=None if per_slot is None else c.peak_blocks_used * block_size * per_slot,
        filled_slots=filled_slots, allocated_slots=allocated,
        block_utilisation=block_utilisation(filled_slots, blocks_used, block_size),
        prefix_queries=c.prefix_queries, prefix_query_tokens=c.prefix_query_tokens,
        prefix_hit_blocks=c.prefix_hit_blocks, prefix_hit_tokens=c.prefix_hit_tokens,
        prefix_hit_rate=c.prefix_hit_tokens / c.prefix_query_tokens if c.prefix_query_tokens else 0.0,
        blocks_allocated=c.blocks_allocated, blocks_inserted=c.blocks_inserted, evictions=c.evictions,
        max_len_admission_failures=c.max_len_admission_failures,
        max_len_fragmentation_failures=c.max_len_fragmentation_failures,
        host_blocks=host_blocks, host_blocks_used=host_blocks_used, host_blocks_free=host_blocks - host_blocks_used,
        host_hit_blocks=c.host_hit_blocks, host_hit_tokens=c.host_hit_blocks * block_size,
        blocks_offloaded=c.blocks_offloaded, blocks_reloaded=c.blocks_reloaded, host_evictions=c.host_evictions,
        host_hits_recomputed=c.host_hits_recomputed,
    )


@dataclasses.dataclass(frozen=True)
class KVEvent:
    kind: str  # "allocate" | "free" | "hit" | "insert" | "evict" | "offload" | "reload" | "host_evict"
    # (block ids: device blocks; for "host_evict", host slots)
    block_ids: tuple[int, ...]
    request_id: str | None
    time: float


class EventLog:
    """Optional, bounded log of block events (``maxlen=None`` keeps everything)."""

    KINDS = ("allocate", "free", "hit", "insert", "evict", "offload", "reload", "host_evict")

    def __init__(self, maxlen: int | None = 100_000) -> None:
        self._events: deque[KVEvent] = deque(maxlen=maxlen)

    def record(self, kind: str, block_ids: SequenceT[int], request_id: str | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {self.KINDS}")
        self._events.append(KVEvent(kind, tuple(block_ids), request_id, time.monotonic()))

    def __iter__(self) -> Iterator[KVEvent]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def of_kind(self, kind: str) -> list[KVEvent]:
        return [e for e in self._events if e.kind == kind]

    def for_request(self, request_id: str) -> list[KVEvent]:
        return [e for e in self._events if e.request_id == request_id]

    def snapshot(self) -> list[KVEvent]:
        """The events now in the log, oldest first (for ``restore``)."""
        return list(self._events)

    def restore(self, events: list[KVEvent]) -> None:
        """Makes the log hold exactly ``events`` again (a ``snapshot``), whatever was recorded since."""
        self._events.clear()
        self._events.extend(events)

    def clear(self) -> None:
        self._events.clear()


@dataclasses.dataclass(frozen=True)
class PrefixDivergence:
    """Where two token sequences stop sharing a prefix, in tokens and in blocks."""

    block_size: int
    len_a: int
    len_b: int
    shared_full_blocks: int  # full blocks identical in both: what prefix caching can share
    first_diff_token: int | None  # None: identical
    first_diff_block: int | None
    token_a: int | None  # token ids at the first difference (None: that sequence ended there)
    token_b: int | None
    # Where an engine's prefix cache holds each shared full block now: "device", "host", "device+host" or
    # "not cached" (empty when no cache was asked: ``explain_prefix`` without ``cached_tiers``). A snapshot of
    # the cache, not part of the divergence: left out of equality.
    cached_tiers: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @property
    def identical(self) -> bool:
        return self.first_diff_token is None

    def __str__(self) -> str:
        shared = f"{self.shared_full_blocks} full blocks ({self.shared_full_blocks * self.block_size} tokens)"
        if self.cached_tiers:
            counts = {t: self.cached_tiers.count(t) for t in dict.fromkeys(self.cached_tiers)}
            shared += " (cached now: " + ", ".join(f"{n} {t}" for t, n in counts.items()) + ")"
        if self.identical:
            return f"identical ({self.len_a} tokens); share {shared}"
        p, blk = self.first_diff_token, self.first_diff_block
        def show(tok: int | None) -> str:
            return "<end>" if tok is None else str(tok)
        return (
            f"share {shared}; first difference at token {p} (block {blk}, offset "
            f"{p % self.block_size}): a={show(self.token_a)} b={show(self.token_b)}; "
            f"blocks {blk}.. of both must be recomputed"
        )


def explain_prefix(
    tokens_a: SequenceT[int], tokens_b: SequenceT[int], block_size: int,
    cached_tiers: SequenceT[str] | None = None,
) -> PrefixDivergence:
    """Diagnoses a prefix-cache miss: the first token and block where ``tokens_a`` and ``tokens_b``
    differ (e.g. a timestamp inside a system prompt), and how many full blocks they share.
    ``cached_tiers``: where a cache holds ``tokens_a``'s full blocks (``TrieNode.tier`` of each, in
    order, as far as the cache has them), kept for the shared blocks ("not cached" past the cached ones)."""
    check_block_size(block_size)
    a = np.asarray(tokens_a, dtype=np.int64)
    b = np.asarray(tokens_b, dtype=np.int64)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        first = int(diff[0])
    elif a.size != b.size:
        first = n  # one is a prefix of the other
    else:
        first = None
    shared = (n if first is None else first) // block_size
    return PrefixDivergence(
        block_size=block_size,
        len_a=int(a.size),
        len_b=int(b.size),
        shared_full_blocks=shared,
        first_diff_token=first,
        first_diff_block=None if first is None else first // block_size,
        token_a=None if first is None or first >= a.size else int(a[first]),
        token_b=None if first is None or first >= b.size else int(b[first]),
        cached_tiers=() if cached_tiers is None else
        tuple(list(cached_tiers[:shared]) + ["not cached"] * (shared - len(cached_tiers[:shared]))),
    )
