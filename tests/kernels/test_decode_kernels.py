"""The decode-path kernels (interpret mode) against the model's own XLA ops: the split-K GEMV
(``kernels/gemv.py``, also with its SiLU * up prologue), the fused qkv epilogue
(``kernels/qkv_epilogue.py``: partial sums, bias, q/k RMSNorm, RoPE, KV write) and the residual add +
RMSNorm kernel (``kernels/add_rms_norm.py``), and the model run with them against the model run without."""

from __future__ import annotations

import functools


import jax.numpy as jnp
import numpy as np
import pytest

import jax

from jaxpaged.kernels.add_rms_norm import add_rms_norm, add_rms_norm_ops
from jaxpaged.models.ops import fused_qkv, gemv_or_xla_matmul, matmul_parts, silu_mul_matmul_parts
from jaxpaged.kernels.kv_write import write_kv
from jaxpaged.kernels.gemv import GemvConfig, gemv, gemv_config, gemv_partials, sum_partials, supported
from jaxpaged.kernels.qkv_epilogue import qkv_epilogue
from jaxpaged.models.qwen import ModelOps, qkv_epilogue_ops, rms_norm, rope_cos_sin, rotary


def rand(rng, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)


# ---- GEMV ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("m,k,n,splits", [(1, 256, 96, 1), (3, 512, 64, 2), (16, 512, 200, 4), (23, 256, 64, 2)])
def test_gemv_matches_fp32_product(m, k, n, splits, transpose_w):
    rng = np.random.default_rng(m + k + n)
    x = rand(rng, (m, k), jnp.bfloat16)
    w = rand(rng, (n, k) if transpose_w else (k, n), jnp.bfloat16)
    cfg = GemvConfig(block_n=32, block_k=64, splits=splits)
    ref = np.asarray(x, np.float32) @ np.asarray(w.T if transpose_w else w, np.float32)
    out = gemv(x, w, transpose_w=transpose_w, config=cfg, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=1e-2, atol=0.1)
    parts = gemv_partials(x, w, transpose_w=transpose_w, config=cfg, interpret=True)
    assert parts.shape == (splits, m, n) and parts.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(parts).sum(0), ref, rtol=1e-4, atol=1e-3)
    # The summed partials, rounded once, are what gemv returns.
    total = parts[0]
    for s in range(1, splits):
        total = total + parts[s]
    np.testing.assert_array_equal(np.asarray(total.astype(jnp.bfloat16), np.float32), np.asarray(out, np.float32))


def test_gemv_supported_shapes_and_config():
    x, w = jnp.zeros((16, 1024), jnp.bfloat16), jnp.zeros((1024, 4096), jnp.bfloat16)
    assert supported(x, w) and supported(jnp.zeros((32, 1024), jnp.bfloat16), w)
    assert not supported(jnp.zeros((33, 1024), jnp.bfloat16), w)
    assert not supported(x.astype(jnp.float32), w.astype(jnp.float32))  # float32 stays on XLA's IEEE dot
    cfg = gemv_config(1024, 4096)
    assert 1024 % (cfg.splits * cfg.block_k) == 0 and (4096 // cfg.block_n) * cfg.splits >= 256
    assert gemv_config(1024, 4096) == gemv_config(1024, 4096)  # never a function of M
    with pytest.raises(ValueError, match="gemv cannot"):
        gemv(jnp.zeros((40, 256), jnp.bfloat16), jnp.zeros((256, 64), jnp.bfloat16), interpret=True)


def test_gemv_or_xla_matmul_falls_back():
    rng = np.random.default_rng(1)
    x32, w32 = rand(rng, (4, 64)), rand(rng, (64, 48))
    np.testing.assert_allclose(np.asarray(gemv_or_xla_matmul(x32, w32)),
                               np.asarray(x32) @ np.asarray(w32), rtol=1e-5, atol=1e-5)


# ---- qkv epilogue -------------------------------------------------------------------------------
def xla_epilogue(qkv, bias, qn, kn, positions, pool, layer, slots, hq, hkv, d, eps, theta):
    """The model's XLA path for the same stretch, per-op rounding (``rotary(separate_products=True)``)."""
    del hq, hkv, d  # from the shapes
    ops = ModelOps(rotary=functools.partial(rotary, separate_products=True))
    return qkv_epilogue_ops(qkv, bias, qn, kn, positions, pool, layer, slots, eps=eps, theta=theta, ops=ops,
                            write_kv_fn=write_kv)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("num_parts,block_tokens,t", [(1, None, 9), (3, None, 9), (3, 4, 9), (1, None, 40)])
def test_qkv_epilogue_matches_xla_path(dtype, family, num_parts, block_tokens, t):
    """One token per program (the default at 9 tokens), blocks of 4 (the last one partly past the
    step: masked rows read and write nothing) and the default above 32 tokens (blocks of 8) give the
    XLA path's values. Slot 0 is written by token 0 while token 3 (padding, slot -1) shares its block
    of programs: a masked row must not write back over it."""
    rng = np.random.default_rng(7 + num_parts)
    hq, hkv, d, layers, blocks, bs = 6, 2, 32, 3, 8, 4  # 6 q heads: any count (one program per head)
    blocks = max(blocks, -(-t // bs) + 2)
    width = (hq + 2 * hkv) * d
    parts = rand(rng, (num_parts, t, width), jnp.float32 if num_parts > 1 else dtype)
    qkv = parts[0].astype(jnp.float32)
    for p in range(1, num_parts):
        qkv = qkv + parts[p].astype(jnp.float32)
    qkv = qkv.astype(dtype)
    bias = rand(rng, (width,), dtype, 0.5) if family == "qwen2" else None
    qn, kn = (rand(rng, (d,), dtype, 0.3) + 1, rand(rng, (d,), dtype, 0.3) + 1) if family == "qwen3" else (None, None)
    positions = jnp.asarray(rng.integers(0, 5000, t), jnp.int32)
    slots = jnp.asarray(rng.permutation(np.arange(1, blocks * bs))[:t], jnp.int32)
    slots = slots.at[0].set(0).at[3].set(-1)  # slot 0 written next to a padding token (slot -1)
    slots = slots.at[5].set(blocks * bs + 2)  # past the pool: dropped, as write_kv's mode="drop"
    pool = rand(rng, (layers, blocks, bs, 2, hkv, d), dtype)
    want_q, want_pool = xla_epilogue(qkv, bias, qn, kn, positions, pool, 1, slots, hq, hkv, d, 1e-6, 1e6)
    cos, sin = rope_cos_sin(positions, d, 1e6, dtype)
    q, new_pool = qkv_epilogue(parts, bias, qn, kn, cos, sin, pool, 1, slots, eps=1e-6, dtype=dtype,
                               block_tokens=block_tokens, interpret=True)
    assert q.shape == (t, hq, d) and q.dtype == dtype and new_pool.shape == pool.shape
    if dtype == jnp.float32:  # the second product and the add may become one FMA: last-bit differences
        np.testing.assert_allclose(np.asarray(q), np.asarray(want_q), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(new_pool), np.asarray(want_pool), rtol=1e-5, atol=1e-5)
    else:  # 16-bit: every op rounds where the XLA path (separate products) rounds: bitwise equal
        np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))
        np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(want_pool, np.float32))
    # Nothing but the written slots of layer 1 changed; the padding token wrote nothing.
    changed = np.any(np.asarray(new_pool, np.float32) != np.asarray(pool, np.float32), axis=(3, 4, 5))
    written = np.zeros_like(changed)
    for s in np.asarray(slots):
        if 0 <= s < blocks * bs:
            written[1, s // bs, s % bs] = True
    assert not np.any(changed & ~written)


def test_qkv_epilogue_token_block():
    """Decode-sized steps keep one token (one warp) per program; larger steps take 8 tokens per program."""
    from jaxpaged.kernels.qkv_epilogue import token_block
    assert token_block(1) == token_block(32) == (1, 1)
    assert token_block(33) == token_block(8192) == (8, 4)
    assert token_block(256, fp8=True) == token_block(8192, fp8=True) == (1, 1)  # (its docstring: measured)
    with pytest.raises(ValueError, match="block_tokens"):
        qkv_epilogue(jnp.zeros((1, 3, 8 * 32)), None, None, None, jnp.zeros((3, 32)), jnp.zeros((3, 32)),
                     jnp.zeros((1, 2, 4, 2, 2, 32)), 0, jnp.zeros(3, jnp.int32), eps=1e-6, dtype=jnp.float32,
                     block_tokens=3, interpret=True)


def test_qkv_epilogue_rejects_bad_shapes():
    pool = jnp.zeros((1, 2, 4, 2, 2, 32), jnp.float32)
    cos = sin = jnp.zeros((3, 32), jnp.float32)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        qkv_epilogue(jnp.zeros((1, 3, 8 * 32)), None, jnp.ones(32), None, cos, sin, pool, 0,
                     jnp.zeros(3, jnp.int32), eps=1e-6, dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="cos and sin"):
        qkv_epilogue(jnp.zeros((1, 3, 8 * 32)), None, None, None, cos[:2], sin, pool, 0,
                     jnp.zeros(3, jnp.int32), eps=1e-6, dtype=jnp.float32, interpret=True)


def test_qkv_epilogue_checks_shapes_of_weights():
    pool = jnp.zeros((1, 2, 4, 2, 2, 32), jnp.float32)
    cos = sin = jnp.zeros((3, 32), jnp.float32)
    with pytest.raises(ValueError, match="bias must be"):
        qkv_epilogue(jnp.zeros((1, 3, 8 * 32)), jnp.zeros(7), None, None, cos, sin, pool, 0,
                     jnp.zeros(3, jnp.int32), eps=1e-6, dtype=jnp.float32, interpret=True)
    pool48 = jnp.zeros((1, 2, 4, 2, 2, 48), jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        qkv_epilogue(jnp.zeros((1, 3, 8 * 48)), None, None, None, jnp.zeros((3, 48)), jnp.zeros((3, 48)), pool48, 0,
                     jnp.zeros(3, jnp.int32), eps=1e-6, dtype=jnp.float32, interpret=True)


def test_fused_qkv_takes_the_xla_path_for_other_head_dims():
    """A head_dim that is not a power of two (no Triton tile) gets the model's XLA ops, same values."""
    rng = np.random.default_rng(5)
    hq, hkv, d, h, t = 4, 2, 48, 64, 3
    x, w = rand(rng, (t, h)), rand(rng, (h, (hq + 2 * hkv) * d), scale=0.1)
    bias = rand(rng, ((hq + 2 * hkv) * d,))
    positions, slots = jnp.arange(t, dtype=jnp.int32), jnp.arange(t, dtype=jnp.int32) + 1
    pool = jnp.zeros((1, 2, 4, 2, hkv, d), jnp.float32)
    q, new_pool = fused_qkv(x, w, bias, None, None, positions, pool, 0, slots, eps=1e-6, theta=1e4, interpret=True)
    want_q, want_pool = xla_epilogue(jnp.matmul(x, w, precision="highest"), bias, None, None, positions, pool, 0,
                                     slots, hq, hkv, d, 1e-6, 1e4)
    np.testing.assert_allclose(np.asarray(q), np.asarray(want_q), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_pool), np.asarray(want_pool), rtol=1e-5, atol=1e-5)


def test_fused_qkv_matches_model_path_with_gemv():
    """``fused_qkv`` (GEMV partials, 4 splits as for Qwen3-0.6B's qkv -> epilogue) against the GEMV's
    summed product -> the model's ops (separate products), bf16: bitwise equal."""
    rng = np.random.default_rng(3)
    hq, hkv, d, h, t = 4, 2, 64, 1024, 5
    width = (hq + 2 * hkv) * d
    x, w = rand(rng, (t, h), jnp.bfloat16, 0.5), rand(rng, (h, width), jnp.bfloat16, 0.1)
    qn, kn = rand(rng, (d,), jnp.bfloat16, 0.1) + 1, rand(rng, (d,), jnp.bfloat16, 0.1) + 1
    positions = jnp.arange(t, dtype=jnp.int32) + 40
    slots = jnp.arange(t, dtype=jnp.int32) + 2
    pool = jnp.zeros((2, 4, 4, 2, hkv, d), jnp.bfloat16)
    assert gemv_config(h, (hq + 2 * hkv) * d).splits > 1
    q, new_pool = fused_qkv(x, w, None, qn, kn, positions, pool, 0, slots, eps=1e-6, theta=1e4, interpret=True)
    want_q, want_pool = xla_epilogue(gemv(x, w, interpret=True), None, qn, kn, positions, pool, 0, slots,
                                     hq, hkv, d, 1e-6, 1e4)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(np.asarray(new_pool, np.float32), np.asarray(want_pool, np.float32))


# ---- the residual stream's product hooks ----------------------------------------------------------
def test_matmul_parts_and_silu_mul_matmul_parts():
    """GEMV partials (bf16 weights) or XLA's product as one part (float32); the MLP's activation from
    gate/up partials: the sums equal the plain products."""
    rng = np.random.default_rng(2)
    k, n = 512, 128
    w = rand(rng, (k, n), jnp.bfloat16, 0.1)
    for m in (1, 9):
        gate_up = rand(rng, (2, m, 2 * k), jnp.float32, 2.0)
        got = sum_partials(silu_mul_matmul_parts(gate_up, w, interpret=True), jnp.float32)
        gate, up = jnp.split(sum_partials(gate_up, jnp.bfloat16), 2, axis=-1)
        want = np.asarray(jax.nn.silu(gate) * up, np.float32) @ np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)
    x = rand(rng, (3, k), jnp.bfloat16)
    parts = matmul_parts(x, w, interpret=True)
    assert parts.shape[0] == gemv_config(k, n).splits and parts.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(sum_partials(parts, jnp.bfloat16), np.float32),
                                  np.asarray(gemv(x, w, interpret=True), np.float32))
    x32, w32 = rand(rng, (3, 64)), rand(rng, (64, 48))
    parts = matmul_parts(x32, w32, interpret=True)
    assert parts.shape == (1, 3, 48)
    np.testing.assert_allclose(np.asarray(parts[0]), np.asarray(x32) @ np.asarray(w32), rtol=1e-5, atol=1e-5)


# ---- residual add + RMSNorm ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("t,h,num_parts,scale", [(1, 64, 4, 1.0), (13, 96, 1, 1.0), (20, 128, 3, 1.0),
                                                 (3, 896, 2, 1e-3)])  # 1e-3: eps matters
def test_add_rms_norm_matches_xla_path(dtype, t, h, num_parts, scale):
    """Bitwise equal to the model's ops evaluated eagerly in 16-bit dtypes (interpret mode; on the GPU
    the norm's sum, division and rsqrt may differ in the last bit, as the module says); float32 (which
    the engine leaves to XLA) within its last bits: the row sums are ordered differently."""
    rng = np.random.default_rng(t * h + num_parts)
    parts = rand(rng, (num_parts, t, h), jnp.float32 if num_parts > 1 else dtype, scale)
    residual = rand(rng, (t, h), dtype, 3.0 * scale)
    weight = rand(rng, (h,), dtype, 0.2) + 1
    normed, res = add_rms_norm(parts, residual, weight, 1e-6, interpret=True)
    want_normed, want_res = add_rms_norm_ops(parts, residual, weight, 1e-6, rms_norm)
    assert normed.dtype == res.dtype == dtype and normed.shape == res.shape == (t, h)
    np.testing.assert_array_equal(np.asarray(res, np.float32), np.asarray(want_res, np.float32))
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(normed), np.asarray(want_normed), rtol=2e-6, atol=1e-7)
    else:
        np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32))


def test_add_rms_norm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="parts must be"):
        add_rms_norm(jnp.zeros((2, 3, 8)), jnp.zeros((4, 8)), jnp.ones(8), 1e-6, interpret=True)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(jnp.zeros((2, 3, 8)), jnp.zeros((3, 8)), jnp.ones(7), 1e-6, interpret=True)


def test_model_ops_residual_hooks_go_together():
    with pytest.raises(ValueError, match="go together"):
        ModelOps(add_rms_norm=add_rms_norm)
