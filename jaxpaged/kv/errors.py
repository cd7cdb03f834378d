"""The KV memory errors: what can go wrong with blocks, and with a request that can never fit."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free plus evictable (nothing was changed)."""


class BlockStateError(RuntimeError):
    """An operation does not fit a block's state (a bug in the caller)."""


class DoubleFreeError(BlockStateError):
    """A block (or a request's blocks) was released more often than it was taken."""


class RequestTooLargeError(ValueError):
    """A request that can never be scheduled: more blocks than the pool, or past ``max_model_len``."""
