"""Reading an fp8 pool block in the Mosaic GPU kernels (kernels/fp8.py has the format): the TMA copies of
a block's keys, its values' ``V^T`` and its two scale rows into shared-memory slots, the per-key scales
as f32 in the WGMMA layout, and the queries scaled into f16 for ``Q K^T``. Shared by the one-warpgroup
kernel, the decode kernel and the prefill kernel, which do the same arithmetic (Triton's f16 path's).

The arithmetic: a KV tile is one pool block. TMA copies its keys (``[bs, D]``), its values' ``V^T``
(``D / bs`` boxes of the transposed slab, kernels/fp8.py) and its two scale rows into fp8 slots. Each
step converts the keys to f16 in registers (exact: an fp8 value is an f16 value) and stores them in an
f16 tile for ``Q K^T``; the queries are f16 too, each row first multiplied by the power of two that
brings its largest element near 2^14 (bf16 has a wider range than f16), which the scores' row is divided
by again; the K scales multiply the scores' columns. ``V^T`` is converted the same way into the same f16
tile (``Q K^T`` is done with it); the V scales, divided by the largest the row sees in the tile (powers
of two: exact), multiply the probabilities' columns before ``P`` is rounded to f16 (which keeps 11
significant bits of ``P`` in ``[0, 1]``, bf16 8), and that largest scale multiplies the row of ``P V``.
The slots are copied untiled with the TMA's swizzle only: a tiled copy needs the pool's row axis
(``bs + 1`` rows, the scale row included) to be a multiple of 8.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def scales_f32(scale_row, shape, key_axis: int = 1):
    """A KV tile's per-token scales (``scale_row``: at least ``shape[key_axis]`` fp8 powers of two in shared
    memory, kernels/fp8.py) in f32, broadcast over the other axis of its ``shape`` (WGMMA layout) scores:
    one per key, a column each (keys on axis 1) or a row each (axis 0, the decode kernel's ``S^T``)."""
    vec = plgpu.Layout.WGMMA.reduce(1 - key_axis)
    row = plgpu.load(scale_row.at[pl.ds(0, shape[key_axis])], layout=vec).astype(jnp.float16).astype(jnp.float32)
    return lax.broadcast_in_dim(row, shape, [key_axis])


def fp8_block_copies(head_dim: int, block_size: int) -> tuple[int, int]:
    """TMA copies of one fp8 pool block (:func:`copy_fp8_block`) on its K barrier and on its V barrier:
    the keys and their scale row; the ``D / block_size`` boxes of ``V^T`` and their scale row."""
    return 2, head_dim // block_size + 1


def copy_fp8_block(kv_ref, layer, phys, h, slot, k8_smem, vt8_smem, scale_smem, k_bar, v_bar):
    """Issues the TMA copies of KV head ``h`` of fp8 pool block ``phys`` (layer ``layer``) into ``slot``:
    its keys as stored into ``k8_smem [slots, bs, D]``, its values' ``V^T`` (slab columns ``[j bs, (j+1)
    bs)`` are ``V^T``'s rows, kernels/fp8.py) into ``vt8_smem [slots, D, bs]``, and its K and V scale rows
    into ``scale_smem [slots, 2, >= bs]``; keys and K scales arrive on ``k_bar[slot]``, the rest on
    ``v_bar[slot]`` (:func:`fp8_block_copies` copies each)."""
    copy_fp8_keys(kv_ref, layer, phys, h, slot, k8_smem, k_bar)
    copy_fp8_scales(kv_ref, layer, phys, h, slot, scale_smem, 0, k_bar)
    copy_fp8_values(kv_ref, layer, phys, h, slot, vt8_smem, v_bar)
    copy_fp8_scales(kv_ref, layer, phys, h, slot, scale_smem, 1, v_bar)


def copy_fp8_keys(kv_ref, layer, phys, h, slot, k8_smem, bars):
    """One TMA copy: the keys of :func:`copy_fp8_block`, on ``bars[slot]``."""
    block_size = k8_smem.shape[1]
    plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, pl.ds(0, block_size), 0, h, :], k8_smem.at[slot], bars.at[slot])


def copy_fp8_values(kv_ref, layer, phys, h, slot, vt8_smem, bars):
    """``D / bs`` TMA copies: the ``V^T`` of :func:`copy_fp8_block`, on ``bars[slot]``."""
    head_dim, block_size = vt8_smem.shape[1:]
    for j in range(head_dim // block_size):
        cols = pl.ds(j * block_size, block_size)
        plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, pl.ds(0, block_size), 1, h, cols], vt8_smem.at[slot, cols],
                                bars.at[slot])


def copy_fp8_scales(kv_ref, layer, phys, h, slot, scale_smem, which: int, bars):
    """One TMA copy: the K (``which`` 0) or V (1) scale row of :func:`copy_fp8_block`, on ``bars[slot]``."""
    block_size = kv_ref.shape[2] - 1
    plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, block_size, which, h, pl.ds(0, block_size)],
                            scale_smem.at[slot, which, pl.ds(0, block_size)], bars.at[slot])


def f16_queries(q32, scale_log2: float):
    """Queries ``q32 f32[rows, D]`` (WGMMA layout) for an f16 ``Q K^T`` over an fp8 pool: each row times the
    power of two that brings its largest element near 2^14 (bf16 has a wider range than f16), in f16, and
    per row what multiplies its scores back (the inverse times ``scale_log2``). Zero rows get 2^-100."""
    e = jnp.clip(jnp.round(jnp.log2(jnp.max(jnp.abs(q32), axis=1))), -100.0, 100.0)
    q16 = (q32 * lax.broadcast_in_dim(jnp.exp2(14.0 - e), q32.shape, [0])).astype(jnp.float16)
    return q16, jnp.exp2(e - 14.0) * scale_log2
