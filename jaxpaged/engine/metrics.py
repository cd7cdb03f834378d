"""Per-step engine metrics: what each step computed and how full the KV pool was.

The memory manager's own counters live in ``jaxpaged.kv.stats``; this module records the time series a
user plots (blocks in use, KV bytes, batch composition per step) and summarises throughput.
"""

from __future__ import annotations

import dataclasses


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` by nearest rank (an observed value); None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step: batch composition, pool occupancy after the step, wall time."""

    step: int
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padded_tokens: int  # tokens the device computed, padding included
    blocks_used: int
    blocks_cached: int
    kv_bytes_in_use: int
    block_utilisation: float
    seconds: float


class EngineMetrics:
    """Keeps the step records (optionally bounded) and running totals."""

    def __init__(self, keep_steps: int | None = 100_000):
        self.records: list[StepRecord] = []
        self.keep_steps = keep_steps
        self.total_seconds = 0.0
        self.total_steps = 0
        self.host_seconds = 0.0  # scheduling, input building, booking and resolving steps
        self.device_seconds = 0.0  # from launching the step until its tokens are on the host

    def record(self, rec: StepRecord) -> None:
        self.total_steps += 1
        self.total_seconds += rec.seconds
        if self.keep_steps is None or len(self.records) < self.keep_steps:
            self.records.append(rec)

    def as_columns(self) -> dict[str, list]:
        """Step records as columns (ready for a DataFrame or a plot)."""
        fields = [f.name for f in dataclasses.fields(StepRecord)]
        return {name: [getattr(r, name) for r in self.records] for name in fields}
