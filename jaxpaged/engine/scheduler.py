"""Scheduler: continuous batching with a token budget, chunked prefill and preemption by recompute.

Each step gives every scheduled sequence ``n`` new tokens to compute: running sequences first (a
decode is ``n == 1``; a prompt still being prefilled in chunks gets what is left of the budget), then
waiting sequences in the policy's order, admitted while the budget, ``max_num_seqs`` and the KV pool
allow. A prefix-cache hit is decided at admission (``KVCacheManager.admit``): cached tokens count as
computed, so only the rest costs budget. When a running sequence needs a block and none is free, the
newest running sequence is preempted: its blocks are freed (full ones stay in the prefix cache) and it
goes back to the front of the queue, to be recomputed, usually mostly from cache, when re-admitted.

Waiting requests are considered in the order the scheduling policy gives (``scheduling_policy.py``):
arrival order (``fcfs``) or, with ``scheduling_policy="prefix_affinity"``, requests whose prefix is cached
or being computed first, with a bounded wait.

The scheduler is the one place that ends a sequence: by length when a step is booked (``advance``), by
EOS or a stop token when its token arrives (``resolve``), by a stop string the output side found in its
text (``stop_on_string``), and withdrawn (``abort``: "abort", or "error" for a request that failed).

Structured outputs (``seq.structured``): a sequence waits in the queue while its grammar compiles (the
requests behind it go meanwhile); its matcher takes each token when it arrives (``resolve``) and the
sequence ends ("stop") when the grammar is complete. It is scheduled like any other: its token mask is
applied after the step is launched (``sampling/features.py``), so its token may still be in flight.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import numpy as np

from ..kv import KVCacheManager
from .scheduling_policy import make_policy
from ..request import PLACEHOLDER, WITHDRAWN, Sequence, SequenceStatus

ScheduledBatch = list[tuple[Sequence, int]]
Samples = list[tuple[int, Sequence, int]]  # (row in the step's output, sequence, index in its token_ids)


@dataclasses.dataclass
class SchedulerCounters:
    steps: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    deferred_admissions: int = 0  # admissions postponed to reuse a block another request is computing
    reordered_admissions: int = 0  # prefix_affinity: admissions ahead of an earlier-arrived request
    max_passes_observed: int = 0  # prefix_affinity: most steps one request was passed over


class Scheduler:
    """Owns the waiting queue and running list; decides each step's ``(sequence, num_new_tokens)``."""

    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (), enable_chunked_prefill: bool = True,
                 scheduling_policy: str = "fcfs"):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self.policy = make_policy(scheduling_policy)
        # Constrained sequences whose matcher refused their token (the engine ends their requests).
        self.grammar_failures: list[tuple[Sequence, str]] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.policy.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1
        self.policy.requeue(seq)

    def schedule(self) -> ScheduledBatch:
        """Picks this step's work; allocates the blocks it needs (preempting if it must)."""
        budget = self.max_num_batched_tokens
        scheduled: ScheduledBatch = []
        preempted = False
        kv = self.kv
        has_room, running, chunked = kv.has_room, self.running, self.enable_chunked_prefill
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            n = uncomputed if uncomputed < budget else budget
            if n < uncomputed and not chunked:
                break
            if not has_room(seq, n):  # needs new blocks (the fast path: it already has them)
                while not kv.can_append(seq, n):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is SequenceStatus.PREEMPTED:
                    break
                kv.append(seq, n)
            scheduled.append((seq, n))
            budget -= n
            i += 1
        # Admit new work only when nobody had to be preempted: a preemption means the pool is full.
        in_flight = self._prefill_frontiers() if self.kv.enable_prefix_caching and self.waiting else None
        policy = self.policy
        admitting = not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        if admitting:
            self.waiting = policy.order(self.waiting, self.kv.prefix_hit_blocks, self._frontier_key, in_flight)
        admitted = []
        i = 0  # under fcfs always 0: the head of the queue or nobody
        while not preempted and i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.structured is not None and not seq.structured.ready:
                i += 1  # its grammar is compiling: the requests behind it go first
                continue
            if not self.kv.can_admit(seq):
                break
            if not self.enable_chunked_prefill and seq.num_tokens > budget:
                break
            if in_flight and self._frontier_key(seq, self.kv.prefix_hit_blocks(seq)) in in_flight:
                # Its next block is being computed right now for another request: wait one step and
                # take it from the cache instead of computing the same K/V twice.
                self.counters.deferred_admissions += 1
                if policy.skip_when_deferred(seq):
                    i += 1  # prefix_affinity: let the requests behind it go meanwhile
                    continue
                break
            self.kv.admit(seq)
            if in_flight is not None:
                key = self._frontier_key(seq, seq.num_computed_tokens // self.kv.block_size)
                if key is not None:
                    in_flight.add(key)
            n = min(seq.num_uncomputed_tokens, budget)
            self.kv.append(seq, n)
            if i == 0:
                self.waiting.popleft()
            else:
                del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            admitted.append(seq)
        if admitted:
            policy.after_admission(admitted, self.waiting)
            self.counters.reordered_admissions = policy.reordered_admissions
            self.counters.max_passes_observed = policy.max_observed_passes
        return scheduled

    def _frontier_key(self, seq: Sequence, num_cached_blocks: int) -> tuple | None:
        """Token-exact key of the first block after ``seq``'s cached ones (None if not a full block)."""
        end = (num_cached_blocks + 1) * self.kv.block_size
        if end >= len(seq.token_ids):  # the last token is always computed, so no full block to share
            return None
        return seq.cache_salt, tuple(seq.token_ids[:end])

    def _prefill_frontiers(self) -> set[tuple]:
        """Keys of the blocks that running prefills compute next (not yet in the prefix cache)."""
        bs = self.kv.block_size
        keys = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens - 1:
                key = self._frontier_key(seq, seq.num_computed_tokens // bs)
                if key is not None:
                    keys.add(key)
        return keys

    # ---- after a step: book it when dispatched (advance), fill its tokens in when read (resolve) ----
    def advance(self, scheduled: ScheduledBatch) -> Samples:
        """Books a dispatched step whose sampled tokens are not known yet.

        Progress advances, and each sequence whose chunk reached its end gets a ``PLACEHOLDER`` token
        (the next step reads the real one from the device). Sequences that reach ``max_tokens`` /
        ``max_model_len`` with it finish now (their blocks are freed: later steps run after this one
        on the device). Returns the placeholders to fill in with ``resolve``. Call it after resolving
        the previous step, so that every cached block holds real token ids.
        """
        c = self.counters
        c.steps += 1
        samples: Samples = []
        running_status, finished_status = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        kv, max_model_len = self.kv, self.max_model_len
        has_new_full_blocks = kv.has_new_full_blocks  # (the hot loop: once per sequence)
        decode_tokens = prefill_tokens = 0
        for row, (seq, n) in enumerate(scheduled):
            if seq.status is not running_status:  # finished (stop token) while this step ran
                continue
            tokens_list = seq.token_ids
            num_tokens = len(tokens_list)
            # (the counters are added once after the loop: the batch-256 host path)
            if n == 1 and num_tokens > seq.num_prompt_tokens:
                decode_tokens += 1
            else:
                prefill_tokens += n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == num_tokens:
                samples.append((row, seq, num_tokens))
                tokens_list.append(PLACEHOLDER)
                if (num_tokens + 1 - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
                        or num_tokens + 1 >= max_model_len):
                    seq.finish("length")
            if has_new_full_blocks(seq):
                kv.cache_full_blocks(seq)
            if seq.status is finished_status:
                kv.free(seq)
                self.running.remove(seq)
        c.decode_tokens += decode_tokens
        c.prefill_tokens += prefill_tokens
        return samples

    def resolve(self, samples: Samples, tokens: np.ndarray) -> list[Sequence]:
        """Fills the placeholders of a step with its sampled ``tokens`` and stops the sequences that
        sampled EOS or one of their ``stop_token_ids`` (after ``min_tokens``), or whose grammar is
        complete. Returns the sequences that got their token (not those aborted meanwhile). Stop
        strings are the output side's (``OutputProcessor.stop_strings``), which then calls :meth:`finish`.
        A token a sequence's grammar refuses is noted in ``grammar_failures`` for the engine."""
        now = time.monotonic()
        got = []
        finished_status, is_stop = SequenceStatus.FINISHED, self._is_stop_token
        for (row, seq, pos), token in zip(samples, np.asarray(tokens)[[r for r, _, _ in samples]].tolist()):
            if seq.finish_reason in WITHDRAWN:  # aborted (or failed) while this step ran: already removed
                continue
            seq.token_ids[pos] = token
            if seq.first_token_time is None:
                seq.first_token_time = now
            got.append(seq)
            complete = seq.structured is not None and self._grammar_complete(seq, token)
            if seq.status is finished_status:  # finished by length when booked (advance)
                if seq.finish_reason == "length" and (complete or is_stop(seq, token)):
                    seq.finish_reason = "stop"
                seq.finish_time = now
            elif complete or is_stop(seq, token):
                self.finish(seq, "stop", now)
        self.counters.generated_tokens += len(got)
        return got

    def _grammar_complete(self, seq: Sequence, token: int) -> bool:
        """Advances ``seq``'s matcher by ``token``; True if its grammar is now complete."""
        matcher = seq.structured.matcher
        if not matcher.accept(token):
            self.grammar_failures.append((seq, f"token {token} refused by its grammar: {matcher.error}"))
            return False
        return matcher.is_terminated()

    def finish(self, seq: Sequence, reason: str, now: float | None = None) -> None:
        """Ends an unfinished sequence now (running, or waiting after a preemption), releasing its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.kv.free(seq)
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its token was in flight
            self.waiting.remove(seq)
            self.policy.remove(seq)
        seq.finish(reason, now)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        """True if ``token`` (just placed at the end of ``seq``'s known tokens) ends it; records why in
        ``seq.stop_reason`` (vLLM's: the stop token id; None for EOS)."""
        sp = seq.sampling_params
        if sp.min_tokens and seq.num_output_tokens < sp.min_tokens:
            return False
        if not sp.ignore_eos and token in self.eos_token_ids:
            return True
        if sp.stop_token_ids and token in sp.stop_token_ids:
            seq.stop_reason = token
            return True
        return False

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Removes a request wherever it is, releasing its blocks (``reason``: "abort", or "error" for a
        request that failed)."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.policy.remove(seq)
        seq.finish(reason)

    def stop_on_string(self, seq: Sequence, stop: str) -> None:
        """The output side found the stop string ``stop`` in ``seq``'s text: it ends with "stop" (also
        when its last allowed token already ended it by length; a stop token that ended it stays its reason)."""
        if seq.is_finished:
            if seq.finish_reason == "length":
                seq.finish_reason, seq.stop_reason = "stop", stop
        else:
            seq.stop_reason = stop
            self.finish(seq, "stop")
