"""KVTransfers: the copies between the device pool and the host tier (``EngineConfig.kv_offloading_size``).

The host tier's bookkeeping (``kv/host_tier.py``) decides which block goes where; this runs the
copies, in the order they were decided, before the engine's next step:

* offload: one jitted gather reads the blocks out of the pool (each block's K/V for every layer,
  ``pool[:, b]``, one contiguous array), then one batched ``jax.device_put`` moves them to host
  memory (``pinned_host``: page-locked, so the DMA engine copies at the link's speed, asynchronously);
* reload: one batched ``device_put`` brings the host arrays to the device, then one jitted update
  writes them into the pool, donated: in place, no copy of the pool.

Both are dispatched asynchronously, like the step: the host goes on scheduling while the copies run,
and the step that reads a reloaded block follows its update in the device's stream order (it takes
the updated pool). Copies of up to ``MAX_BLOCKS`` blocks share one executable per power-of-two size
(padded by repeating the last block: the same bytes written twice), compiled once (``warmup``): a
reload never recompiles the step or itself.

A host slot holds one block as its own array, replaced when the slot is reused (so host memory stays
within the tier's slots). With tensor parallelism
each device's shard of a block (its KV heads) goes to host memory and comes back to that device.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence as SequenceT

import jax
import jax.numpy as jnp
import numpy as np

from ..kv.host_tier import Transfer
from .step_inputs import bucket

MAX_BLOCKS = 128  # blocks per executable call (larger runs are split)


def host_memory_kind(device: jax.Device) -> str | None:
    """``"pinned_host"`` where the device has it (GPUs; the CPU backend too), else ``"unpinned_host"``,
    else ``None`` (the device's own memory)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def _gather(pool: jax.Array, block_ids: jax.Array) -> tuple[jax.Array, ...]:
    """``pool[:, b]`` for each ``b`` of ``block_ids`` (static length): one array per block."""
    return tuple(jax.lax.dynamic_index_in_dim(pool, block_ids[i], axis=1, keepdims=False)
                 for i in range(block_ids.shape[0]))


def _scatter(pool: jax.Array, blocks: tuple[jax.Array, ...], block_ids: jax.Array) -> jax.Array:
    """Writes ``blocks[i]`` into ``pool[:, block_ids[i]]``, in place (the pool is donated)."""
    for i, block in enumerate(blocks):
        pool = jax.lax.dynamic_update_index_in_dim(pool, block, block_ids[i], axis=1)
    return pool


class KVTransfers:
    """Runs ``Transfer`` lists against one pool; holds the host tier's arrays (one per used slot).

    Counters (``stats``): blocks and bytes copied each way, and seconds from dispatch until the copy was
    seen complete (polled at each ``run`` and ``stats``, so an upper bound of the copy's time).
    """

    def __init__(self, kv_pool: jax.Array, num_slots: int) -> None:
        self.num_slots = num_slots
        self.block_bytes = kv_pool.nbytes // kv_pool.shape[1]
        self.slots: list[jax.Array | None] = [None] * num_slots
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=0)
        self._host_sharding = None  # a block's sharding in host memory (made on the first offload)
        self._device_sharding = None  # ... and on the device
        self._compiled: dict[tuple[str, int], object] = {}
        self._pending: list[tuple[str, float, int, jax.Array]] = []  # (kind, dispatched at, bytes, last array)
        self.counts = {"offload": [0, 0, 0.0], "reload": [0, 0, 0.0]}  # blocks, bytes, seconds

    # ---- running ---------------------------------------------------------------------------------
    def run(self, kv_pool: jax.Array, transfers: SequenceT[Transfer]) -> jax.Array:
        """Dispatches ``transfers`` in order (consecutive ones of a kind batched); returns the pool."""
        self._poll()
        for kind, group in itertools.groupby(transfers, key=lambda t: t.kind):
            group = list(group)
            for start in range(0, len(group), MAX_BLOCKS):
                chunk = group[start:start + MAX_BLOCKS]
                if kind == "offload":
                    self._offload(kv_pool, chunk)
                else:
                    kv_pool = self._reload(kv_pool, chunk)
        return kv_pool

    def _executable(self, kind: str, kv_pool: jax.Array, n: int):
        """The gather or update for ``n`` blocks (a power of two), compiled on first use."""
        exe = self._compiled.get((kind, n))
        if exe is None:
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            if kind == "offload":
                exe = self._gather.lower(kv_pool, ids).compile()
            else:
                block = jax.ShapeDtypeStruct(kv_pool.shape[:1] + kv_pool.shape[2:], kv_pool.dtype,
                                             sharding=self._block_sharding(kv_pool))
                exe = self._scatter.lower(kv_pool, (block,) * n, ids).compile()
            self._compiled[(kind, n)] = exe
        return exe

    def _block_sharding(self, kv_pool: jax.Array):
        """One block's sharding on the device: the gather's output sharding (KV heads split as the pool's)."""
        if self._device_sharding is None:
            self._device_sharding = self._executable("offload", kv_pool, 1).output_shardings[0]
            kind = host_memory_kind(next(iter(self._device_sharding.device_set)))
            self._host_sharding = self._device_sharding.with_memory_kind(kind) if kind else self._device_sharding
        return self._device_sharding

    def _offload(self, kv_pool: jax.Array, chunk: list[Transfer]) -> None:
        n = len(chunk)
        size = bucket(n, 1)
        ids = np.array([t.block_id for t in chunk] + [chunk[-1].block_id] * (size - n), np.int32)
        self._block_sharding(kv_pool)
        blocks = self._executable("offload", kv_pool, size)(kv_pool, ids)[:n]
        host = jax.device_put(list(blocks), self._host_sharding)
        for t, array in zip(chunk, host):
            self.slots[t.slot] = array
        self._dispatched("offload", n, host[-1])

    def _reload(self, kv_pool: jax.Array, chunk: list[Transfer]) -> jax.Array:
        last = {t.block_id: t for t in chunk}  # a block written twice in one batch: the later copy wins
        chunk = list(last.values())
        n = len(chunk)
        size = bucket(n, 1)
        blocks = jax.device_put([self.slots[t.slot] for t in chunk], self._block_sharding(kv_pool))
        ids = np.array([t.block_id for t in chunk] + [chunk[-1].block_id] * (size - n), np.int32)
        blocks = tuple(blocks) + (blocks[-1],) * (size - n)
        exe = self._executable("reload", kv_pool, size)
        self._dispatched("reload", n, blocks[-1])  # (the host-to-device copy; the pool is donated on)
        return exe(kv_pool, blocks, ids)

    def warmup(self, kv_pool: jax.Array) -> None:
        """Compiles the gather and the update for every batch size (1, 2, 4, ... ``MAX_BLOCKS``)."""
        size = 1
        while size <= MAX_BLOCKS:
            self._executable("offload", kv_pool, size)
            self._executable("reload", kv_pool, size)
            size *= 2

    # ---- observability ---------------------------------------------------------------------------
    def _dispatched(self, kind: str, n: int, last: jax.Array) -> None:
        count = self.counts[kind]
        count[0] += n
        count[1] += n * self.block_bytes
        self._pending.append((kind, time.perf_counter(), n * self.block_bytes, last))

    def _poll(self) -> None:
        now, still = time.perf_counter(), []
        for kind, t0, nbytes, array in self._pending:
            if array.is_ready():
                self.counts[kind][2] += now - t0
            else:
                still.append((kind, t0, nbytes, array))
        self._pending = still

    def stats(self) -> dict:
        """Blocks, bytes and seconds of copies each way, and the effective bandwidth (GB/s)."""
        self._poll()
        out = {"host_block_bytes": self.block_bytes}
        for kind, (blocks, nbytes, seconds) in self.counts.items():
            out[f"{kind}_bytes"] = nbytes
            out[f"{kind}_seconds"] = seconds
            out[f"{kind}_gbps"] = nbytes / seconds / 1e9 if seconds else 0.0
        return out
