"""How many KV blocks an engine's pool gets: ``num_blocks`` if given, else a share of the device's free
memory (GPU) or of the host's available memory (CPU), and the check that one full-length request fits."""

from __future__ import annotations

import ctypes
import math
import os

import jax
import jax.numpy as jnp

from .config import EngineConfig
from .models.checkpoint import ModelParams
from .sharding import kv_bytes_per_token_per_device


CPU_POOL_FRACTION = 0.25  # of the host memory available when the engine starts
CPU_POOL_CAP_BYTES = 4 << 30  # never more than this on a CPU without num_blocks


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


BFC_MEMORY_FRACTION = 0.75  # XLA's default share of a GPU for its BFC allocator (XLA_PYTHON_CLIENT_MEM_FRACTION)


def cuda_mem_info(ordinal: int) -> tuple[int, int] | None:
    """``(free, total)`` bytes of CUDA device ``ordinal`` from the driver (``cuMemGetInfo`` in the primary
    context, which XLA shares), or ``None`` where there is no CUDA driver."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        for name in ("cuMemGetInfo_v2", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRelease_v2"):
            getattr(cu, name)  # a driver older than CUDA 11 lacks them
    except (OSError, AttributeError):
        return None
    dev, ctx, popped = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cu.cuInit(0) or cu.cuDeviceGet(ctypes.byref(dev), ordinal) \
            or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        return None
    try:
        if cu.cuCtxPushCurrent_v2(ctx):
            return None
        try:
            if cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
                return None
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(popped))
    finally:
        cu.cuDevicePrimaryCtxRelease_v2(dev)
    return free.value, total.value


def free_device_memory(device, mem_info=cuda_mem_info) -> int | None:
    """Bytes the engine may still take on ``device``, or ``None`` where that is unknown (a CPU).

    With XLA's BFC allocator: its limit minus what it holds. With the VMM allocator (``xla_env``'s
    SKIP_TEMP setting: no ``memory_stats``) the driver's free memory less the share of the device BFC
    would have left outside its limit (``bfc_memory_fraction``, default 0.75), so a pool
    sized from it leaves the same room for the steps' temporaries under either allocator."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if device.platform != "gpu":
        return None
    info = mem_info(device.local_hardware_id)
    if info is None:
        return None
    free, total = info
    return max(0, free - int(total * (1 - bfc_memory_fraction())))


def bfc_memory_fraction() -> float:
    """The device share XLA's BFC allocator takes: ``XLA_CLIENT_MEM_FRACTION`` or its older name
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (unset, empty or not a number: 0.75)."""
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return min(max(float(value), 0.0), 1.0)
            except ValueError:
                pass
    return BFC_MEMORY_FRACTION


def size_pool(params: ModelParams, config: EngineConfig, max_model_len: int, dtype: str) -> int:
    """Blocks in the pool: ``num_blocks`` if given; on a GPU ``memory_fraction`` of the free device
    memory (with tensor parallelism: of the device with the least free memory, per device's share of a
    block); on a CPU ``CPU_POOL_FRACTION`` of the available host memory, at most ``CPU_POOL_CAP_BYTES``
    and at most what ``min(max_num_seqs, 16)`` full-length sequences need."""
    bs = config.block_size
    block_bytes = kv_bytes_per_token_per_device(params, jnp.dtype(dtype).itemsize) * bs
    if config.num_blocks is not None:
        return config.num_blocks
    devices = [jax.devices()[0]] if params.mesh is None else \
        [d for d in params.mesh.devices.flat if d.process_index == jax.process_index()]
    frees = [free_device_memory(d) for d in devices]
    if all(f is not None for f in frees):
        return int(min(frees) * config.memory_fraction // block_bytes)
    enough = math.ceil(max_model_len / bs) * min(config.max_num_seqs, 16)
    host = available_host_memory()
    budget = CPU_POOL_CAP_BYTES if host is None else min(int(host * CPU_POOL_FRACTION), CPU_POOL_CAP_BYTES)
    return max(1, min(enough, budget // block_bytes))


def check_pool(num_blocks: int, bs: int, max_model_len: int) -> None:
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens: raise num_blocks / memory_fraction or "
            f"lower max_model_len")
