"""Shape helpers: powers of two (token buckets, kernel tiles, block sizes), and the device facts kernels
are chosen and sized by (its core count, its compute capability)."""

from __future__ import annotations


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two ``>= max(n, minimum)`` (``minimum`` itself a power of two)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def is_pow2(n: object) -> bool:
    """True for a positive ``int`` power of two (bools are not numbers here)."""
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and not n & (n - 1)


DEFAULT_NUM_CORES = 132  # a Hopper GPU's SMs: used where the device does not say (a CPU in interpret mode)


def num_cores() -> int:
    """Streaming multiprocessors of this process's first device (``Device.core_count``), which kernels
    size their grids for; ``DEFAULT_NUM_CORES`` where the device does not say."""
    import jax

    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_NUM_CORES


def compute_capability(device=None) -> tuple[int, int] | None:
    """``(major, minor)`` of ``device`` (default: this process's first), from ``Device.compute_capability``;
    ``None`` where the device does not say (a CPU)."""
    import jax

    cc = getattr(jax.devices()[0] if device is None else device, "compute_capability", None)
    return None if cc is None else tuple(int(part) for part in str(cc).split(".")[:2])
