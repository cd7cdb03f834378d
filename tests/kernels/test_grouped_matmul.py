"""The grouped GEMM of the MoE layer: ``jax.lax.ragged_dot`` and the fixed-tile Pallas kernel (interpret mode)
against the dense loop reference, with groups that get no rows and rows past the groups; the kernel's
rows independent of the other rows (batch invariance)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.grouped_matmul import grouped_matmul, grouped_matmul_fixed_tile, grouped_matmul_reference
from jaxpaged.kernels.matmul import MatmulConfig

SMALL = MatmulConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)  # several tiles, few rows


def operands(m, k, n, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def numpy_grouped(x, w, sizes):
    """Row by row: each row times its own group's weight in float64; rows past the groups zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ w[g]
        start += size
    return out


# (sizes: empty groups first, last and in between; a group spanning tiles; rows left over past the groups)
@pytest.mark.parametrize("dtype,tol,sizes,m", [(jnp.float32, 1e-5, [0, 5, 0, 30, 0, 1, 0], 40),
                                               (jnp.bfloat16, 2e-2, [17, 0, 0, 16], 33),
                                               (jnp.float32, 1e-5, [0, 0, 0], 8)])
def test_implementations_match_reference(dtype, tol, sizes, m):
    x, w, gs = operands(m, 40, 24, sizes, dtype)
    want = numpy_grouped(x, w, sizes)
    ref = np.asarray(jax.jit(grouped_matmul_reference)(x, w, gs), np.float64)
    scale = max(np.abs(want).max(), 1.0)
    assert np.abs(ref - want).max() / scale < tol
    for got in (grouped_matmul(x, w, gs), grouped_matmul_fixed_tile(x, w, gs, config=SMALL, interpret=True)):
        got = np.asarray(got, np.float64)
        assert np.abs(got - ref).max() / scale < tol
        assert np.all(got[sum(sizes):] == 0)  # rows of no group


def test_fixed_tile_rows_independent_of_the_other_rows():
    """A row's result is bitwise the same whatever the number of rows, its place in a tile and the groups
    sharing the tile: the rows of group 2 computed among 3 groups, then with a different first group."""
    x, w, gs = operands(48, 40, 24, [10, 7, 20, 0], jnp.float32, seed=1)
    full = np.asarray(grouped_matmul_fixed_tile(x, w, gs, config=SMALL, interpret=True))
    rows = x[17:37]  # group 2's rows
    alone = grouped_matmul_fixed_tile(rows, w, jnp.asarray([0, 0, 20, 0], jnp.int32), config=SMALL, interpret=True)
    np.testing.assert_array_equal(np.asarray(alone), full[17:37])
    shifted = jnp.concatenate([x[:3], rows])  # 3 rows of group 0 before them: other tile boundaries
    out = grouped_matmul_fixed_tile(shifted, w, jnp.asarray([3, 0, 20, 0], jnp.int32), config=SMALL, interpret=True)
    np.testing.assert_array_equal(np.asarray(out)[3:], full[17:37])


def test_bad_operands_name_what_is_wrong():
    x, w, gs = operands(8, 16, 16, [4, 4], jnp.float32)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, gs[:1])
    with pytest.raises(ValueError, match="contraction"):
        grouped_matmul(x[:, :8], w, gs)
    with pytest.raises(ValueError, match="dtypes differ"):
        grouped_matmul_fixed_tile(x.astype(jnp.bfloat16), w, gs, interpret=True)
