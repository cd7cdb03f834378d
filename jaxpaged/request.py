"""``Sequence``: one request's tokens, progress counters, status and timestamps (vLLM's ``Request``).

A leaf module: the scheduler, the KV cache manager and the output side all read and write sequences,
so the type lives below all of them and imports nothing of the package.

Vocabulary (vLLM's):
* block table: logical block ``j`` of the sequence lives in physical block ``block_table[j]``; the
  tables live in the KV manager's ``BlockTables`` matrix, the sequence knows only its row;
* slot: ``block_id * block_size + offset``, the row of the flattened KV pool a token's K/V occupy;
* ``num_cached_tokens``: prompt tokens whose K/V came from the prefix cache at admission;
  ``num_host_cached_tokens`` of them were copied back from the host tier;
* ``num_computed_tokens``: tokens whose K/V are in the pool (cached or computed so far). Chunked
  prefill advances it chunk by chunk; a decode step advances it by one.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Hashable, Sequence as SequenceT


PLACEHOLDER = -1  # a token sampled by the step in flight, not yet on the host (async scheduling)
# Why a sequence ended. "abort" and "error" withdraw it wherever it is (its tokens in flight are dropped).
FINISH_REASONS = ("stop", "length", "abort", "error")
WITHDRAWN = frozenset(("abort", "error"))

class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # admitted: holds a block table
    PREEMPTED = "preempted"  # blocks freed, waiting to be re-admitted (recomputed or re-hit)
    FINISHED = "finished"  # done; see ``finish_reason``


class Sequence:
    """A request as the scheduler and the KV cache manager see it.

    Tokens are one list, prompt first, then generated tokens, so a preempted sequence is re-admitted
    (and prefix-matched) over everything it has so far. ``block_table_row`` is the row of the KV
    manager's ``BlockTables`` that holds this request's block table while it is admitted (-1 when it
    holds no blocks); only the manager sets it (``KVCacheManager.block_table(seq)`` reads the table).
    """

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "block_table_row", "num_cached_tokens",
        "num_host_cached_tokens", "num_computed_tokens", "status", "finish_reason", "sampling_params", "cache_salt",
        "arrival_time", "first_token_time", "finish_time",
        # Output side (engine / output processor): the user request this sequence is sample ``index`` of,
        # what stopped it (a stop token id or string), its incremental detokenizer, and its logprobs.
        "parent", "index", "stop_reason", "detokenizer", "logprobs", "prompt_logprobs",
        # Structured outputs: the sequence's grammar and matcher (``sampling.grammar.StructuredState``), or None.
        "structured",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: SequenceT[int],
        sampling_params: Any = None,
        cache_salt: Hashable = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens: int = len(self.token_ids)
        self.block_table_row: int = -1
        self.num_cached_tokens: int = 0
        self.num_host_cached_tokens: int = 0
        self.num_computed_tokens: int = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (FINISH_REASONS)
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.arrival_time: float = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.parent = None
        self.index = 0
        self.stop_reason: int | str | None = None
        self.detokenizer = None
        self.logprobs: list | None = None  # one raw entry per output token (engine)
        self.prompt_logprobs: dict | None = None  # prompt position -> raw entry (engine)
        self.structured = None

    # ---- tokens --------------------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose K/V are not in the pool yet: > 1 in prefill, 1 in decode."""
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Appends a sampled token; stamps ``first_token_time`` on the first one."""
        self.token_ids.append(int(token_id))
        if self.first_token_time is None:
            self.first_token_time = time.monotonic() if now is None else now

    def finish(self, reason: str, now: float | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic() if now is None else now

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens} (prompt {self.num_prompt_tokens}),"
            f" computed={self.num_computed_tokens}, cached={self.num_cached_tokens},"
            f" row={self.block_table_row}, {self.status.value})"
        )
