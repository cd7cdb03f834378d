"""``BlockTableRows``: a persistent ``i32[rows, width]`` numpy mirror of the admitted sequences'
block tables, so building a step's ``block_tables`` array is one gather instead of per-sequence work.

Each admitted ``Sequence`` owns one row while it holds blocks (as in vLLM's worker-side block
table). ``KVCacheManager`` writes only the entries that change: the whole table at admission, new
blocks when a table grows, and zeroes the row on free, so unused entries are always 0 (the padding
``block_tables`` promises). Rows and width double when they run out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxpaged.sequence import Sequence


class BlockTableRows:
    """Row-per-sequence block-table matrix, kept in sync incrementally by the KV manager."""

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))  # pop() hands out low rows first

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        new = np.zeros((max(rows, old_rows), max(width, old_width)), dtype=np.int32)
        new[:old_rows, :old_width] = self.table
        self.table = new
        self._free_rows[:0] = range(new.shape[0] - 1, old_rows - 1, -1)  # new rows after old ones

    def attach(self, seq: Sequence) -> None:
        """Gives ``seq`` a row and copies its whole block table into it."""
        if not self._free_rows:
            self._grow(2 * self.table.shape[0], self.width)
        seq._bt_rows, seq._bt_row, seq._bt_synced = self, self._free_rows.pop(), 0
        self.sync(seq)

    def sync(self, seq: Sequence) -> None:
        """Copies the entries appended to ``seq.block_table`` since the last sync."""
        start, n = seq._bt_synced, len(seq.block_table)
        if n > self.width:
            self._grow(self.table.shape[0], max(2 * self.width, n))
        if n > start:
            self.table[seq._bt_row, start:n] = seq.block_table[start:n]
        seq._bt_synced = n

    def detach(self, seq: Sequence) -> None:
        """Zeroes ``seq``'s row and returns it to the pool of rows."""
        row = seq._bt_row
        self.table[row, : seq._bt_synced] = 0
        self._free_rows.append(row)
        seq._bt_rows, seq._bt_row, seq._bt_synced = None, -1, 0
