"""Writes a step's new K/V rows into the paged pool: one XLA scatter per layer, in place when donated.

Pool layout (the whole model, one array; ``models/kv_pool.py`` owns it and says why):
``kv_pool: [L, num_blocks, block_size, 2, Hkv, D]``; index ``[layer, block, offset, 0]`` holds a token's
keys and ``[..., 1]`` its values, so one token's K and V of one layer are one contiguous row and a
layer's write is a single scatter. Slot ``s`` is ``block_id * block_size + offset``; ``-1`` marks a
padding token and writes nothing. An fp8 pool adds a scale row to each block and stores values
transposed within each (block, head) slab (``kernels/fp8.py``): its writes are three scatters. The
scatter goes into the whole (donated) array, never into a slice of it: that runs in place.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from .fp8 import is_fp8, quantize, scale_rows, v_slab_index


def block_size_of(kv_pool: jax.Array) -> int:
    """Token slots per block of ``kv_pool`` (an fp8 pool's blocks have one more row: the scales)."""
    return kv_pool.shape[2] - scale_rows(kv_pool.dtype)


def pool_from_caches(k_cache: jax.Array, v_cache: jax.Array) -> jax.Array:
    """One layer's ``k_cache, v_cache [N, bs, Hkv, D]`` as a one-layer pool ``[1, N, bs, 2, Hkv, D]``
    (a copy: for tests and benchmarks that build caches by hand)."""
    return jnp.stack([k_cache, v_cache], axis=2)[None]


Layer = int | jax.Array  # a pool layer: a Python int, or an i32[] operand (one traced layer serves all)

# jax's Pallas-Triton lowering addresses an array with 32-bit offsets unless it is larger than 2**32
# *bytes*, and Triton sign-extends them: an array of more than 2**31 elements and at most 2**32 bytes
# (one-byte elements: an fp8 pool of 2-4 GiB) would be read and written outside itself past element 2**31.
# ``widen_triton_offsets`` (run the first time a kernel is traced over such a pool, before it is lowered)
# makes the lowering use 64-bit offsets for every array of more than 2**31 - 1 elements, as it does past
# 2**32 bytes, so a pool of any size is addressed. Mosaic GPU kernels (TMA descriptors, 64-bit addresses)
# and XLA's scatter address any pool.
I32_OFFSET_ELEMENTS, I64_OFFSET_BYTES = 2**31, 2**32


@functools.cache
def widen_triton_offsets() -> bool:
    """Makes jax's Pallas-Triton lowering pick 64-bit offsets for an array of more than 2**31 - 1 elements
    (it picks them by bytes: see above), once per process. The array's shape is what decides; its dtype is
    reported to the offset computation as a four-byte one only where that changes the choice. Returns
    whether the lowering could be taken (False on a jax without that private function: the kernels then
    refuse the arrays they cannot address, ``check_triton_addressable``)."""
    try:
        from jax._src import core as jax_core
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    compute = getattr(lowering, "_compute_offsets_from_indices", None)
    if compute is None:
        return False

    def widened(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        elements = math.prod(full.shape)
        if elements >= I32_OFFSET_ELEMENTS and elements * jnp.dtype(full.dtype).itemsize <= I64_OFFSET_BYTES:
            block_info = dataclasses.replace(block_info, full_shape_dtype=jax_core.ShapedArray(full.shape, jnp.float32))
        return compute(block_info, nd_indexer)

    lowering._compute_offsets_from_indices = widened
    return True


def pallas_addressable(num_bytes: int, itemsize: int) -> bool:
    """Whether the Pallas-Triton kernels can address an array of ``num_bytes`` bytes of ``itemsize``-byte
    elements: any size, once the lowering is widened (done here for the first array that needs it)."""
    if num_bytes // itemsize <= I32_OFFSET_ELEMENTS or num_bytes > I64_OFFSET_BYTES:
        return True
    return widen_triton_offsets()


def triton_addressable(kv_pool: jax.Array) -> bool:
    """Whether the Pallas-Triton kernels can address ``kv_pool`` (:func:`pallas_addressable`)."""
    return pallas_addressable(kv_pool.size * kv_pool.dtype.itemsize, kv_pool.dtype.itemsize)


def check_triton_addressable(kv_pool: jax.Array) -> None:
    """Raises a ValueError if a Pallas-Triton kernel cannot address ``kv_pool``."""
    if not triton_addressable(kv_pool):
        raise ValueError(f"a {kv_pool.dtype} kv_pool of {kv_pool.size * kv_pool.dtype.itemsize / 2**30:.2f} GiB "
                         "cannot be addressed by the Pallas-Triton kernels (32-bit offsets past element 2**31): "
                         "use at most 2 GiB or more than 4 GiB of one-byte elements, or the Mosaic GPU kernels")


def check_pool(kv_pool: jax.Array, layer: Layer) -> None:
    """Raises a ValueError naming the problem if ``kv_pool`` is not ``[L, N, bs, 2, Hkv, D]`` or ``layer``
    is not one of its layers (a Python int in range, or an integer scalar array: its value is the
    caller's to keep in range, as the model's layer loop does)."""
    if kv_pool.ndim != 6 or kv_pool.shape[3] != 2:
        raise ValueError(f"kv_pool must be [L, num_blocks, block_size, 2, Hkv, D]; got {kv_pool.shape}")
    if isinstance(layer, jax.Array) and layer.shape == () and jnp.issubdtype(layer.dtype, jnp.integer):
        return
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < kv_pool.shape[0]:
        raise ValueError(f"layer must be an int in [0, {kv_pool.shape[0]}) or an integer scalar array, "
                         f"got {layer!r}")


def write_kv(
    kv_pool: jax.Array,
    layer: Layer,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> jax.Array:
    """Scatters ``k, v [T, Hkv, D]`` into slots ``slot_mapping i32[T]`` of layer ``layer`` of
    ``kv_pool [L, N, bs, 2, Hkv, D]``.

    Traceable (call it inside the model's jitted step). Padding slots (``-1``) point one block past the
    end and are dropped. Returns the updated pool; in place when the pool is donated. An fp8 pool gets
    each token's K and V quantised with their own scales, written to the block's scale row, and its
    values in their transposed places (``kernels/fp8.py``).
    """
    check_pool(kv_pool, layer)
    num_blocks, _, _, hkv, d = kv_pool.shape[1:]
    block_size = block_size_of(kv_pool)
    if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (hkv, d):
        raise ValueError(f"k and v must both be [T, {hkv}, {d}]; got {k.shape} and {v.shape}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be i32[{k.shape[0]}], got {slot_mapping.dtype}"
                         f"{list(slot_mapping.shape)}")
    blk = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    off = jnp.where(slot_mapping < 0, 0, slot_mapping % block_size)
    rows = jnp.stack([k, v], axis=1)  # [T, 2, Hkv, D]
    if not is_fp8(kv_pool.dtype):
        return kv_pool.at[layer, blk, off].set(rows.astype(kv_pool.dtype), mode="drop")
    values, scales = quantize(rows, kv_pool.dtype)  # scales [T, 2, Hkv]: each token's, in the scale row
    kv_pool = kv_pool.at[layer, blk, off, 0].set(values[:, 0], mode="drop")
    # values go to their transposed places in the block's (block, head) slab (kernels/fp8.py)
    row, col = v_slab_index(jnp.arange(d, dtype=jnp.int32), off[:, None], block_size, d)  # [D], [T, D]
    heads = jnp.arange(hkv, dtype=jnp.int32)[None, :, None]
    kv_pool = kv_pool.at[layer, blk[:, None, None], row[None, None, :], 1, heads, col[:, None, :]].set(
        values[:, 1], mode="drop")
    return kv_pool.at[layer, blk, block_size, :, :, off].set(scales.astype(kv_pool.dtype), mode="drop")


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(0,))
def write_kv_donated(kv_pool, layer, k, v, slot_mapping):
    """:func:`write_kv` as its own jitted call with the pool donated (in place)."""
    return write_kv(kv_pool, layer, k, v, slot_mapping)
