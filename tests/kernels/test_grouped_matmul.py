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


def test_the_tile_follows_the_row_count_only_where_asked():
    """``by_rows``: the decode tile where the groups average at most FEW_ROWS_PER_GROUP rows (16-bit
    operands), ``matmul_config`` otherwise; without it always ``matmul_config`` (batch invariance)."""
    from jaxpaged.kernels.grouped_matmul import FEW_ROWS_PER_GROUP, FEW_ROWS_TILE, tile_config
    from jaxpaged.kernels.matmul import matmul_config

    default = matmul_config(2048, 1536, jnp.bfloat16)
    decode_rows = 64 * 8  # Qwen3-30B-A3B: 64 tokens, 8 experts each, over 128 experts
    assert tile_config(decode_rows, 128, 2048, 1536, jnp.bfloat16, by_rows=True) == FEW_ROWS_TILE
    assert tile_config(FEW_ROWS_PER_GROUP * 128 + 1, 128, 2048, 1536, jnp.bfloat16, by_rows=True) == default
    assert tile_config(8, 128, 2048, 1536, jnp.bfloat16) == default
    assert tile_config(8, 128, 64, 64, jnp.float32, by_rows=True) == matmul_config(64, 64, jnp.float32)


@pytest.mark.parametrize("sizes,m", [([0, 1, 0, 2, 0, 3], 8), ([5, 0, 0, 0, 0, 2], 7)])
def test_the_decode_tile_matches_the_reference(sizes, m):
    """The decode tile (16 x 64 x 128) over few rows a group, with several column tiles and depth steps,
    empty groups and rows past the groups: the dense loop's result (interpret mode)."""
    x, w, gs = operands(m, 256, 192, sizes, jnp.bfloat16, seed=2)
    got = np.asarray(grouped_matmul_fixed_tile(x, w, gs, by_rows=True, interpret=True), np.float64)
    ref = np.asarray(grouped_matmul_reference(x, w, gs), np.float64)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-2
    assert np.all(got[sum(sizes):] == 0)


def test_the_decode_tile_lowers_for_hopper(sm90_triton_modules):
    """A decode step's gate/up product at Qwen3-30B-A3B shapes (8 tokens x 8 experts over 128 experts) by
    the decode tile, lowered to Triton IR for an sm_90 GPU (and verified) without one."""
    s = jax.ShapeDtypeStruct
    lowered = jax.jit(grouped_matmul_fixed_tile, static_argnames="by_rows").trace(
        s((64, 2048), jnp.bfloat16), s((128, 2048, 1536), jnp.bfloat16), s((128,), jnp.int32), by_rows=True)
    lowered.lower(lowering_platforms=("cuda",))
    (module,) = sm90_triton_modules
    assert "fixed_tile_grouped_matmul_m16_n64_k128" in module and "tt.dot" in module


def test_the_gpu_ops_take_the_decode_tile_for_decode_steps_and_not_when_batch_invariant(monkeypatch):
    """The ops a GPU gets (traced here, not run): a decode step's experts by the decode tile, a prefill
    chunk's by ``matmul_config``'s, and with ``batch_invariant`` always ``matmul_config``'s."""
    from jaxpaged.models import ops

    monkeypatch.setattr(ops, "_on_gpu", lambda: True)
    monkeypatch.setattr(ops, "prepare_triton_lowering", lambda: None)
    w, gs = jnp.zeros((128, 256, 128), jnp.bfloat16), jnp.zeros((128,), jnp.int32)

    def kernel(invariant: bool, rows: int) -> str:
        grouped = ops.get_model_ops.__wrapped__(invariant).grouped_matmul
        return str(jax.make_jaxpr(lambda x: grouped(x, w, gs))(jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16)))

    assert "grouped_matmul_m16_n64_k128" in kernel(False, 8 * 8)
    assert "grouped_matmul_m64_n128_k64" in kernel(False, 512 * 8)
    assert "grouped_matmul_m64_n128_k64" in kernel(True, 8 * 8)
