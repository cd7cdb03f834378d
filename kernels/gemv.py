"""Split-K matrix-vector product (Pallas, Triton lowering) for the few-row matmuls of decode steps.

Why: at batch 1-32 every projection of a decode step is a read of its weight (Qwen3-0.6B: 4-13 MB per
matmul, 4 per layer) and nothing else; XLA's GEMM fusions reach about 40-45% of the HBM read rate on
these shapes (profile of the batch-1 step, ``tools/profile_step.py``) because a weight with 1,024
output columns gives them too few tiles to keep 132 SMs reading. This kernel splits both the output
columns and the reduction depth ``K`` so that every shape gets a few hundred programs:

  * program ``(j, s)`` owns output columns ``[j*block_n, (j+1)*block_n)`` and depths
    ``[s*K/splits, (s+1)*K/splits)``; it walks its depth range in ``block_k`` steps in increasing
    order, accumulating ``x[:, k] @ w[k, cols]`` in fp32 (a ``16 or 32 x block_k`` by ``block_k x block_n``
    tensor-core dot: rows past ``M`` are masked loads of zeros, so ``M`` = 1 costs no extra reads);
  * it writes its fp32 partial sum to ``partials[s]``; :func:`gemv` adds the ``splits`` partials in
    order 0, 1, ... (elementwise adds that XLA fuses into whatever consumes the product, e.g. the
    residual add) and rounds once to the output dtype. The sum order is fixed by the configuration,
    so results are deterministic from run to run.

``w`` is ``[K, N]``, or ``[N, K]`` with ``transpose_w`` (the tied LM head reads the embedding
``[V, H]`` as it is). Only bf16/fp16 operands: a float32 model keeps XLA's IEEE dot
(``kernels.matmul.dot_precision``), whose numerics the float32 guarantees are written against.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ROWS = 32  # the most rows: above it XLA's GEMM (the product is then no longer a read of the weight)


def row_tile(m: int) -> int:
    """The dot's row tile for ``M`` rows: 16 (Triton's smallest dot) or 32. The weight tile is read
    once per program either way, so 17-32 rows (a 32-token prefill, decode batches of 17-32) cost
    about what 16 do."""
    return 16 if m <= 16 else 32


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Static launch configuration: ``block_n`` output columns and ``K / splits`` depths per program,
    read in ``block_k`` steps (powers of two >= 16; ``K`` must be a multiple of ``splits * block_k``)."""

    block_n: int = 64
    block_k: int = 128
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3


def gemv_config(k: int, n: int, transpose_w: bool = False) -> GemvConfig:
    """The configuration for a ``[K, N]`` weight (never a function of ``M``): about 256+ programs.

    ``[K, N]`` weights read ``block_n`` contiguous columns per row of a tile (128 B at bf16 and
    ``block_n`` 64); transposed ones read ``block_k`` contiguous depths per row. ``splits`` grows
    until the grid has ~2 programs per SM, as long as each still walks at least 2 ``block_k`` steps.
    """
    block_n, block_k = 64, 128  # also for [N, K] weights (the tied LM head): as fast there
    splits = 1
    col_tiles = -(-n // block_n)
    while col_tiles * splits < 256 and k % (2 * splits * block_k) == 0 and k // (2 * splits) >= 2 * block_k:
        splits *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, splits=splits)


def supported(x: jax.Array, w: jax.Array, transpose_w: bool = False, config: GemvConfig | None = None) -> bool:
    """True when :func:`gemv` can compute ``x @ w``: 2-D, same 16-bit float dtype, ``M <= 32``, and
    ``K`` a multiple of the configuration's ``splits * block_k``."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    k, n = (w.shape[1], w.shape[0]) if transpose_w else w.shape
    if x.shape[1] != k or not 0 < x.shape[0] <= ROWS:
        return False
    cfg = config or gemv_config(k, n, transpose_w)
    return k % (cfg.splits * cfg.block_k) == 0


def _gemv_kernel(x_ref, w_ref, o_ref, *, cfg: GemvConfig, transpose_w: bool):
    m, k = x_ref.shape
    n = w_ref.shape[0] if transpose_w else w_ref.shape[1]
    bn, bk = cfg.block_n, cfg.block_k
    depth_per_split = k // cfg.splits
    split = pl.program_id(1)
    tile = row_tile(m)
    rows = lax.broadcasted_iota(jnp.int32, (tile,), 0)
    cols = pl.program_id(0) * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    row_ok = rows < m
    col_ok = cols < n
    depth = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    k0 = split * depth_per_split

    def body(step, acc):
        ks = k0 + step * bk + depth
        x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None], other=0)
        if transpose_w:
            w = plgpu.load(w_ref.at[cols[:, None], ks[None, :]], mask=col_ok[:, None], other=0)
            dims = (((1,), (1,)), ((), ()))
        else:
            w = plgpu.load(w_ref.at[ks[:, None], cols[None, :]], mask=col_ok[None, :], other=0)
            dims = (((1,), (0,)), ((), ()))
        return acc + lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, depth_per_split // bk, body, jnp.zeros((tile, bn), jnp.float32))
    out_rows = split * m + rows
    plgpu.store(o_ref.at[out_rows[:, None], cols[None, :]], acc, mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("transpose_w", "config", "interpret"))
def gemv_partials(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, config: GemvConfig | None = None,
                  interpret: bool = False) -> jax.Array:
    """The split-K partial products ``f32[splits, M, N]`` of ``x [M, K] @ w`` (``M <= 32``): their sum
    in order 0, 1, ... is the product. For a consumer that adds them itself (``kernels/qkv_epilogue``)."""
    k, n = (w.shape[1], w.shape[0]) if transpose_w else w.shape
    cfg = config or gemv_config(k, n, transpose_w)
    if not supported(x, w, transpose_w, cfg):
        raise ValueError(f"gemv cannot compute x {x.shape} {x.dtype} @ w {w.shape} {w.dtype} "
                         f"(transpose_w={transpose_w}, {cfg}): needs M <= {ROWS}, bf16/fp16 operands, "
                         f"K a multiple of splits*block_k")
    m = x.shape[0]
    partials = pl.pallas_call(
        functools.partial(_gemv_kernel, cfg=cfg, transpose_w=transpose_w),
        grid=(pl.cdiv(n, cfg.block_n), cfg.splits),
        out_shape=jax.ShapeDtypeStruct((cfg.splits * m, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"gemv_n{cfg.block_n}_k{cfg.block_k}_s{cfg.splits}_w{cfg.num_warps}_p{cfg.num_stages}",
    )(x, w)
    return partials.reshape(cfg.splits, m, n)


@functools.partial(jax.jit, static_argnames=("transpose_w", "out_dtype", "config", "interpret"))
def gemv(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None,
         config: GemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """``x [M, K] @ w`` -> ``[M, N]`` in ``out_dtype`` (default ``x.dtype``) for ``M <= 32``; fp32
    accumulation, one rounding at the end. ``w [K, N]`` or ``[N, K]`` (``transpose_w``).
    ``config`` defaults to :func:`gemv_config`; ``interpret``: Pallas interpret mode (CPU)."""
    partials = gemv_partials(x, w, transpose_w=transpose_w, config=config, interpret=interpret)
    return sum_partials(partials, out_dtype or x.dtype)


def sum_partials(parts: jax.Array, dtype) -> jax.Array:
    """``parts [P, M, N]`` (split-K partials, or ``P = 1`` finished product) summed in order 0, 1, ...
    in fp32 and rounded once to ``dtype``: the product :func:`gemv` returns. Elementwise adds that XLA
    fuses into whatever consumes the product."""
    total = parts[0].astype(jnp.float32)
    for s in range(1, parts.shape[0]):
        total = total + parts[s].astype(jnp.float32)
    return total.astype(dtype)
