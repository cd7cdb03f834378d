"""Short full garbage collections: the long-lived heap (weights, compiled steps, JAX's caches) moved out of the
cyclic garbage collector's reach once the engine is warmed up.

Why: Python's full (generation-2) collection walks every tracked object. After compiling the steps the
process holds hundreds of thousands of them, and the requests' allocations trigger a full collection
sooner or later, which stops the engine for most of a second in the middle of a workload.
``gc.freeze()`` (vLLM does the same after start-up) moves every object alive now to a permanent
generation the collector skips, so that collection takes milliseconds.

The cost: a frozen object that later becomes cyclic garbage is never collected (objects freed by their
reference count, like a dropped engine and its KV pool, still are). So it runs once, after the warm-up
the caller asked for, not after every compilation; ``gc.unfreeze()`` undoes it.
"""

from __future__ import annotations

import gc


def freeze_long_lived_heap() -> int:
    """Collects what is garbage now, then freezes everything left; returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
