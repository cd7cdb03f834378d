"""What the Mosaic GPU attention kernels share: Hopper's limits, the kernels' supported shapes and pool
dtypes, the default KV tile, the shared-memory tiling of a tile, and the interpreter's settings.

The kernels (``tiles.py``, ``prefill.py``, ``decode.py``) import from here and from ``fp8.py`` and
``layout.py``; ``attention.py`` picks one of them per launch.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
BLOCK_M = 64  # query rows of a program: Hopper wgmma's M per warpgroup
MIN_KV_TILE = 64  # keys per inner step at least (wgmma K of P @ V: one 128-byte swizzle row of bf16)
MAX_KV_TILE = 256  # wgmma's largest N (S = Q K^T)
NUM_SLOTS = 2  # KV tiles in flight by default (double buffering)
TMA_ALIGN = 128  # bytes: a TMA copy's shared-memory address is a multiple of this
SWIZZLE = 128  # bytes: shared-memory swizzle of every tile (rows of 64 bf16 / 32 fp32 elements)
SMEM_BYTES = 227 * 1024  # shared memory a Hopper block may use
MASKED = -1e30  # initial running max: finite, so a fully masked row gives exp2(-inf) = 0, never NaN
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (8, 16, 32, 64, 128)


def pool_dtypes(interpret) -> tuple[jnp.dtype, ...]:
    """The pool dtypes the kernels read besides fp8: bf16, and float32 in interpret mode only (Hopper's
    wgmma has no fp32 inputs: ``attention.py``'s docstring)."""
    return (jnp.dtype(jnp.bfloat16),) + ((jnp.dtype(jnp.float32),) if interpret else ())


def kv_tile(block_size: int) -> int:
    """Default keys per inner step: ``MIN_KV_TILE``, or one pool block if larger."""
    return max(MIN_KV_TILE, block_size)


def interpreter_threads() -> int:
    """Threads XLA's CPU client runs computations on: one a core this process may use, or one a CPU
    device where there are more (``--xla_force_host_platform_device_count``).

    Mosaic GPU's interpreter runs each warpgroup of a program as a computation of its own whose
    barrier waits block the thread running it; the caller's computation holds one more. With fewer
    threads than warpgroups + 1, the warp-specialised prefill kernel (3 warpgroups) can deadlock (a
    2-core machine did), so in interpret mode ``attention.paged_attention_mgpu`` runs its prefill
    launches on the one-warpgroup kernel there."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(cores, jax.local_device_count("cpu"))


def transforms(dtype, cols: int | None = None):
    """Tiling and swizzle of a shared-memory tile of ``dtype``: 8 rows x one 128-byte swizzle row, or for a
    tile of ``cols`` narrower than that (an fp8 tile of 64 columns), one row."""
    swizzle = SWIZZLE if cols is None else min(SWIZZLE, cols * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def interpret_params(interpret):
    """``True`` -> Mosaic GPU's CPU interpreter with default parameters; an ``InterpretGPUParams`` is
    used as given; ``False``/``None`` -> compiled."""
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None
