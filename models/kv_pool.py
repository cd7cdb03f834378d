"""The KV pool, every fact about it in one place: its layout and shape, the bytes a token and a block take,
which dtypes the device holds, how many blocks an engine gets, and making it (on one device, or split
over KV heads on a mesh).

Layout (the whole model, one array): ``kv_pool [L, num_blocks, block_size, 2, Hkv, D]``; index
``[layer, block, offset, 0]`` holds a token's keys and ``[..., 1]`` its values, so one token's K and V
of one layer are one contiguous row and a layer's write is a single scatter (``kernels/kv_write.py``).
Slot ``s`` is ``block_id * block_size + offset``. An fp8 pool adds a scale row to each block
(``block_size + 1`` rows) and stores values transposed within each (block, head) slab
(``kernels/fp8.py``). The kernels read the layer they need from the same array by a static index (no
slice, no copy).

Why one array for every layer: a jitted call costs the host a fixed time per donated array, so per-layer
K and V arrays would make every step pay it ``2 L`` times. Why a scatter into the whole array and not a
slice of it: a scatter into a *donated* pool runs in place, while slicing a layer out and setting it back
copies the whole pool (docs/DECISIONS.md; ``tests/engine/test_runner.py`` checks the compiled step).

With tensor parallelism (``sharding.py``) the pool is split on its KV-head axis: each device holds
``max(Hkv / tp, 1)`` heads of every block, and one block table addresses every shard's slice.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from ..config import EngineConfig
from ..kernels.fp8 import is_fp8, scale_rows
from ..kernels.shapes import compute_capability
from .checkpoint import ModelParams
from .config import QwenConfig
from .qwen import KVPool
from .sharding import POOL_SPEC, params_tp, shard_config

CPU_POOL_FRACTION = 0.25  # of the host memory available when the engine starts
CPU_POOL_CAP_BYTES = 4 << 30  # never more than this on a CPU without num_blocks
# A GPU pool holds at most this many times what max_num_seqs sequences of max_model_len tokens need:
# room for every running sequence and for the prefix cache, while a small model on a large GPU does not
# take (and initialise, and make XLA plan around) a pool of millions of blocks it can never use.
GPU_POOL_CAP_SEQUENCES = 4
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)  # fp8 conversions: Ada, Hopper and later


# ---- layout and bytes -----------------------------------------------------------------------------------
def pool_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
               head_dim: int, dtype=None) -> tuple[int, ...]:
    """``(L, num_blocks, block_size, 2, Hkv, D)``: the shape of a KV pool; a pool of an fp8 ``dtype`` has
    ``block_size + 1`` rows a block (its scales, ``kernels/fp8.py``), which needs ``block_size <= D``."""
    rows = scale_rows(dtype) if dtype is not None else 0
    if rows and block_size > head_dim:
        raise ValueError(f"an fp8 KV pool keeps a block's scales in one row of head_dim={head_dim} entries: "
                         f"block_size must be <= {head_dim}, got {block_size}")
    return (num_layers, num_blocks, block_size + rows, 2, num_kv_heads, head_dim)


def engine_pool_shape(params: ModelParams, num_blocks: int, block_size: int, dtype) -> tuple[int, ...]:
    """The global shape of the pool :func:`make_kv_pool` makes for ``params`` (over a mesh: every
    shard's KV heads, a replicated head counted once a shard)."""
    cfg = shard_config(params.config, params_tp(params))
    return pool_shape(cfg.num_hidden_layers, num_blocks, block_size, params_tp(params) * cfg.num_key_value_heads,
                      cfg.head_dim, dtype)


def bytes_per_token_per_device(params: ModelParams, dtype) -> int:
    """Bytes of K and V one token occupies on each device (all layers, this device's KV heads), scale
    rows aside."""
    return shard_config(params.config, params_tp(params)).kv_bytes_per_token(jnp.dtype(dtype).itemsize)


def block_bytes_per_device(params: ModelParams, block_size: int, dtype) -> int:
    """Bytes one block takes on each device, an fp8 block's scale row included."""
    return bytes_per_token_per_device(params, dtype) * (block_size + scale_rows(dtype))


def bytes_per_token_slot(params: ModelParams, block_size: int, dtype) -> int:
    """Bytes one token slot takes over all devices (KV heads replicated when tp > Hkv count each time),
    with its share of an fp8 block's scale row: what ``llm.stats()`` reports per token."""
    return params_tp(params) * block_bytes_per_device(params, block_size, dtype) // block_size


def check_kv_dtype(name: str, dtype, block_size: int, head_dim: int) -> None:
    """Raises a ValueError naming ``kv_cache_dtype`` (``name``) if this device or pool geometry cannot hold
    a pool of ``dtype``: an fp8 pool needs fp8 conversions on a GPU (compute capability 8.9: Ada, Hopper
    and later), and a block's scales fit one row of ``head_dim`` entries (``block_size <= head_dim``)."""
    if not is_fp8(dtype):
        return
    device = jax.local_devices()[0]
    cc = compute_capability(device)
    if device.platform == "gpu" and cc is not None and cc < FP8_MIN_COMPUTE_CAPABILITY:
        raise ValueError(f"kv_cache_dtype={name!r} needs a GPU with fp8 support (compute capability >= 8.9); "
                         f"{device.device_kind} has {device.compute_capability}")
    if block_size > head_dim:
        raise ValueError(f"kv_cache_dtype={name!r} keeps a block's scales in one row of head_dim={head_dim} "
                         f"entries: block_size must be <= {head_dim}, got {block_size}")


# ---- sizing ----------------------------------------------------------------------------------------------
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


def free_device_memory(device, memory_fraction: float = 1.0) -> int | None:
    """Bytes the engine may still take on ``device``: ``memory_fraction`` of XLA's allocator limit minus
    what it already holds (the weights), as vLLM's ``gpu_memory_utilization`` counts; ``None`` where the
    device keeps no such statistics (a CPU). The rest of the device stays free for the steps' working
    memory and the compiler's autotuning, whatever the size of the weights."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] * memory_fraction) - stats.get("bytes_in_use", 0)
    return None


def size_pool(params: ModelParams, config: EngineConfig, max_model_len: int, dtype: str) -> int:
    """Blocks in the pool: ``num_blocks`` if given; on a GPU what ``free_device_memory`` leaves within
    ``memory_fraction`` of the device (with tensor parallelism: on the device with the least, per
    device's share of a block), at most ``GPU_POOL_CAP_SEQUENCES`` times what ``max_num_seqs`` full-length sequences need;
    on a CPU ``CPU_POOL_FRACTION`` of the available host memory, at most ``CPU_POOL_CAP_BYTES``
    and at most what ``min(max_num_seqs, 16)`` full-length sequences need. Every kernel addresses a pool
    of any size (``kernels/kv_write.py``: the Pallas-Triton kernels' offsets are widened past 2**31)."""
    if config.num_blocks is not None:
        return config.num_blocks
    bs = config.resolved_block_size(params.config.head_dim)
    block_bytes = block_bytes_per_device(params, bs, dtype)
    devices = [jax.devices()[0]] if params.mesh is None else \
        [d for d in params.mesh.devices.flat if d.process_index == jax.process_index()]
    frees = [free_device_memory(d, config.memory_fraction) for d in devices]
    blocks_per_seq = math.ceil(max_model_len / bs)
    if all(f is not None for f in frees):
        by_memory = max(0, min(frees)) // block_bytes
        return min(by_memory, GPU_POOL_CAP_SEQUENCES * config.max_num_seqs * blocks_per_seq)
    enough = blocks_per_seq * min(config.max_num_seqs, 16)
    host = available_host_memory()
    budget = CPU_POOL_CAP_BYTES if host is None else min(int(host * CPU_POOL_FRACTION), CPU_POOL_CAP_BYTES)
    return max(1, min(enough, budget // block_bytes))


def check_holds_one_sequence(num_blocks: int, bs: int, max_model_len: int) -> None:
    """Raises a ValueError if the pool cannot hold one sequence of ``max_model_len`` tokens."""
    if num_blocks < 1:
        raise ValueError("the KV pool got no block: the weights fill the memory_fraction share of the device "
                         "(EngineConfig.memory_fraction, --gpu-memory-utilization): raise it, or set num_blocks")
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens: raise num_blocks / memory_fraction or "
            f"lower max_model_len")


# ---- making it ----------------------------------------------------------------------------------------
def init_kv_pool(cfg: QwenConfig, num_blocks: int, block_size: int, dtype: str | jnp.dtype,
                 device: jax.Device | None = None) -> KVPool:
    """A fresh pool of ``cfg``'s model on one device: zeros, committed to ``device`` (default: the first),
    as the donated pool every step returns is; an uncommitted argument would select a separately
    compiled step."""
    shape = pool_shape(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)
    return jnp.zeros(shape, dtype, device=device or jax.local_devices()[0])


def make_kv_pool(params: ModelParams, num_blocks: int, block_size: int, dtype) -> KVPool:
    """The engine's pool: :func:`init_kv_pool` on one device; on a mesh created directly split over KV
    heads (each device allocates only its slice of :func:`engine_pool_shape`)."""
    if params.mesh is None:
        return init_kv_pool(params.config, num_blocks, block_size, dtype)
    shape = engine_pool_shape(params, num_blocks, block_size, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(params.mesh, POOL_SPEC))()
