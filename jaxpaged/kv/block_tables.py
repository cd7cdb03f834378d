"""``BlockTables``: the block table of every admitted request, as one ``i32[rows, width]`` matrix.

The block table of a request maps its logical block ``j`` (tokens ``j*bs .. (j+1)*bs - 1``) to the
physical block ``table[row, j]`` of the KV pool. This matrix is the only copy: the ``KVCacheManager``
owns it and is the only writer; a ``Sequence`` keeps just its row number (``block_table_row``), as a
request in vLLM's worker keeps its row of the worker's block table.

Building a step's ``block_tables i32[S, W]`` is then one numpy gather of rows, whatever the batch.
Entries past a row's length are always 0 (a valid block id: kernels never read past ``kv_lens``).
Rows and width double when they run out.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    """Row-per-request block-table matrix with per-row lengths."""

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int32)
        # ``lengths`` as Python ints, kept equal to it: per-row reads in the scheduler's hot loops
        # (``KVCacheManager.has_room``) without a numpy scalar each; numpy for vectorised gathers.
        self.row_lengths: list[int] = [0] * rows
        self._free_rows = list(range(rows - 1, -1, -1))  # pop() hands out low rows first

    @property
    def width(self) -> int:
        return self.table.shape[1]

    @property
    def rows_in_use(self) -> int:
        return self.table.shape[0] - len(self._free_rows)

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.table.shape
        rows, width = max(rows, old_rows), max(width, old_width)
        table = np.zeros((rows, width), dtype=np.int32)
        table[:old_rows, :old_width] = self.table
        lengths = np.zeros(rows, dtype=np.int32)
        lengths[:old_rows] = self.lengths
        self.table, self.lengths = table, lengths
        self.row_lengths.extend([0] * (rows - old_rows))
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)  # new rows after old ones

    # ---- writes (the KV manager's) ---------------------------------------------------------------
    def add(self, block_ids: list[int]) -> int:
        """Takes a free row, fills it with ``block_ids`` and returns its index."""
        if not self._free_rows:
            self._grow(2 * self.table.shape[0], self.width)
        row = self._free_rows.pop()
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        """Appends ``block_ids`` to ``row``'s table."""
        start = self.row_lengths[row]
        end = start + len(block_ids)
        if end > self.width:
            self._grow(self.table.shape[0], max(2 * self.width, end))
        self.table[row, start:end] = block_ids
        self.lengths[row] = end
        self.row_lengths[row] = end

    def remove(self, row: int) -> list[int]:
        """Zeroes ``row``, returns it to the pool of rows and returns the block ids it held."""
        n = self.row_lengths[row]
        blocks = self.table[row, :n].tolist()
        self.table[row, :n] = 0
        self.lengths[row] = 0
        self.row_lengths[row] = 0
        self._free_rows.append(row)
        return blocks

    # ---- reads -----------------------------------------------------------------------------------
    def num_blocks(self, row: int) -> int:
        return self.row_lengths[row]

    def blocks(self, row: int) -> list[int]:
        """``row``'s block table as a list (a copy)."""
        return self.table[row, : self.lengths[row]].tolist()

    def gather_into(self, rows: np.ndarray, out: np.ndarray, lengths: np.ndarray | None = None) -> None:
        """Writes the given rows, cut or zero-padded to ``out``'s width, into ``out i32[len(rows), W]``
        (a step's block-table view; no intermediate copy). ``lengths``: ``self.lengths[rows]`` if the
        caller has it. Raises ``ValueError`` if a row holds more than ``W`` blocks."""
        width = out.shape[1]
        lengths = self.lengths[rows] if lengths is None else lengths
        if rows.size and int(lengths.max()) > width:
            i = int(lengths.argmax())
            raise ValueError(f"row {int(rows[i])} has {int(lengths[i])} blocks, more than width={width}")
        if width <= self.width:
            np.take(self.table[:, :width], rows, axis=0, out=out)
        else:
            out[:, : self.width] = self.table[rows]
            out[:, self.width:] = 0
