"""KVTransfers: the copies between the device pool and the host tier (``EngineConfig.kv_offloading_size``).

The host tier's bookkeeping (``kv/host_tier.py``) decides which block goes where; this runs the
copies, in the order they were decided, before the engine's next step:

* offload: one jitted gather copies the blocks out of the pool on the device (each block's K/V for
  every layer, ``pool[:, b]``, one contiguous array); after the engine has dispatched its next step,
  ``finish_offloads`` moves them to host memory (``pinned_host``: page-locked) with one batched
  ``jax.device_put``, on the runtime's own transfer stream. The step, which may overwrite the evicted
  blocks, waits for the gather only; the ``device_put`` (host time per block) runs while the device
  computes the step, not before it is launched, where a host-tier hit's TTFT would pay for it. Until
  then, staged blocks hold device memory (at most one step's evictions);
* reload: one jitted update takes the host arrays, brings them to the device and writes them into the
  pool, donated: in place, no copy of the pool. The step that reads them needs them anyway, so this
  copy is on its path: it is made inside the executable (XLA's host-memory transfers), faster than a
  ``device_put`` of the blocks and near one contiguous ``device_put`` (docs/DECISIONS.md).

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

import functools
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


def _scatter(pool: jax.Array, blocks: tuple[jax.Array, ...], block_ids: jax.Array,
             device_sharding) -> tuple[jax.Array, jax.Array]:
    """Brings ``blocks`` (host arrays) to the device and writes ``blocks[i]`` into ``pool[:, block_ids[i]]``,
    in place (the pool is donated). Also returns ``block_ids``: a small output that is ready when the
    copies are (the pool itself is donated on to the next step before anyone could wait on it)."""
    for i, block in enumerate(blocks):
        block = jax.device_put(block, device_sharding)
        pool = jax.lax.dynamic_update_index_in_dim(pool, block, block_ids[i], axis=1)
    return pool, block_ids + 0


class KVTransfers:
    """Runs ``Transfer`` lists against one pool; holds the host tier's arrays (one per used slot).

    Counters (``stats``): blocks and bytes copied each way; the copies' own bandwidth each way comes from
    ``measure`` (timed alone at warm-up: in a serving loop a copy's end is only seen when the engine next
    looks, which times the waiting, not the copy).
    """

    def __init__(self, kv_pool: jax.Array, num_slots: int, reserve: bool | None = None) -> None:
        """``reserve``: claim the tier's host memory now (default: on a GPU; see ``reserve_host_memory``)."""
        self.num_slots = num_slots
        self.block_bytes = kv_pool.nbytes // kv_pool.shape[1]
        self.slots: list[jax.Array | None] = [None] * num_slots
        self._gather = self._scatter = None  # jitted once the block's shardings are known
        self._host_sharding = None  # a block's sharding in host memory (made on the first offload)
        self._device_sharding = None  # ... and on the device
        self._compiled: dict[tuple[str, int], object] = {}
        self._staged: list[tuple[list[Transfer], tuple[jax.Array, ...]]] = []  # gathered, not yet sent to host
        self._staged_slots: set[int] = set()
        self.blocks_copied = {"offload": 0, "reload": 0}
        self.measured: dict[str, tuple[float, float]] = {}  # kind -> (fixed seconds, seconds per block)
        self.reserve_seconds = 0.0
        if reserve if reserve is not None else jax.default_backend() == "gpu":
            self.reserve_host_memory(kv_pool)

    def reserve_host_memory(self, kv_pool: jax.Array, chunk_bytes: int = 1 << 30) -> None:
        """Allocates the tier's pinned host memory once, in 1 GiB pieces, and frees it: the runtime's
        host allocator keeps it for the blocks to come. Why: page-locking memory is slow, and a tier that
        grew while serving stalled the requests waiting on its first offloads."""
        t0 = time.perf_counter()
        self._shardings(kv_pool)
        total = self.num_slots * self.block_bytes // max(1, len(self._device_sharding.device_set))
        for device in self._device_sharding.device_set:
            host = jax.sharding.SingleDeviceSharding(device, memory_kind=self._host_sharding.memory_kind)
            zeros = jnp.zeros((min(total, chunk_bytes),), jnp.uint8, device=device)
            pieces = [jax.device_put(zeros, host) for _ in range(-(-total // chunk_bytes))]
            jax.block_until_ready(pieces)
            del pieces, zeros
        self.reserve_seconds = time.perf_counter() - t0

    # ---- running ---------------------------------------------------------------------------------
    def run(self, kv_pool: jax.Array, transfers: SequenceT[Transfer]) -> jax.Array:
        """Dispatches ``transfers`` in order (consecutive ones of a kind batched); returns the pool. The
        offloads' copies to the host follow in ``finish_offloads`` (call it after the next step's launch)."""
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
            self._shardings(kv_pool)
            ids = jax.ShapeDtypeStruct((n,), jnp.int32)
            if kind == "offload":
                exe = self._gather.lower(kv_pool, ids).compile()
            else:
                block = jax.ShapeDtypeStruct(kv_pool.shape[:1] + kv_pool.shape[2:], kv_pool.dtype,
                                             sharding=self._host_sharding)
                exe = self._scatter.lower(kv_pool, (block,) * n, ids).compile()
            self._compiled[(kind, n)] = exe
        return exe

    def _shardings(self, kv_pool: jax.Array) -> None:
        """A block's sharding on the device (the output sharding of a gather on the device: KV heads
        split as the pool's) and in host memory; then the jitted gather and update that use them."""
        if self._device_sharding is not None:
            return
        ids = jax.ShapeDtypeStruct((1,), jnp.int32)
        device = jax.jit(_gather).lower(kv_pool, ids).compile().output_shardings[0]
        kind = host_memory_kind(next(iter(device.device_set)))
        self._device_sharding = device
        self._host_sharding = device.with_memory_kind(kind) if kind else device
        self._gather = jax.jit(_gather, out_shardings=device)
        self._scatter = jax.jit(functools.partial(_scatter, device_sharding=device), donate_argnums=0)

    def _offload(self, kv_pool: jax.Array, chunk: list[Transfer]) -> None:
        """Gathers the blocks on the device; ``finish_offloads`` sends them to the host."""
        n = len(chunk)
        size = bucket(n, 1)
        ids = np.array([t.block_id for t in chunk] + [chunk[-1].block_id] * (size - n), np.int32)
        self._staged.append((chunk, self._executable("offload", kv_pool, size)(kv_pool, ids)[:n]))
        self._staged_slots.update(t.slot for t in chunk)

    def finish_offloads(self) -> None:
        """Moves the gathered blocks to host memory (one batched ``device_put``), into their slots."""
        if not self._staged:
            return
        chunks = [t for chunk, _ in self._staged for t in chunk]
        blocks = [b for _, staged in self._staged for b in staged]
        self._staged, self._staged_slots = [], set()
        host = jax.device_put(blocks, self._host_sharding)
        for t, array in zip(chunks, host):  # (in order: a slot given twice keeps the later block)
            self.slots[t.slot] = array
        self._dispatched("offload", len(chunks))

    def _reload(self, kv_pool: jax.Array, chunk: list[Transfer]) -> jax.Array:
        if self._staged_slots.intersection(t.slot for t in chunk):  # offloaded in this very pass
            self.finish_offloads()
        last = {t.block_id: t for t in chunk}  # a block written twice in one batch: the later copy wins
        chunk = list(last.values())
        n = len(chunk)
        size = bucket(n, 1)
        blocks = [self.slots[t.slot] for t in chunk]
        ids = np.array([t.block_id for t in chunk] + [chunk[-1].block_id] * (size - n), np.int32)
        blocks = tuple(blocks) + (blocks[-1],) * (size - n)
        exe = self._executable("reload", kv_pool, size)
        kv_pool, _ = exe(kv_pool, blocks, ids)
        self._dispatched("reload", n)
        return kv_pool

    def warmup(self, kv_pool: jax.Array) -> None:
        """Compiles the gather and the update for every batch size (1, 2, 4, ... ``MAX_BLOCKS``)."""
        size = 1
        while size <= MAX_BLOCKS:
            self._executable("offload", kv_pool, size)
            self._executable("reload", kv_pool, size)
            size *= 2

    def measure(self, kv_pool: jax.Array, repeats: int = 3) -> jax.Array:
        """Times each way alone, 1 and ``MAX_BLOCKS`` blocks (medians of ``repeats``), into ``measured``:
        ``(fixed seconds, seconds per block)``. Run it at warm-up, before any block is cached: the reloads
        write blocks ``0 .. MAX_BLOCKS - 1`` of the pool (unused then; blocks are never read unwritten).
        Returns the pool (donated through the reloads)."""
        def timed(fn) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        self._shardings(kv_pool)
        n_max = min(MAX_BLOCKS, kv_pool.shape[1])
        block = jax.device_put(jnp.zeros(kv_pool.shape[:1] + kv_pool.shape[2:], kv_pool.dtype), self._host_sharding)
        pool = [kv_pool]
        for kind in ("offload", "reload"):
            seconds = []
            for n in (1, n_max):
                ids = np.arange(n, dtype=np.int32)
                exe = self._executable(kind, kv_pool, n if n == 1 else bucket(n, 1))
                ids = np.resize(ids, bucket(n, 1))
                if kind == "offload":
                    seconds.append(timed(lambda: jax.device_put(exe(pool[0], ids), self._host_sharding)))
                else:
                    def reload():
                        pool[0], done = exe(pool[0], (block,) * len(ids), ids)
                        return done
                    seconds.append(timed(reload))
            per_block = max(seconds[1] - seconds[0], 0.0) / max(n_max - 1, 1)
            self.measured[kind] = (max(seconds[0] - per_block, 0.0), per_block)
        return pool[0]

    # ---- observability ---------------------------------------------------------------------------
    def _dispatched(self, kind: str, n: int) -> None:
        self.blocks_copied[kind] += n

    def stats(self) -> dict:
        """Blocks and bytes copied each way, and each way's bandwidth measured at warm-up (GB/s; 0 if not
        measured)."""
        out = {"host_block_bytes": self.block_bytes, "host_reserve_seconds": self.reserve_seconds}
        for kind, blocks in self.blocks_copied.items():
            out[f"{kind}_blocks"] = blocks
            out[f"{kind}_bytes"] = blocks * self.block_bytes
            per_block = self.measured.get(kind, (0.0, 0.0))[1]
            out[f"{kind}_gbps"] = self.block_bytes / per_block / 1e9 if per_block else 0.0
        return out
