"""The KV memory invariants, recomputed from scratch (for property tests and debugging).

Table-level, checked here:
* each admitted request owns one row of the ``BlockTables`` matrix, no row is shared, and every
  entry past a row's length is 0; the rows' lengths as Python ints equal the numpy ones;
* no block table holds a block twice.

Policy-level, checked by the policy against the number of tables holding each block
(``ReservationPolicy.check``):
* ``paged``: every block is exactly one of free, referenced, cached-unreferenced (LRU pool); a
  block's ref count equals its holders; a block is flagged cached exactly when the trie holds it;
* ``max_len``: a block is reserved exactly when one block table holds it.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from jaxpaged.kv.block_tables import BlockTables
from jaxpaged.kv.errors import BlockStateError
from jaxpaged.kv.reservation import ReservationPolicy
from jaxpaged.request import Sequence


def check_invariants(tables: BlockTables, seqs: Iterable[Sequence], policy: ReservationPolicy) -> None:
    """Raises ``BlockStateError`` naming the first block (or request) that breaks an invariant."""
    holders = [0] * policy.num_blocks
    held = np.zeros(tables.table.shape, dtype=bool)
    rows: set[int] = set()
    for seq in seqs:
        row = seq.block_table_row
        if row < 0 or row in rows:
            raise BlockStateError(f"request {seq.request_id!r}: block-table row {row} missing or shared")
        rows.add(row)
        blocks = tables.blocks(row)
        if len(set(blocks)) != len(blocks):
            raise BlockStateError(f"request {seq.request_id!r} holds a block twice")
        held[row, : len(blocks)] = True
        for block_id in blocks:
            holders[block_id] += 1
    if tables.table[~held].any():
        raise BlockStateError("block tables: an entry past a row's length is not 0")
    if tables.row_lengths != tables.lengths.tolist():
        raise BlockStateError("block tables: the Python row lengths differ from the numpy lengths")
    if len(rows) != tables.rows_in_use:
        raise BlockStateError(f"block tables: {tables.rows_in_use} rows in use, {len(rows)} requests admitted")
    policy.check(holders)
