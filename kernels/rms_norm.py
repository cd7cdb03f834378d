"""RMSNorm as a Pallas (Triton lowering) row kernel: each row reduced in one fixed order, whatever the batch.

XLA's reduction emitter picks its tiling (threads per row, rows per block, vectorisation) from the
whole operand shape, so the order in which a row's squares are summed could change with the number of
rows; for the batch-invariant mode that is not allowed. Here a program owns ``block_rows`` rows (a
function of the row length only) and sums each row in registers with one ``tt.reduce`` over a fixed
``[block_rows, next_pow2(H)]`` tile: every row goes through the same reduction tree, and rows past the
end and columns past ``H`` are zeros that add nothing.

Same math as :func:`jaxpaged.kernels.rms_norm.rms_norm_reference` (Hugging Face's Qwen RMSNorm):
``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).astype(x.dtype)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpaged.kernels.shapes import next_pow2


def row_block(hidden: int) -> tuple[int, int]:
    """``(block_rows, num_warps)`` for rows of ``hidden`` elements: fixed per row length, never per row count."""
    width = next_pow2(hidden)
    return max(1, min(16, 8192 // width)), (8 if width >= 4096 else 4)


def _rms_norm_kernel(x_ref, w_ref, o_ref, *, eps: float, block_rows: int):
    num_rows, hidden = x_ref.shape
    width = next_pow2(hidden)
    rows = pl.program_id(0) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    cols = lax.broadcasted_iota(jnp.int32, (width,), 0)
    ok = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=ok, other=0)
    w = plgpu.load(w_ref.at[cols], mask=cols < hidden, other=0)
    xf = x.astype(jnp.float32)
    mean_sq = jnp.sum(xf * xf, axis=1) / hidden
    y = (xf * lax.rsqrt(mean_sq + eps)[:, None]).astype(o_ref.dtype)
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], w[None, :].astype(o_ref.dtype) * y, mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, interpret: bool = False) -> jax.Array:
    """RMSNorm over the last axis of ``x [..., H]`` with ``weight [H]``; result in ``x.dtype``."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {weight.shape} does not match the last axis of x {x.shape}")
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.shape[0] == 0:
        return x
    block_rows, num_warps = row_block(hidden)
    out = pl.pallas_call(
        functools.partial(_rms_norm_kernel, eps=float(eps), block_rows=block_rows),
        grid=(pl.cdiv(rows.shape[0], block_rows),),
        out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"rms_norm_rows{block_rows}",
    )(rows, weight.astype(x.dtype))
    return out.reshape(x.shape)


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Hugging Face's Qwen RMSNorm over the last axis: normalise in fp32, cast back, scale by ``weight``."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)
