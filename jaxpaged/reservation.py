"""The ``max_len`` reservation policy: a contiguous KV cache emulated on the paged pool.

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

from jaxpaged.block_allocator import DoubleFreeError, check_block_size


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
