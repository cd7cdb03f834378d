"""``Sequence``: one request's tokens, block table, progress counters and timestamps.

Plus the vectorised helpers that turn block tables into the padded ``i32`` arrays the device step
consumes (``block_tables``, ``slot_mapping``, ``slot_mapping_batch``), with no per-token Python loops.

Vocabulary (vLLM's):
* block table: logical block ``j`` of the sequence lives in physical block ``block_table[j]``;
* slot: ``block_id * block_size + offset``, the row of the flattened KV pool a token's K/V occupy;
* ``num_cached_tokens``: prompt tokens whose K/V came from the prefix cache at admission;
* ``num_computed_tokens``: tokens whose K/V are in the pool (cached or computed so far). Chunked
  prefill advances it chunk by chunk; a decode step advances it by one.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Hashable, Sequence as SequenceT

import numpy as np

from jaxpaged.block_table import BlockTableRows


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # admitted: holds a block table
    PREEMPTED = "preempted"  # blocks freed, waiting to be re-admitted (recomputed or re-hit)
    FINISHED = "finished"  # done; see ``finish_reason``


class Sequence:
    """A request as the scheduler and the KV cache manager see it.

    Tokens are one list, prompt first, then generated tokens, so a preempted sequence is re-admitted
    (and prefix-matched) over everything it has so far. Mutate ``block_table`` only through
    ``KVCacheManager``: it appends to the list or replaces it, and mirrors every change into its
    ``BlockTableRows`` matrix (this sequence's ``_bt_row``), which ``block_tables`` gathers from.
    ``block_table_array`` caches a numpy copy keyed on the list object and its length (the
    fallback for tables set by hand).
    """

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "block_table", "num_cached_tokens",
        "num_computed_tokens", "status", "finish_reason", "sampling_params", "cache_salt",
        "arrival_time", "first_token_time", "finish_time", "_bt_src", "_bt_len", "_bt_array",
        "_bt_rows", "_bt_row", "_bt_synced",
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
        self.block_table: list[int] = []
        self.num_cached_tokens: int = 0
        self.num_computed_tokens: int = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt
        self.arrival_time: float = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self._bt_src: list[int] | None = None
        self._bt_len = -1
        self._bt_array = np.zeros(0, np.int32)
        self._bt_rows: BlockTableRows | None = None  # the manager's matrix mirror, while admitted
        self._bt_row = -1
        self._bt_synced = 0

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

    # ---- blocks --------------------------------------------------------------------------------
    def block_table_array(self) -> np.ndarray:
        """The block table as ``i32[len(block_table)]``, rebuilt only when the table changed."""
        table = self.block_table
        if table is not self._bt_src or len(table) != self._bt_len:
            self._bt_array = np.array(table, dtype=np.int32)
            self._bt_src, self._bt_len = table, len(table)
        return self._bt_array

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens} (prompt {self.num_prompt_tokens}),"
            f" computed={self.num_computed_tokens}, cached={self.num_cached_tokens},"
            f" blocks={len(self.block_table)}, {self.status.value})"
        )


def block_tables(seqs: SequenceT[Sequence], width: int) -> np.ndarray:
    """``i32[S, width]``: row ``i`` is ``seqs[i].block_table``, padded with 0 (a valid block id;
    kernels never read past ``kv_lens``).

    Sequences admitted by one ``KVCacheManager`` are mirrored in its ``BlockTableRows`` matrix: one
    gather. Otherwise (tables set by hand) one concatenate and one masked store.
    """
    num = len(seqs)
    out = np.zeros((num, width), dtype=np.int32)
    if not num:
        return out
    lens = np.fromiter([len(s.block_table) for s in seqs], dtype=np.int64, count=num)
    if lens.max() > width:
        i = int(lens.argmax())
        raise ValueError(
            f"request {seqs[i].request_id!r} has {int(lens[i])} blocks, more than width={width}"
        )
    mirror = seqs[0]._bt_rows
    if mirror is not None and all([s._bt_rows is mirror for s in seqs]):
        synced = np.fromiter([s._bt_synced for s in seqs], dtype=np.int64, count=num)
        if (synced == lens).all():
            rows = np.fromiter([s._bt_row for s in seqs], dtype=np.int64, count=num)
            if width <= mirror.width:
                return mirror.table[rows, :width]  # a fresh array (fancy indexing copies)
            out[:, : mirror.width] = mirror.table[rows]
            return out
    arrays = [seq.block_table_array() for seq in seqs]
    out[np.arange(width) < lens[:, None]] = np.concatenate(arrays)
    return out


def slot_mapping(
    block_table: SequenceT[int] | np.ndarray, start_pos: int, num_tokens: int, block_size: int
) -> np.ndarray:
    """``i32[num_tokens]``: pool slots of positions ``start_pos .. start_pos + num_tokens - 1``."""
    table = np.asarray(block_table, dtype=np.int32)
    positions = np.arange(start_pos, start_pos + num_tokens, dtype=np.int32)
    if num_tokens and (start_pos < 0 or (start_pos + num_tokens - 1) // block_size >= table.size):
        raise IndexError(
            f"positions {start_pos}..{start_pos + num_tokens - 1} need "
            f"{(start_pos + num_tokens - 1) // block_size + 1} blocks, block table has {table.size}"
        )
    return table[positions // block_size] * block_size + positions % block_size


def slot_mapping_batch(
    block_tables_arr: np.ndarray, seq_indices: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """``i32[T]`` slots for a ragged batch: token ``t`` of row ``seq_indices[t]`` at ``positions[t]``.

    ``block_tables_arr`` is ``block_tables(seqs, width)``; one gather for prefill and decode tokens
    alike (decode: ``seq_indices = arange(S)``, ``positions = num_computed_tokens``).
    """
    blocks = block_tables_arr[seq_indices, positions // block_size]
    return (blocks * block_size + positions % block_size).astype(np.int32, copy=False)


def computed_lengths(seqs: SequenceT[Sequence]) -> np.ndarray:
    """``i32[S]`` of ``num_computed_tokens``: the positions of the next token of each sequence."""
    return np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int32, count=len(seqs))
