"""Scheduling policies: the order in which the scheduler considers waiting requests for admission.

* ``fcfs`` (default, :class:`FCFSPolicy`): arrival order; preempted requests go back to the front: the
  scheduler's own queue discipline, which this policy leaves as it is.
* ``prefix_affinity`` (:class:`PrefixAffinityPolicy`): among the first ``window`` waiting requests,
  prefer those whose prefix is in the prefix cache right now (``KVCacheManager.prefix_hit_blocks``)
  or being computed by a running prefill (its next block is a prefill "frontier"), so requests that
  share a system prompt run close together: the prefix is computed once and is reused before the
  LRU pool evicts it to make room for other prefixes.

The bounded wait (no starvation). A step *passes over* a waiting request when it admits a request
that arrived later while this one stays waiting. A request passed over in more than ``max_passes``
steps is *overdue*. Each step the policy orders the window as:

1. preempted requests, then overdue requests, in arrival order, with FCFS semantics (if the first of
   them cannot be admitted, nothing behind it is admitted either);
2. requests with affinity, most cached blocks first (fewest prefill tokens), ties in arrival order;
3. everyone else, in arrival order.

A request with affinity whose next block is being computed right now (admitting it would compute
the same K/V twice) is skipped for one step instead of blocking the queue, as it does under FCFS;
it is admitted from the cache the step after. So a request waits at most ``max_passes`` steps of
being overtaken, plus what FCFS would make it wait behind the overdue requests ahead of it.
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable, Iterable

from ..config import SCHEDULING_POLICIES
from ..request import Sequence, SequenceStatus


class FCFSPolicy:
    """Arrival order: the waiting queue as the scheduler keeps it; a request whose next block is being
    computed blocks the queue behind it for that step."""

    name = "fcfs"
    reordered_admissions = 0
    max_observed_passes = 0

    def add(self, seq: Sequence) -> None:
        pass

    def requeue(self, seq: Sequence) -> None:
        pass

    def remove(self, seq: Sequence) -> None:
        pass

    def order(self, waiting: collections.deque[Sequence], hit_blocks, frontier, in_flight) -> collections.deque[Sequence]:
        return waiting

    def skip_when_deferred(self, seq: Sequence) -> bool:
        return False

    def after_admission(self, admitted: list[Sequence], still_waiting: Iterable[Sequence]) -> None:
        pass


class PrefixAffinityPolicy:
    """Orders waiting requests by prefix-cache affinity, with a bounded wait (see the module doc).

    ``window``: waiting requests scored per step (the rest keep arrival order; bounds the host cost
    of scoring to ``window`` trie lookups). ``max_passes``: steps a request may be passed over
    before it goes first.
    """

    name = "prefix_affinity"

    def __init__(self, *, window: int = 64, max_passes: int = 8) -> None:
        if window < 1 or max_passes < 0:
            raise ValueError(f"window must be >= 1 and max_passes >= 0, got {window}, {max_passes}")
        self.window = window
        self.max_passes = max_passes
        self._ticket: dict[str, int] = {}  # request id -> arrival rank (preempted: -1, i.e. first)
        self._passes: dict[str, int] = {}  # request id -> steps in which it was passed over
        self._next_ticket = 0
        self.reordered_admissions = 0  # admissions that FCFS would have made later (diagnostics)
        self.max_observed_passes = 0

    # ---- queue membership ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A new request joined the waiting queue."""
        self._ticket[seq.request_id] = self._next_ticket
        self._next_ticket += 1
        self._passes.setdefault(seq.request_id, 0)

    def requeue(self, seq: Sequence) -> None:
        """A preempted request went back to the queue: it goes first, like under FCFS."""
        self._ticket[seq.request_id] = -1
        self._passes.setdefault(seq.request_id, 0)

    def remove(self, seq: Sequence) -> None:
        """A request left the waiting queue (admitted, aborted, finished while preempted)."""
        self._ticket.pop(seq.request_id, None)
        self._passes.pop(seq.request_id, None)

    # ---- ordering --------------------------------------------------------------------------------
    def is_overdue(self, seq: Sequence) -> bool:
        return seq.status is SequenceStatus.PREEMPTED or self._passes.get(seq.request_id, 0) > self.max_passes

    def order(self, waiting: collections.deque[Sequence], hit_blocks: Callable[[Sequence], int],
              frontier: Callable[[Sequence, int], Hashable | None], in_flight: set | None) -> collections.deque[Sequence]:
        """The waiting queue in this step's admission order (a new deque; same elements).

        ``hit_blocks(seq)``: full blocks the prefix cache would give ``seq`` now. ``frontier(seq, k)``:
        key of ``seq``'s block after its first ``k`` (None if not a full block); ``in_flight``: the
        frontier keys running prefills compute in this step.
        """
        head = [waiting[i] for i in range(min(self.window, len(waiting)))]
        ticket = self._ticket
        ranked = []
        for seq in head:
            t = ticket.get(seq.request_id, -1)
            if self.is_overdue(seq):
                ranked.append((0, 0, t, seq))
                continue
            hits = hit_blocks(seq)
            computing = bool(in_flight) and frontier(seq, hits) in in_flight
            if hits or computing:
                ranked.append((1, -(hits + computing), t, seq))
            else:
                ranked.append((2, 0, t, seq))
        ranked.sort(key=lambda r: r[:3])
        out = collections.deque(r[3] for r in ranked)
        out.extend(waiting[i] for i in range(len(head), len(waiting)))
        return out

    def skip_when_deferred(self, seq: Sequence) -> bool:
        """True: a request whose next block is being computed waits without blocking the queue.
        Overdue requests keep FCFS semantics (they block)."""
        return not self.is_overdue(seq)

    # ---- bookkeeping after a step's admissions ---------------------------------------------------
    def after_admission(self, admitted: list[Sequence], still_waiting: Iterable[Sequence]) -> None:
        """Counts a pass for every waiting request (of the window) that arrived before the
        latest-arriving request admitted in this step."""
        if not admitted:
            return
        ticket = self._ticket
        admitted_tickets = [ticket.get(s.request_id, -1) for s in admitted]
        for seq in admitted:
            self.remove(seq)
        passes = self._passes
        earliest_waiting = None
        latest = max(admitted_tickets)
        for n, seq in enumerate(still_waiting):
            if n >= self.window:
                break
            rid = seq.request_id
            t = ticket.get(rid, -1)
            earliest_waiting = t if earliest_waiting is None else min(earliest_waiting, t)
            if t < latest:
                passes[rid] = p = passes.get(rid, 0) + 1
                self.max_observed_passes = max(self.max_observed_passes, p)
        if earliest_waiting is not None:
            self.reordered_admissions += sum(t > earliest_waiting for t in admitted_tickets)


SchedulingPolicy = FCFSPolicy | PrefixAffinityPolicy


def make_policy(name: str) -> SchedulingPolicy:
    """The policy object for ``EngineConfig.scheduling_policy``."""
    if name == "fcfs":
        return FCFSPolicy()
    if name == "prefix_affinity":
        return PrefixAffinityPolicy()
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {name!r}")
