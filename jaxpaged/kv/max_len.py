"""The ``max_len`` reservation policy: a contiguous KV cache emulated on the paged pool.

One of the two ``ReservationPolicy`` implementations (``kv/reservation.py`` has the protocol and the
``paged`` one).

Before PagedAttention, servers reserved one contiguous region of ``max_model_len`` token slots per
request at admission. ``ContiguousReserver`` reproduces that on the same pool of blocks (same kernel,
same model; only the allocator differs), so the memory experiments compare like with like:

* internal fragmentation: the reserved run is mostly empty (low block utilisation);
* external fragmentation: a request is refused when no contiguous run of free blocks is long enough,
  even though enough blocks are free in total (``is_fragmentation``).

First fit over a numpy occupancy mask: O(num_blocks) vectorised per admission, O(run) per release.
"""

from __future__ import annotations

import math

import numpy as np

from jaxpaged.config import check_block_size
from jaxpaged.kv.errors import BlockStateError, DoubleFreeError, OutOfBlocksError, RequestTooLargeError
from jaxpaged.kv.stats import KVCounters
from jaxpaged.request import Sequence


def max_len_run_length(max_model_len: int, block_size: int) -> int:
    """Blocks one request reserves under ``max_len``: ``ceil(max_model_len / block_size)``."""
    if max_model_len is None or max_model_len <= 0:
        raise ValueError(f"reservation='max_len' needs a positive max_model_len, got {max_model_len!r}")
    return math.ceil(max_model_len / check_block_size(block_size))


class ContiguousReserver:
    """First-fit allocator of contiguous runs of blocks; no sharing, no caching."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._used = np.zeros(num_blocks, dtype=bool)
        self._num_used = 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._num_used

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    def is_used(self, block_id: int) -> bool:
        return bool(self._used[block_id])

    def free_runs(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every maximal run of free blocks, in block order."""
        free = np.concatenate(([0], (~self._used).view(np.int8), [0]))
        edges = np.flatnonzero(np.diff(free))
        starts, ends = edges[0::2], edges[1::2]
        return [(int(s), int(e - s)) for s, e in zip(starts, ends)]

    def largest_free_run(self) -> int:
        runs = self.free_runs()
        return max((length for _, length in runs), default=0)

    def find_run(self, n: int) -> int | None:
        """Start of the first free run of at least ``n`` blocks, or ``None``."""
        if n <= 0:
            raise ValueError(f"run length must be positive, got {n}")
        if n > self.num_free_blocks:
            return None
        free = np.concatenate(([0], (~self._used).view(np.int8), [0]))
        edges = np.flatnonzero(np.diff(free))
        starts, ends = edges[0::2], edges[1::2]
        fits = np.flatnonzero(ends - starts >= n)
        return int(starts[fits[0]]) if fits.size else None

    def is_fragmentation(self, n: int) -> bool:
        """True if ``n`` blocks are free in total but no contiguous run of ``n`` is."""
        return n <= self.num_free_blocks and self.find_run(n) is None

    def reserve(self, n: int) -> list[int] | None:
        """Reserves the first free run of ``n`` blocks and returns its ids, or ``None``."""
        start = self.find_run(n)
        if start is None:
            return None
        self._used[start : start + n] = True
        self._num_used += n
        return list(range(start, start + n))

    def release(self, block_ids: list[int]) -> None:
        """Returns a reserved run to the pool; releasing a block that is not reserved is an error."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            return
        if not self._used[ids].all():
            bad = [int(b) for b in ids[~self._used[ids]]]
            raise DoubleFreeError(f"blocks {bad} released but not reserved")
        self._used[ids] = False
        self._num_used -= int(ids.size)


class MaxLenReservation:
    """The ``max_len`` policy: at admission, reserve one contiguous run of blocks for everything the
    request may ever hold; refusals are counted in ``KVCounters`` (and as fragmentation when enough
    blocks were free in total). Blocks are never shared, so there is no prefix caching.

    With one run length for everyone and first fit, runs start at multiples of it, so free space
    always splits into whole runs and refusals are plain capacity refusals. ``per_request=True``
    reserves each request's own maximum length (prompt + ``sampling_params.max_tokens``, capped at
    ``max_model_len``), as Orca-era servers did; varying run lengths then fragment the pool.
    """

    name = "max_len"
    trie = None
    allocator = None
    num_cached_blocks = 0
    num_shared_references = 0

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, per_request: bool,
        counters: KVCounters,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.run_length = max_len_run_length(max_model_len, block_size)
        if self.run_length > num_blocks:
            raise ValueError(
                f"max_model_len={max_model_len} needs {self.run_length} blocks of {block_size} "
                f"tokens per request, more than the pool's {num_blocks}"
            )
        self.pool = ContiguousReserver(num_blocks)
        self.per_request = per_request
        self.counters = counters

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def run_length_for(self, seq: Sequence) -> int:
        """Blocks ``seq`` reserves."""
        max_tokens = getattr(seq.sampling_params, "max_tokens", None)
        if not self.per_request or max_tokens is None:
            return self.run_length
        longest = min(self.max_model_len, max(seq.num_tokens, seq.num_prompt_tokens + max_tokens))
        return -(-longest // self.block_size)

    def _refused(self, run: int) -> None:
        self.counters.max_len_admission_failures += 1
        if run <= self.pool.num_free_blocks:
            self.counters.max_len_fragmentation_failures += 1

    # ---- the ReservationPolicy protocol ----------------------------------------------------------
    def prefix_hit_blocks(self, seq: Sequence) -> int:
        return 0

    def can_admit(self, seq: Sequence) -> bool:
        run = self.run_length_for(seq)
        if self.pool.find_run(run) is None:
            self._refused(run)
            return False
        return True

    def admit(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """No hits; the reserved run's block ids. ``OutOfBlocksError`` (counted) if no run is free."""
        run = self.run_length_for(seq)
        blocks = self.pool.reserve(run)
        if blocks is None:
            self._refused(run)
            raise OutOfBlocksError(
                f"request {seq.request_id!r}: no contiguous run of {run} free blocks "
                f"({self.pool.num_free_blocks} free, largest run {self.pool.largest_free_run()})"
            )
        return [], blocks

    def can_grow(self, seq: Sequence, num_blocks: int, missing: int) -> bool:
        """A reservation never grows: needing more than it is a request that can never fit."""
        raise RequestTooLargeError(
            f"request {seq.request_id!r} needs {(num_blocks + missing) * self.block_size} token slots, "
            f"more than its max_len reservation of {num_blocks * self.block_size}"
        )

    grow = can_grow

    def has_new_full_blocks(self, seq: Sequence) -> bool:
        return False

    def cache_full_blocks(self, seq: Sequence, block_table: list[int]) -> list[int]:
        return []

    def release(self, seq: Sequence, block_table: list[int]) -> None:
        self.pool.release(block_table)

    def check(self, holders: list[int]) -> None:
        """Invariant: a block is reserved exactly when one block table holds it."""
        used = self.pool.is_used
        bad = [b for b in range(self.num_blocks) if used(b) != (holders[b] == 1) or holders[b] > 1]
        if bad:
            raise BlockStateError(f"reserved blocks disagree with block tables at {bad[:10]}")
