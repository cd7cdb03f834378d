"""The fp8 KV cache's number format: 8-bit K/V with a power-of-two scale per token, head and K or V.

An fp8 pool has one more row per block than it has token slots: rows ``0..bs-1`` hold the tokens'
K/V divided by their scale and rounded to fp8, and row ``bs`` holds the scales, ``[..., bs, kv, h, t]``
being the scale of token slot ``t``'s K (``kv = 0``) or V (``kv = 1``) for KV head ``h`` (so
``block_size <= head_dim``). Each scale is chosen when its token is written, from that token's own
values: ``2**ceil(log2(amax / fp8_max))``, clamped to the powers of two the fp8 format itself
represents, and stored as an fp8 value (exactly).

Keys sit as in a bf16 pool (``[..., t, 0, h, :]`` is slot ``t``'s key). Values are stored transposed
within their ``(block, head)`` slab of ``bs x D`` entries: ``V[t, d]`` sits at row ``d % bs``, column
``(d // bs) * bs + t`` (:func:`v_slab_index`), so for each dimension ``d`` a block's slots are
consecutive bytes, and columns ``[j bs, (j + 1) bs)`` of the slab are ``V^T``'s rows ``[j bs, (j + 1)
bs)`` in order: the Mosaic GPU kernel copies ``V^T`` into shared memory with ``D / bs`` rectangular
TMA boxes. Why: the attention's ``P @ V`` contracts over tokens, and an 8-bit operand
whose contracted axis is strided in memory runs at a fraction of bf16's bandwidth, while keys,
contracted over ``d`` (contiguous), run at full speed (docs/DECISIONS.md). Why:

* correctness never depends on a calibration step: a scale fits the values it scales, whatever the
  model, the layer or the prompt (a fixed per-tensor scale of 1.0, vLLM's default, overflows or
  underflows where activations are large or small);
* a power of two divides exactly, so the only rounding is the fp8 one, and applying the scale in the
  attention kernel is one multiply per score column (K) or probability column (V);
* the scales live in the pool array itself, one row a block (1/16 more bytes at block size 16): the
  pool stays one donated array, split over KV heads with its scales under tensor parallelism, and
  every block copy or free moves both together.

``dtype`` below is the pool's: ``float8_e4m3fn`` ("fp8", "fp8_e4m3") or ``float8_e5m2`` ("fp8_e5m2").
The functions are plain ``jnp`` and run inside Pallas kernels and XLA alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is an fp8 pool dtype (one with a scale row per block)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def scale_rows(dtype) -> int:
    """Rows a block of a pool of ``dtype`` adds to its token slots (1 for fp8: the scales)."""
    return 1 if is_fp8(dtype) else 0


def exponent_range(dtype) -> tuple[int, int]:
    """The powers of two ``dtype`` represents exactly (subnormals included): the scales' range."""
    info = jnp.finfo(dtype)
    return int(math.log2(float(info.smallest_subnormal))), int(math.floor(math.log2(float(info.max))))


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` -> ``(q [..., D] in dtype, scale [...] in f32)`` with ``x ~= q * scale``: the scale a
    power of two from each row's largest magnitude, values clipped to the format's range (never inf
    or NaN for finite ``x``). Rows whose largest magnitude exceeds ``fp8_max * 2**hi`` (e4m3:
    114,688) are clipped there; rows below ``fp8_max * 2**lo`` share the smallest scale."""
    fmax = float(jnp.finfo(dtype).max)
    lo, hi = exponent_range(dtype)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    exponent = jnp.clip(jnp.ceil(jnp.log2(amax / fmax)), lo, hi).astype(jnp.int32)  # log2(0) = -inf: lo
    scale = power_of_two(exponent)
    q = jnp.clip(xf / scale[..., None], -fmax, fmax).astype(dtype)
    return q, scale


def power_of_two(exponent: jax.Array) -> jax.Array:
    """``2.0 ** exponent`` in f32, exactly (built from its bits: ``exp2`` is approximate on some backends),
    for integer exponents in [-126, 127]."""
    return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def v_slab_index(d, t, block_size: int, head_dim: int):
    """``(row, column)`` of value ``V[t, d]`` within its block's ``(block, head)`` slab of an fp8 pool
    (works on Python ints and integer arrays alike)."""
    return d % block_size, (d // block_size) * block_size + t


def values_to_slab(v: jax.Array) -> jax.Array:
    """``v [..., bs, H, D]`` (slot ``t``'s values at ``[..., t, h, :]``) -> the same entries as an fp8
    pool stores them (``[..., row, h, column]``, :func:`v_slab_index`)."""
    *lead, bs, h, d = v.shape
    x = v.reshape(*lead, bs, h, d // bs, bs)  # [.., t, h, j, row] with d = j * bs + row
    x = jnp.swapaxes(x, -4, -1)  # [.., row, h, j, t]
    return x.reshape(*lead, bs, h, d)


def values_from_slab(slab: jax.Array) -> jax.Array:
    """The inverse of :func:`values_to_slab`: a pool's value slab ``[..., bs, H, D]`` -> ``[..., t, h, d]``."""
    *lead, bs, h, d = slab.shape
    x = slab.reshape(*lead, bs, h, d // bs, bs)  # [.., row, h, j, t]
    x = jnp.swapaxes(x, -4, -1)  # [.., t, h, j, row]
    return x.reshape(*lead, bs, h, d)


def quantize_pool(pool: jax.Array, dtype) -> jax.Array:
    """A pool ``[L, N, bs, 2, Hkv, D]`` of values (bf16 or f32) as an fp8 pool of ``dtype``, ``[L, N, bs + 1,
    2, Hkv, D]``: each slot's K and V quantised per head (:func:`quantize`), values moved into their slabs,
    scales into the scale row. A slot holding a NaN keeps NaN values and gets a NaN scale, so stale slots
    stay poisoned. For tests and benchmarks that build pools by hand (the engine writes through
    ``kv_write``)."""
    x = pool.astype(jnp.float32)
    values, scales = quantize(x, dtype)  # [L, N, bs, 2, Hkv, D], [L, N, bs, 2, Hkv]
    values = values.at[:, :, :, 1].set(values_to_slab(values[:, :, :, 1]))
    scales = jnp.where(jnp.isnan(x).any(-1), jnp.nan, scales)
    num_layers, n, bs, _, hkv, d = pool.shape
    row = jnp.full((num_layers, n, 2, hkv, d), jnp.nan).at[..., :bs].set(jnp.moveaxis(scales, 2, -1))
    return jnp.concatenate([values, row[:, :, None].astype(dtype)], axis=2)


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``q [..., D]`` (fp8), ``scale [...]`` -> f32 values."""
    return q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
