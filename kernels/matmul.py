"""A fixed-tile matmul (Pallas, Triton lowering) whose row results never depend on the number of rows.

Why: XLA and cuBLAS choose a GEMM algorithm (tile shape, split-K, reduction order) from the problem
shape, so on the GPU row ``i`` of ``x @ w`` can change in its last bits when ``x`` gains or loses rows:
the same request batched differently then gives different logits (greedy bf16 requests change
tokens: docs/NUMERICS.md). This kernel fixes every choice that could depend on ``M``:

  * one launch configuration per weight shape (:func:`matmul_config` looks at ``K``, ``N`` and the
    dtype, never at ``M``): fixed ``block_m``, ``block_n``, ``block_k``, warps and stages;
  * no split-K: one program owns an output tile and reduces all of ``K`` itself, in ``block_k`` chunks
    in increasing order, accumulating in fp32;
  * rows past ``M`` (and columns past ``N``, depths past ``K``) are masked loads of zeros, so a partial
    tile computes its real rows exactly like a full one.

Row ``i`` is computed by the same instructions on the same values whatever ``M`` is; the only thing
that moves is which row of a tile it occupies, and a tensor-core MMA treats its rows alike.
``w`` is ``[K, N]``, or ``[N, K]`` with ``transpose_w=True`` (a tied LM head reads the embedding
``[V, H]`` as it is: no transposed copy of a 300 MB matrix per step).

fp32 operands use IEEE fp32 dots (``DotAlgorithmPreset.F32_F32_F32``, lowered to Triton's
``input_precision="ieee"``), never TF32; bf16 operands accumulate in fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def dot_precision(*dtypes) -> lax.Precision | None:
    """``HIGHEST`` when any operand is float32 (XLA's GPU default would be TF32), else ``None``.

    For XLA dots (``jnp.matmul``, ``einsum``, ``lax.dot_general``) outside Pallas kernels.
    """
    return lax.Precision.HIGHEST if any(jnp.dtype(d) == jnp.float32 for d in dtypes) else None


def kernel_dot_precision(dtype):
    """Precision for a ``lax.dot_general`` inside a Pallas-Triton kernel: an explicit IEEE fp32
    algorithm for float32 operands (maps to Triton ``input_precision="ieee"`` whatever the global
    default), ``None`` (fp32 accumulation of bf16 products) otherwise."""
    return lax.DotAlgorithmPreset.F32_F32_F32 if jnp.dtype(dtype) == jnp.float32 else None


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Static launch configuration: tile ``block_m x block_n``, ``K`` in steps of ``block_k`` (all
    powers of two >= 16, Triton's ``dot`` minimum)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def matmul_config(k: int, n: int, dtype) -> MatmulConfig:
    """The one configuration for a ``[K, N]`` weight: never a function of ``M`` (the row count)."""
    del k, n
    if jnp.dtype(dtype) == jnp.float32:  # IEEE fp32 dots run on FMA units: smaller K steps
        return MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
    return MatmulConfig()


def _matmul_kernel(x_ref, w_ref, o_ref, *, cfg: MatmulConfig, transpose_w: bool, precision):
    """One ``block_m x block_n`` output tile over all of ``K``, in ``block_k`` steps, in order."""
    m, k = x_ref.shape
    n = w_ref.shape[0] if transpose_w else w_ref.shape[1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    rows = pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    cols = pl.program_id(1) * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    row_ok = rows < m
    col_ok = cols < n
    depth = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    steps = pl.cdiv(k, bk)

    def body(step, acc):
        ks = step * bk + depth
        k_ok = ks < k
        # Masked lanes read zeros (their indices may point past the array: never dereferenced on GPU,
        # dropped in interpret mode). A zero times anything adds exactly nothing to the sum.
        x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
        if transpose_w:
            w = plgpu.load(w_ref.at[cols[:, None], ks[None, :]], mask=col_ok[:, None] & k_ok[None, :], other=0)
            dims = (((1,), (1,)), ((), ()))
        else:
            w = plgpu.load(w_ref.at[ks[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0)
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


def _validate(x, w, transpose_w, cfg):
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"matmul needs x [M, K] and a 2-D weight, got {x.shape} and {w.shape}")
    k = w.shape[1] if transpose_w else w.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"contraction sizes differ: x {x.shape}, w {w.shape} (transpose_w={transpose_w})")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}")
    for name in ("block_m", "block_n", "block_k"):
        b = getattr(cfg, name)
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two >= 16")


@functools.partial(jax.jit, static_argnames=("transpose_w", "out_dtype", "config", "interpret"))
def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None,
           config: MatmulConfig | None = None, interpret: bool = False) -> jax.Array:
    """``x [M, K] @ w`` -> ``[M, N]`` in ``out_dtype`` (default ``x.dtype``), fp32 accumulation.

    ``w`` is ``[K, N]``, or ``[N, K]`` when ``transpose_w``. ``config`` defaults to
    :func:`matmul_config` of the weight (independent of ``M``). ``interpret``: Pallas interpret mode (CPU).
    """
    k, n = (w.shape[1], w.shape[0]) if transpose_w else w.shape
    cfg = config or matmul_config(k, n, x.dtype)
    _validate(x, w, transpose_w, cfg)
    m = x.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    kernel = functools.partial(_matmul_kernel, cfg=cfg, transpose_w=transpose_w,
                               precision=kernel_dot_precision(x.dtype))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"fixed_tile_matmul_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}",
    )(x, w)


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None) -> jax.Array:
    """``x [M, K] @ w`` (``w [K, N]``, or ``[N, K]`` with ``transpose_w``) with fp32 accumulation, IEEE
    fp32 for float32 operands; result in ``out_dtype`` (default ``x.dtype``). Ground truth for
    :func:`jaxpaged.kernels.matmul.matmul`."""
    w = w.T if transpose_w else w
    out = jnp.matmul(x, w, preferred_element_type=jnp.float32, precision=dot_precision(x.dtype, w.dtype))
    return out.astype(out_dtype or x.dtype)
