"""Residual add and RMSNorm as one row kernel (Pallas, Triton lowering), fed a matmul's split-K partials.

Why: between two projections a decoder layer adds the last product to the residual stream and
normalises the sum for the next projection. XLA runs that as separate small kernels at decode batch
sizes (the GEMV's partial sum and rounding, the residual add, the norm's reduction: 3 launch-bound
kernels, ``tools/profile_step.py`` shows them); here it is one. The product
arrives as ``parts [P, T, H]``: the ``P`` split-K partial sums of :func:`jaxpaged.kernels.gemv.gemv_partials`
(fp32), or ``P = 1`` finished product in the model dtype (XLA's GEMM, ``x @ w``).

Same math as the model's XLA path (``models/qwen.DecoderLayer`` without the fusion): the partials
summed in order 0, 1, ... in fp32 and rounded to the model dtype (the product ``gemv`` would return),
the residual add rounded to the model dtype (``x + h``), then Hugging Face's Qwen RMSNorm
(``weight * (r_f32 * rsqrt(mean(r_f32^2) + eps)).astype(dtype)``). The norm's sum runs in one fixed
order per row (a ``[block_rows, next_pow2(H)]`` tile reduced in registers, rows per program a function
of ``H`` only), as in :mod:`jaxpaged.kernels.rms_norm`; XLA's own reduction may order it differently,
so the normalised values can differ from XLA's in the last bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpaged.kernels.gemv import sum_partials
from jaxpaged.kernels.rms_norm import row_block
from jaxpaged.kernels.shapes import next_pow2


def _kernel(parts_ref, res_ref, w_ref, normed_ref, res_out_ref, *, eps: float, block_rows: int):
    num_parts, num_rows, hidden = parts_ref.shape
    dtype = res_ref.dtype
    width = next_pow2(hidden)
    rows = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    cols = lax.broadcasted_iota(jnp.int32, (width,), 0)
    ok = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    r_idx, c_idx = rows[:, None], cols[None, :]
    acc = plgpu.load(parts_ref.at[0, r_idx, c_idx], mask=ok, other=0).astype(jnp.float32)
    for p in range(1, num_parts):  # fixed order, as gemv() sums them
        acc = acc + plgpu.load(parts_ref.at[p, r_idx, c_idx], mask=ok, other=0).astype(jnp.float32)
    delta = acc.astype(dtype).astype(jnp.float32)  # the product, rounded as the model's matmul returns it
    res = plgpu.load(res_ref.at[r_idx, c_idx], mask=ok, other=0).astype(jnp.float32)
    r = (res + delta).astype(dtype)
    plgpu.store(res_out_ref.at[r_idx, c_idx], r, mask=ok)
    rf = r.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(rf * rf, axis=1) / hidden + eps)
    w = plgpu.load(w_ref.at[cols], mask=cols < hidden, other=0)
    y = (rf * inv[:, None]).astype(dtype)
    plgpu.store(normed_ref.at[r_idx, c_idx], w[None, :].astype(dtype) * y, mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(parts: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``parts [P, T, H]`` (a product as ``P`` partial sums, fp32 or the model dtype), ``residual [T, H]``,
    ``weight [H]`` -> ``(normed [T, H], residual + product [T, H])``, both in ``residual.dtype``."""
    if parts.ndim != 3 or parts.shape[1:] != residual.shape or residual.ndim != 2:
        raise ValueError(f"parts must be [P, T, H] over residual [T, H], got {parts.shape} and {residual.shape}")
    if weight.shape != residual.shape[-1:]:
        raise ValueError(f"weight {weight.shape} does not match the hidden size of residual {residual.shape}")
    num_rows, hidden = residual.shape
    if num_rows == 0:
        return residual, residual
    block_rows, num_warps = row_block(hidden)
    if parts.shape[0] > 1:  # a few rows of several partials: one row per program spreads the reads
        block_rows = 1
    out_shape = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), block_rows=block_rows),
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(out_shape, out_shape),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"add_rms_norm_p{parts.shape[0]}",
    )(parts, residual, weight.astype(residual.dtype))


def add_rms_norm_ops(parts: jax.Array, residual: jax.Array, weight: jax.Array, eps: float,
                     rms_norm: callable) -> tuple[jax.Array, jax.Array]:
    """The same stretch with the model's ops (``rms_norm``: the model's RMSNorm function): the XLA
    reference of :func:`add_rms_norm`, and its path where the kernel does not apply."""
    r = residual + sum_partials(parts, residual.dtype)
    return rms_norm(r, weight, eps), r
