"""Writes a step's new K/V rows into the paged pool: one XLA scatter per cache, in place when donated.

Pool layout (one layer): ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``. Slot ``s`` is
``block_id * block_size + offset``; ``-1`` marks a padding token and writes nothing.

Why a scatter and not a Pallas kernel: on the H200 (``shared/GPU.md``, 2026-11-29) one scatter
``pool.at[blk, off].set(kv)`` per layer into a *donated* pool runs in place (28 layers x 256 tokens in
0.30-0.35 ms in all), while slicing a layer out of a bigger array and setting it back copies the whole
pool (22.7 ms) and the same scatter without donation copies it too (7.6 ms). So: keep each layer's pool
a separate array (the engine's tuple of per-layer pairs), write with :func:`write_kv` inside the jitted
step whose pool arguments are donated, or call :func:`write_kv_donated` on its own.
``benchmarks/bench_attention.py`` checks the compiled HLO for a copy of the pool and times the write.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _validate(k_cache, v_cache, k, v, slot_mapping):
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]; got "
                         f"{k_cache.shape} and {v_cache.shape}")
    hkv, d = k_cache.shape[2:]
    if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (hkv, d):
        raise ValueError(f"k and v must both be [T, {hkv}, {d}]; got {k.shape} and {v.shape}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be i32[{k.shape[0]}], got {slot_mapping.dtype}"
                         f"{list(slot_mapping.shape)}")


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatters ``k, v [T, Hkv, D]`` into slots ``slot_mapping i32[T]`` of ``[N, bs, Hkv, D]`` caches.

    Traceable (call it inside the model's jitted step). Padding slots (``-1``) point one block past the
    end and are dropped. Returns the updated ``(k_cache, v_cache)``; in place when the caches are donated.
    """
    _validate(k_cache, v_cache, k, v, slot_mapping)
    num_blocks, block_size = k_cache.shape[:2]
    blk = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    off = jnp.where(slot_mapping < 0, 0, slot_mapping % block_size)
    k_cache = k_cache.at[blk, off].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[blk, off].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv_donated(k_cache, v_cache, k, v, slot_mapping):
    """:func:`write_kv` as its own jitted call with both caches donated (in place)."""
    return write_kv(k_cache, v_cache, k, v, slot_mapping)
