"""Powers of two: the one helper behind every padded shape (token buckets, kernel tiles, block sizes)."""

from __future__ import annotations


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two ``>= max(n, minimum)`` (``minimum`` itself a power of two)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def is_pow2(n: object) -> bool:
    """True for a positive ``int`` power of two (bools are not numbers here)."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and not n & (n - 1)
