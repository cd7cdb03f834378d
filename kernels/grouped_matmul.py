"""The grouped (ragged) GEMM of a mixture-of-experts layer: rows sorted by group, each group times its own weight.

``x [M, K]`` holds rows sorted by group: the first ``group_sizes[0]`` rows belong to group 0, the next
``group_sizes[1]`` to group 1, and so on; rows past ``sum(group_sizes)`` belong to none and come out as
zeros. ``w [G, K, N]`` holds one weight per group. The result is ``[M, N]`` with row ``i`` equal to
``x[i] @ w[group(i)]``. Shapes are static (``M`` is the step's bucket times the experts per token), the
split into groups is data: no shape depends on the routing, so a step compiles once per bucket.

Three implementations, one contract:
  * :func:`grouped_matmul`: ``jax.lax.ragged_dot``, XLA's grouped GEMM (the default);
  * :func:`grouped_matmul_fixed_tile`: a Pallas kernel (Triton lowering) whose row results never depend
    on the other rows, for ``batch_invariant`` (docs/NUMERICS.md): the tiling of ``kernels/matmul.py``
    (fixed ``block_m x block_n`` tiles, all of ``K`` in ``block_k`` steps in order, no split-K); a row tile
    that spans several groups runs one pass per group it meets and keeps, for each row, the pass of its
    own group, so a row is computed by the same instructions on the same values whatever shares its tile.
    It also reads e4m3 weights with their scales (fp8 experts): each tile converted to ``x``'s dtype in
    registers (exact), so only the experts a step's rows meet are read, at a byte a weight;
  * :func:`grouped_matmul_reference`: a dense loop over the groups, for tests.
"""

from __future__ import annotations

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


def fp8_config(k: int, n: int, dtype) -> MatmulConfig | None:
    """The fixed-tile configuration for e4m3 weights ``[G, K, N]``: ``matmul_config``'s tiles, narrowed
    to divide ``K`` and ``N`` (the weight tiles load without masks: Triton cannot fill an e4m3 tile with a
    constant), or None where that leaves less than 16 (Triton's smallest dot)."""
    cfg = matmul_config(k, n, dtype)
    block_n, block_k = min(cfg.block_n, n & -n), min(cfg.block_k, k & -k)
    if min(block_n, block_k) < 16:
        return None
    return MatmulConfig(block_m=cfg.block_m, block_n=block_n, block_k=block_k, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages)


def fp8_supported(x: jax.Array, w: jax.Array, scale: jax.Array, config: MatmulConfig | None = None) -> bool:
    """Whether :func:`grouped_matmul_fixed_tile` reads the e4m3 ``w [G, K, N]`` with ``scale f32[G, N]`` (per
    output channel) or ``f32[G, K / g, N]`` (``g`` rows a scale, a multiple of ``block_k``) itself."""
    if w.ndim != 3 or w.dtype != FP8 or scale.dtype != jnp.float32 or x.ndim != 2:
        return False
    g, k, n = w.shape
    cfg = config or fp8_config(k, n, x.dtype)
    if cfg is None or k % cfg.block_k or n % cfg.block_n:
        return False
    if scale.shape == (g, n):
        return True
    return scale.ndim == 3 and scale.shape[::2] == (g, n) and k % scale.shape[1] == 0 and (
        (k // scale.shape[1]) % cfg.block_k == 0)


def _grouped_kernel(starts_ref, ends_ref, x_ref, w_ref, *refs, cfg: MatmulConfig, precision, scale_rows: int):
    """One ``block_m x block_n`` output tile: for each group whose rows meet the tile (a loop with
    dynamic bounds), all of ``K`` in ``block_k`` steps in order; each row keeps its own group's result.
    ``scale_rows``: 0 for a weight in ``x``'s dtype; else e4m3 weight tiles (loaded whole, converted)
    and ``scale [Gp, scale_rows, N]``: one row multiplies the group's finished product, several multiply
    each ``block_k`` step's."""
    *scale_ref, o_ref = refs
    m, k = x_ref.shape
    n = w_ref.shape[2]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    lo = pl.program_id(0) * bm
    rows = lo + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    cols = pl.program_id(1) * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    row_ok = rows < m
    col_ok = cols < n
    depth = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    starts, ends = starts_ref[...], ends_ref[...]  # [Gp]: nondecreasing; padding groups are empty
    first = jnp.sum((ends <= lo).astype(jnp.int32))  # groups wholly before this tile
    last = jnp.sum((starts < lo + bm).astype(jnp.int32))  # groups starting before its end (exclusive)
    steps = pl.cdiv(k, bk)

    def group(g, out):
        start, end = starts_ref[g], ends_ref[g]
        mine = (rows >= start) & (rows < end)

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

        # An empty group (no rows) runs no step; its pass keeps nothing either way.
        # An int32 product: ``jnp.where`` over two Python ints lowered to an i1 bound that Triton refuses.
        acc = lax.fori_loop(0, steps * (end > start).astype(jnp.int32), body, jnp.zeros((bm, bn), jnp.float32))
        if scale_rows == 1:
            acc = acc * plgpu.load(scale_ref[0].at[g, 0, cols])[None, :]
        return jnp.where(mine[:, None], acc, out)

    out = lax.fori_loop(first, last, group, jnp.zeros((bm, bn), jnp.float32))
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def grouped_matmul_fixed_tile(x: jax.Array, w: jax.Array, group_sizes: jax.Array, scale: jax.Array | None = None, *,
                              out_dtype=None, config: MatmulConfig | None = None, interpret: bool = False) -> jax.Array:
    """:func:`grouped_matmul` by the fixed-tile Pallas kernel: each row's result is independent of the
    number of rows and of the other rows' groups (``batch_invariant``). ``config`` defaults to
    ``matmul_config`` of one group's weight (never a function of ``M``); ``interpret``: Pallas interpret
    mode (CPU). An e4m3 ``w`` with its ``scale`` (``fp8_supported``): the real weight is ``w x scale``."""
    _validate(x, w, group_sizes)
    g, k, n = w.shape
    if scale is not None:
        if not fp8_supported(x, w, scale, config):
            raise ValueError(f"the fixed-tile kernel cannot read an e4m3 weight {w.shape} {w.dtype} with scale "
                             f"{scale.shape} {scale.dtype} ({config}): see fp8_supported")
        cfg = config or fp8_config(k, n, x.dtype)
    elif x.dtype != w.dtype:
        raise ValueError(f"x and w dtypes differ: {x.dtype} vs {w.dtype}")
    else:
        cfg = config or matmul_config(k, n, x.dtype)
    m = x.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    # Group bounds padded to a power of two (Triton's vector shapes); padding groups start and end at M.
    gp = max(16, 1 << (g - 1).bit_length())
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    starts = jnp.full((gp,), m, jnp.int32).at[:g].set(jnp.minimum(starts, m))
    ends = jnp.full((gp,), m, jnp.int32).at[:g].set(jnp.minimum(ends, m))
    scale_rows = 0 if scale is None else 1 if scale.ndim == 2 else scale.shape[1]
    operands = (starts, ends, x, w)
    if scale is not None:  # [Gp, R, N]: a padding group a tile visits loads a row (ones), multiplying zeros
        scale = scale.reshape(g, scale_rows, n)
        operands += (scale if gp == g else jnp.pad(scale, ((0, gp - g), (0, 0), (0, 0)), constant_values=1.0),)
    kernel = functools.partial(_grouped_kernel, cfg=cfg, precision=kernel_dot_precision(x.dtype), scale_rows=scale_rows)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"fixed_tile_grouped_matmul{'_fp8' if scale_rows else ''}_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}",
    )(*operands)
