"""The grouped (ragged) GEMM of a mixture-of-experts layer: rows sorted by group, each group times its own weight.

``x [M, K]`` holds rows sorted by group: the first ``group_sizes[0]`` rows belong to group 0, the next
``group_sizes[1]`` to group 1, and so on; rows past ``sum(group_sizes)`` belong to none and come out as
zeros. ``w [G, K, N]`` holds one weight per group. The result is ``[M, N]`` with row ``i`` equal to
``x[i] @ w[group(i)]``. Shapes are static (``M`` is the step's bucket times the experts per token), the
split into groups is data: no shape depends on the routing, so a step compiles once per bucket.

Three implementations, one contract:
  * :func:`grouped_matmul`: ``jax.lax.ragged_dot``, XLA's grouped GEMM (a CPU's; on a GPU it reads every group's weight);
  * :func:`grouped_matmul_fixed_tile`: a Pallas kernel (Triton lowering) whose row results never depend
    on the other rows, for ``batch_invariant`` (docs/NUMERICS.md): the tiling of ``kernels/matmul.py``
    (fixed ``block_m x block_n`` tiles, all of ``K`` in ``block_k`` steps in order, no split-K) over row
    tiles of one group each (``row_tiles``: a group's rows from its first, in ``block_m`` tiles), so a
    decode step's few rows an expert run in parallel, one tile an expert, and only the experts the rows
    meet are read. It also reads e4m3 weights with their scales (fp8 experts): each tile converted to
    ``x``'s dtype in registers (exact), at a byte a weight. Where batch invariance is not asked
    (``by_rows``), a decode step's few rows an expert take the GEMV's smaller tile (:func:`tile_config`);
  * :func:`grouped_matmul_reference`: a dense loop over the groups, for tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .matmul import MatmulConfig, dot_precision, kernel_dot_precision, matmul_config


def _validate(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"grouped matmul needs x [M, K] and w [G, K, N], got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"contraction sizes differ: x {x.shape}, w {w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer array [G] = [{w.shape[0]}], got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype=None) -> jax.Array:
    """``x [M, K]`` (rows sorted by group), ``w [G, K, N]``, ``group_sizes i32[G]`` -> ``[M, N]`` by
    ``jax.lax.ragged_dot``: fp32 accumulation, IEEE fp32 for float32 operands (``HIGHEST``)."""
    _validate(x, w, group_sizes)
    out = lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), precision=dot_precision(x.dtype, w.dtype),
                         preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype=None) -> jax.Array:
    """The same product as a loop over the groups: every row times every group's weight, each row
    keeping its own group's (rows past the groups: zeros). Ground truth for the two above."""
    _validate(x, w, group_sizes)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    rows = jnp.arange(x.shape[0])
    out = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    for g in range(w.shape[0]):
        product = jnp.matmul(x, w[g], preferred_element_type=jnp.float32, precision=dot_precision(x.dtype, w.dtype))
        out = jnp.where(((rows >= starts[g]) & (rows < ends[g]))[:, None], product, out)
    return out.astype(out_dtype or x.dtype)


FP8 = jnp.float8_e4m3fn


# The split-K GEMV's tile (``kernels/gemv.py``: 16 rows, 64 columns, 128 depths a step), which reads
# dense decode weights at their floor: a decode step's few rows an expert get as many programs as the
# GEMV's, where ``matmul_config``'s 64 x 128 tiles gave 12 column tiles an expert and 64-row tiles of
# one or two rows.
FEW_ROWS_TILE = MatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
FEW_ROWS_PER_GROUP = 4  # the most rows per group, on average, that take FEW_ROWS_TILE


def tile_config(m: int, g: int, k: int, n: int, dtype, by_rows: bool = False) -> MatmulConfig:
    """The fixed-tile kernel's configuration for ``m`` rows over ``g`` groups of ``[K, N]`` weights:
    ``matmul_config`` (never a function of ``M``: ``batch_invariant``), or with ``by_rows`` (results may
    then depend on the step's size) :data:`FEW_ROWS_TILE` for 16-bit operands where the groups average
    at most :data:`FEW_ROWS_PER_GROUP` rows (decode steps)."""
    if by_rows and jnp.dtype(dtype) != jnp.float32 and m <= FEW_ROWS_PER_GROUP * g:
        return FEW_ROWS_TILE
    return matmul_config(k, n, dtype)


def fp8_config(k: int, n: int, dtype, base: MatmulConfig | None = None) -> MatmulConfig | None:
    """The fixed-tile configuration for e4m3 weights ``[G, K, N]``: ``base``'s tiles (default
    ``matmul_config``'s), narrowed to divide ``K`` and ``N`` (the weight tiles load without masks: Triton
    cannot fill an e4m3 tile with a constant), or None where that leaves less than 16 (Triton's smallest
    dot)."""
    cfg = base or matmul_config(k, n, dtype)
    block_n, block_k = min(cfg.block_n, n & -n), min(cfg.block_k, k & -k)
    if min(block_n, block_k) < 16:
        return None
    return MatmulConfig(block_m=cfg.block_m, block_n=block_n, block_k=block_k, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)


def fp8_tile(x: jax.Array, w: jax.Array, scale: jax.Array, config: MatmulConfig | None = None,
             by_rows: bool = False) -> MatmulConfig | None:
    """The configuration :func:`grouped_matmul_fixed_tile` reads the e4m3 ``w [G, K, N]`` by, with ``scale
    f32[G, N]`` (per output channel) or ``f32[G, K / g, N]`` (``g`` rows a scale), or None where it cannot:
    ``config`` as given, else ``fp8_config`` of :func:`tile_config`'s tile with ``block_k`` narrowed to
    divide ``g`` (each depth step then meets one scale row)."""
    if w.ndim != 3 or w.dtype != FP8 or scale.dtype != jnp.float32 or x.ndim != 2:
        return None
    g, k, n = w.shape
    cfg = config or fp8_config(k, n, x.dtype, tile_config(x.shape[0], g, k, n, x.dtype, by_rows))
    if cfg is None or k % cfg.block_k or n % cfg.block_n:
        return None
    if scale.shape == (g, n):
        return cfg
    if not (scale.ndim == 3 and scale.shape[::2] == (g, n) and k % scale.shape[1] == 0):
        return None
    rows = k // scale.shape[1]
    if config is None and rows % cfg.block_k and rows & -rows >= 16:
        cfg = dataclasses.replace(cfg, block_k=rows & -rows)
    return cfg if rows % cfg.block_k == 0 else None


def fp8_supported(x: jax.Array, w: jax.Array, scale: jax.Array, config: MatmulConfig | None = None,
                  by_rows: bool = False) -> bool:
    """Whether :func:`grouped_matmul_fixed_tile` (with the same ``config`` and ``by_rows``) reads the e4m3
    ``w`` with its ``scale`` itself (:func:`fp8_tile`)."""
    return fp8_tile(x, w, scale, config, by_rows) is not None


def _grouped_kernel(group_ref, lo_ref, hi_ref, x_ref, w_ref, *refs, cfg: MatmulConfig, precision, scale_rows: int):
    """One ``block_m x block_n`` output tile of rows of one group (``group_ref``, ``lo_ref``, ``hi_ref``:
    each row tile's group and rows ``[lo, hi)``; a tile with no rows does nothing): all of ``K`` in
    ``block_k`` steps in order, times that group's weight only. ``scale_rows``: 0 for a weight in ``x``'s
    dtype; else e4m3 weight tiles (loaded whole, converted) and ``scale [G, scale_rows, N]``: one row
    multiplies the finished product, several multiply each ``block_k`` step's."""
    *scale_ref, o_ref = refs
    k = x_ref.shape[1]
    n = w_ref.shape[2]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tile = pl.program_id(0)
    g, lo, hi = group_ref[tile], lo_ref[tile], hi_ref[tile]
    rows = lo + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    cols = pl.program_id(1) * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    row_ok = rows < hi
    col_ok = cols < n
    depth = lax.broadcasted_iota(jnp.int32, (bk,), 0)

    @pl.when(hi > lo)
    def _():
        def body(step, acc):
            ks = step * bk + depth
            k_ok = ks < k
            x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
            if scale_rows:  # whole tiles (fp8_supported): no mask, no fill value
                w = plgpu.load(w_ref.at[g, ks[:, None], cols[None, :]]).astype(x.dtype)
            else:
                w = plgpu.load(w_ref.at[g, ks[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0)
            part = lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
            if scale_rows > 1:  # this step's depths share one scale row
                part = part * plgpu.load(scale_ref[0].at[g, (step * bk) // (k // scale_rows), cols])[None, :]
            return acc + part

        acc = lax.fori_loop(0, pl.cdiv(k, bk), body, jnp.zeros((bm, bn), jnp.float32))
        if scale_rows == 1:
            acc = acc * plgpu.load(scale_ref[0].at[g, 0, cols])[None, :]
        plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                    mask=row_ok[:, None] & col_ok[None, :])


def row_tiles(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(group, lo, hi)``, each ``i32[cdiv(m, block_m) + G]``: the row tiles of rows sorted by group, each
    tile ``block_m`` rows ``[lo, hi)`` of one group (a group of ``r`` rows has ``cdiv(r, block_m)`` tiles;
    rows past ``m`` are cut). The tiles past the last have ``lo == hi`` (no rows). A static count: at most
    ``cdiv(m, block_m)`` full tiles and one partial tile a group."""
    g = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    counts = (ends - starts + block_m - 1) // block_m
    tile_ends = jnp.cumsum(counts)
    t = jnp.arange(pl.cdiv(m, block_m) + g, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right").astype(jnp.int32), g - 1)
    lo = starts[group] + (t - (tile_ends[group] - counts[group])) * block_m
    valid = t < tile_ends[-1]
    lo = jnp.where(valid, lo, m)
    hi = jnp.where(valid, jnp.minimum(lo + block_m, ends[group]), m)
    return group, lo, hi


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "by_rows", "interpret"))
def grouped_matmul_fixed_tile(x: jax.Array, w: jax.Array, group_sizes: jax.Array, scale: jax.Array | None = None, *,
                              out_dtype=None, config: MatmulConfig | None = None, by_rows: bool = False,
                              interpret: bool = False) -> jax.Array:
    """:func:`grouped_matmul` by the fixed-tile Pallas kernel: each row's result is independent of the
    number of rows and of the other rows' groups (``batch_invariant``) unless ``by_rows``. ``config``
    defaults to :func:`tile_config` (``matmul_config`` of one group's weight, never a function of ``M``;
    with ``by_rows`` a tile chosen by the row count); ``interpret``: Pallas interpret mode (CPU). An e4m3
    ``w`` with its ``scale`` (``fp8_supported``): the real weight is ``w x scale``."""
    _validate(x, w, group_sizes)
    g, k, n = w.shape
    m = x.shape[0]
    if scale is not None:
        cfg = fp8_tile(x, w, scale, config, by_rows)
        if cfg is None:
            raise ValueError(f"the fixed-tile kernel cannot read an e4m3 weight {w.shape} {w.dtype} with scale "
                             f"{scale.shape} {scale.dtype} ({config}): see fp8_tile")
    elif x.dtype != w.dtype:
        raise ValueError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}")
    else:
        cfg = config or tile_config(m, g, k, n, x.dtype, by_rows)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    group, lo, hi = row_tiles(group_sizes, m, cfg.block_m)
    scale_rows = 0 if scale is None else 1 if scale.ndim == 2 else scale.shape[1]
    operands = (group, lo, hi, x, w) + (() if scale is None else (scale.reshape(g, scale_rows, n),))
    kernel = functools.partial(_grouped_kernel, cfg=cfg, precision=kernel_dot_precision(x.dtype), scale_rows=scale_rows)
    out = pl.pallas_call(
        kernel,
        grid=(group.shape[0], pl.cdiv(n, cfg.block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"fixed_tile_grouped_matmul{'_fp8' if scale_rows else ''}_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}",
    )(*operands)
    # Rows past the groups belong to no tile: zeros (the kernel never writes them).
    return jnp.where((jnp.arange(m) < jnp.sum(group_sizes))[:, None], out, jnp.zeros((), out_dtype))
