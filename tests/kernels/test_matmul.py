"""Fixed-tile Pallas matmul and row-kernel RMSNorm (interpret mode) against their jnp references, and
the property the batch-invariant mode relies on: a row's result does not depend on how many rows
are computed with it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.matmul import MatmulConfig, matmul
from jaxpaged.kernels.matmul import matmul_reference
from jaxpaged.kernels.rms_norm import rms_norm_reference
from jaxpaged.kernels.rms_norm import rms_norm

SMALL = MatmulConfig(block_m=16, block_n=32, block_k=16)  # several tiles on tiny shapes


def rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 48, 40), (7, 64, 96), (33, 40, 72), (64, 128, 64)])
def test_matmul_matches_reference(m, k, n, transpose_w, dtype):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rand(rng, (m, k), dtype)
    w = rand(rng, (n, k) if transpose_w else (k, n), dtype)
    for out_dtype in (None, jnp.float32):
        out = matmul(x, w, transpose_w=transpose_w, out_dtype=out_dtype, config=SMALL, interpret=True)
        ref = matmul_reference(x, w, transpose_w=transpose_w, out_dtype=out_dtype)
        assert out.shape == (m, n) and out.dtype == ref.dtype
        tol = 1e-5 if dtype == jnp.float32 and out_dtype is None else (1e-5 if out_dtype else 2e-2)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol * 8)


def test_matmul_default_config_matches_reference():
    rng = np.random.default_rng(0)
    x, w = rand(rng, (5, 128), jnp.bfloat16), rand(rng, (128, 200), jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(matmul(x, w, interpret=True), np.float32),
                               np.asarray(matmul_reference(x, w), np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_row_is_bitwise_independent_of_row_count(dtype):
    rng = np.random.default_rng(1)
    x = rand(rng, (64, 80), dtype)
    w = rand(rng, (80, 72), dtype)
    full = np.asarray(matmul(x, w, out_dtype=jnp.float32, config=SMALL, interpret=True))
    for m in (1, 7, 64):
        part = np.asarray(matmul(x[:m], w, out_dtype=jnp.float32, config=SMALL, interpret=True))
        np.testing.assert_array_equal(part, full[:m])
    # The same row at a different offset inside a tile gives the same bits.
    moved = np.asarray(matmul(x[5:12], w, out_dtype=jnp.float32, config=SMALL, interpret=True))
    np.testing.assert_array_equal(moved, full[5:12])


def test_matmul_validation():
    x = jnp.zeros((4, 16), jnp.float32)
    with pytest.raises(ValueError, match="contraction"):
        matmul(x, jnp.zeros((8, 16), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        matmul(x, jnp.zeros((16, 8), jnp.float32), config=MatmulConfig(block_m=24), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128), (7, 96), (3, 5, 32), (40, 128)])
def test_rms_norm_matches_reference_and_is_row_invariant(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    x = rand(rng, shape, dtype) * 3
    w = rand(rng, shape[-1:], dtype)
    out = rms_norm(x, w, 1e-6, interpret=True)
    ref = rms_norm_reference(x, w, 1e-6)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
    flat = np.asarray(out.reshape(-1, shape[-1]), np.float32)
    one = np.asarray(rms_norm(x.reshape(-1, shape[-1])[-1:], w, 1e-6, interpret=True), np.float32)
    np.testing.assert_array_equal(one, flat[-1:])
