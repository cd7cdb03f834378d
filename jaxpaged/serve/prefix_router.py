"""``PrefixCacheRouter``: Ray Serve's request router for jaxpaged replicas that sends a request to the replica most
likely to hold its prompt's longest prefix in its prefix cache, unless that replica is busier than the least
busy one by more than ``imbalanced_threshold`` requests; then (and when no replica holds any of the prefix) it
is Ray's power of two choices.

What a replica holds is estimated from what was routed to it (as Ray's ``PrefixCacheAffinityRouter`` does): the
routing text (``ForwardedRequest.routing_text``, the prompt or the chat messages' text) is cut into chunks of
``chunk_chars`` characters, each named by a hash chained over the chunks before it, so a chunk's hash names
the whole prefix up to its end, as a block's hash does in the engine. A replica's record keeps the
``max_chunks_per_replica`` most recently routed chunks (least recently used out, as the engine evicts) and is
dropped when the replica goes. Cost per request: one hash per chunk of at most ``max_chars`` characters, one
set look-up per chunk and replica. The record lives in the process that routes (each handle has its own
router); the ingress deployment holds the only handle that routes user requests.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


def prefix_hashes(text: str, chunk_chars: int, max_chars: int) -> list[int]:
    """Chained hashes of the full ``chunk_chars``-character chunks of ``text[:max_chars]``."""
    out, h = [], 0
    for start in range(0, min(len(text), max_chars) - chunk_chars + 1, chunk_chars):
        h = hash((h, text[start:start + chunk_chars]))
        out.append(h)
    return out


class ReplicaPrefixes:
    """The prefix chunks one replica was sent, least recently used first, at most ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._chunks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """Leading chunks of ``hashes`` this replica was sent."""
        n = 0
        for h in hashes:
            if h not in self._chunks:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        chunks = self._chunks
        for h in hashes:
            chunks[h] = None
            chunks.move_to_end(h)
        while len(chunks) > self.capacity:
            chunks.popitem(last=False)


def routing_text(pending_request: PendingRequest | None) -> str:
    """The text a request is routed by: its first argument's ``routing_text`` (``""``: none)."""
    if pending_request is None or not pending_request.args:
        return ""
    text = getattr(pending_request.args[0], "routing_text", "")
    return text if isinstance(text, str) else ""


class PrefixCacheRouter(RequestRouter):
    """Prefix-cache-aware routing balanced against load (module doc)."""

    def initialize_state(self, chunk_chars: int = 64, max_chars: int = 65_536, imbalanced_threshold: int = 8,
                         max_chunks_per_replica: int = 1 << 20, **_: Any) -> None:
        for name, value in (("chunk_chars", chunk_chars), ("max_chars", max_chars),
                            ("max_chunks_per_replica", max_chunks_per_replica)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PrefixCacheRouter: {name} must be a positive integer, got {value!r}")
        self.chunk_chars, self.max_chars = chunk_chars, max_chars
        self.imbalanced_threshold = imbalanced_threshold
        self.max_chunks_per_replica = max_chunks_per_replica
        self._prefixes: dict[ReplicaID, ReplicaPrefixes] = {}

    def _record(self, replica_id: ReplicaID) -> ReplicaPrefixes:
        record = self._prefixes.get(replica_id)
        if record is None:
            record = self._prefixes[replica_id] = ReplicaPrefixes(self.max_chunks_per_replica)
        return record

    def _prefix_hashes(self, pending_request: PendingRequest | None) -> list[int]:
        text = routing_text(pending_request)
        return prefix_hashes(text, self.chunk_chars, self.max_chars) if text else []

    def _load(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    @staticmethod
    def _two_random(candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Ray's power of two choices: two replicas at random; the less busy one that accepts is taken."""
        return [random.sample(candidates, min(2, len(candidates)))] if candidates else []

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes = self._prefix_hashes(pending_request)
        if not hashes or not candidate_replicas:
            return self._two_random(candidate_replicas)
        matched = {r.replica_id: self._record(r.replica_id).match(hashes) for r in candidate_replicas}
        best = max(matched.values())
        if best == 0:
            return self._two_random(candidate_replicas)
        holders = [r for r in candidate_replicas if matched[r.replica_id] == best]
        least_busy = min(map(self._load, candidate_replicas))
        if min(map(self._load, holders)) - least_busy > self.imbalanced_threshold:
            return self._two_random(candidate_replicas)  # the holders are too busy: spread the load
        others = sorted((r for r in candidate_replicas if matched[r.replica_id] < best),
                        key=lambda r: (-matched[r.replica_id], self._load(r)))
        return [holders] + ([others] if others else [])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        hashes = self._prefix_hashes(pending_request)
        if hashes:
            self._record(replica_id).add(hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._prefixes.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for replica_id in [r for r in self._prefixes if r not in alive]:
            del self._prefixes[replica_id]
