"""How many KV blocks an engine's pool gets: ``num_blocks`` if given, else a share of the device's free
memory (GPU) or of the host's available memory (CPU), and the check that one full-length request fits."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from ..config import EngineConfig
from ..models.checkpoint import ModelParams
from ..kernels.fp8 import scale_rows
from ..kernels.kv_write import I32_OFFSET_ELEMENTS, I64_OFFSET_BYTES
from ..models.sharding import kv_bytes_per_token_per_device


CPU_POOL_FRACTION = 0.25  # of the host memory available when the engine starts
CPU_POOL_CAP_BYTES = 4 << 30  # never more than this on a CPU without num_blocks
# A GPU pool holds at most this many times what max_num_seqs sequences of max_model_len tokens need:
# room for every running sequence and for the prefix cache, while a small model on a large GPU does not
# take (and initialise, and make XLA plan around) a pool of millions of blocks it can never use.
GPU_POOL_CAP_SEQUENCES = 4


def available_host_memory() -> int | None:
    """Bytes of host memory available now (``MemAvailable`` on Linux), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_device_memory(device) -> int | None:
    """Bytes the engine may still take on ``device`` (XLA's allocator limit minus what it holds), or
    ``None`` where the device keeps no such statistics (a CPU)."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return None


def size_pool(params: ModelParams, config: EngineConfig, max_model_len: int, dtype: str) -> int:
    """Blocks in the pool: ``num_blocks`` if given; on a GPU ``memory_fraction`` of the free device
    memory (with tensor parallelism: of the device with the least free memory, per device's share of a
    block), at most ``GPU_POOL_CAP_SEQUENCES`` times what ``max_num_seqs`` full-length sequences need;
    on a CPU ``CPU_POOL_FRACTION`` of the available host memory, at most ``CPU_POOL_CAP_BYTES``
    and at most what ``min(max_num_seqs, 16)`` full-length sequences need. A one-byte (fp8) pool of
    2-4 GiB a device is moved out of that range (:func:`addressable_blocks`); a ``num_blocks`` in it is an
    error."""
    bs = config.resolved_block_size(params.config.head_dim)
    itemsize = jnp.dtype(dtype).itemsize
    block_bytes = kv_bytes_per_token_per_device(params, itemsize) * (bs + scale_rows(dtype))
    if config.num_blocks is not None:
        lo, hi = addressable_block_range(block_bytes, itemsize)
        if lo < config.num_blocks < hi:
            raise ValueError(
                f"num_blocks={config.num_blocks} gives a {dtype} pool of "
                f"{config.num_blocks * block_bytes / 2**30:.2f} GiB per device, which the GPU kernels cannot "
                f"address (32-bit offsets between 2 and 4 GiB of one-byte elements): use num_blocks <= {lo} "
                f"or >= {hi}")
        return config.num_blocks
    devices = [jax.devices()[0]] if params.mesh is None else \
        [d for d in params.mesh.devices.flat if d.process_index == jax.process_index()]
    frees = [free_device_memory(d) for d in devices]
    blocks_per_seq = math.ceil(max_model_len / bs)
    if all(f is not None for f in frees):
        by_memory = int(min(frees) * config.memory_fraction // block_bytes)
        return addressable_blocks(min(by_memory, GPU_POOL_CAP_SEQUENCES * config.max_num_seqs * blocks_per_seq),
                                  by_memory, block_bytes, itemsize)
    enough = blocks_per_seq * min(config.max_num_seqs, 16)
    host = available_host_memory()
    budget = CPU_POOL_CAP_BYTES if host is None else min(int(host * CPU_POOL_FRACTION), CPU_POOL_CAP_BYTES)
    by_memory = budget // block_bytes
    return max(1, addressable_blocks(min(enough, by_memory), by_memory, block_bytes, itemsize))


def addressable_block_range(block_bytes: int, itemsize: int) -> tuple[int, int]:
    """``(lo, hi)``: block counts strictly between them make a pool the GPU kernels cannot address
    (one-byte elements, more than 2**31 of them, at most 2**32 bytes: ``kv_write.pallas_addressable``);
    none for wider elements."""
    if itemsize != 1:
        return 0, 1
    return I32_OFFSET_ELEMENTS // block_bytes, I64_OFFSET_BYTES // block_bytes + 1


def addressable_blocks(wanted: int, most: int, block_bytes: int, itemsize: int) -> int:
    """``wanted`` blocks, moved out of the unaddressable range: up past 4 GiB where ``most`` (what the
    memory allows) permits, else down to 2**31 elements."""
    lo, hi = addressable_block_range(block_bytes, itemsize)
    if not lo < wanted < hi:
        return wanted
    return hi if hi <= most else lo


def check_pool(num_blocks: int, bs: int, max_model_len: int) -> None:
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens: raise num_blocks / memory_fraction or "
            f"lower max_model_len")
