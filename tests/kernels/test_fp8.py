"""The fp8 KV cache: the number format (kernels/fp8.py), the K/V writes (XLA scatter and the fused qkv
epilogue), and the Pallas attention kernel (interpret mode) against the jnp reference, which
dequantises in fp32. Pools are NaN-poisoned wherever nothing was written, scale rows included."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxpaged.kernels.fp8 import dequantize, exponent_range, quantize, quantize_pool, scale_rows, values_from_slab
from jaxpaged.kernels.kv_write import block_size_of, pool_from_caches, write_kv
from jaxpaged.models.kv_pool import pool_shape
from jaxpaged.kernels.paged_attention import FP8_TILE, choose_config, paged_attention
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
from jaxpaged.kernels.qkv_epilogue import qkv_epilogue
from jaxpaged.models.qwen import rope_cos_sin
from test_decode_kernels import rand, xla_epilogue
from test_reference import random_batch

# Jitted once per shape (as the engine's step runs it): op by op, each call compiled dozens of executables.
reference = jax.jit(paged_attention_reference, static_argnums=2)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MANTISSA_BITS = {E4M3: 3, E5M2: 2}


@settings(max_examples=40, deadline=None)
@given(log_magnitude=st.floats(-12, 14), seed=st.integers(0, 2**16), fp8=st.sampled_from([E4M3, E5M2]))
def test_quantize_error_is_bounded_and_scales_are_powers_of_two(log_magnitude, seed, fp8):
    """Each element within half an fp8 ulp of itself (relative to the row's scale for subnormals); the
    scale a power of two the fp8 format stores exactly; never inf or NaN."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 64)) * 2.0 ** log_magnitude).astype(np.float32)
    x[0] = 0
    q, scale = quantize(jnp.asarray(x), fp8)
    scale = np.asarray(scale)
    assert q.dtype == fp8 and np.all(np.isfinite(np.asarray(q, np.float32)))
    assert np.all(np.exp2(np.round(np.log2(scale))) == scale)
    assert np.all(np.asarray(jnp.asarray(scale).astype(fp8).astype(jnp.float32)) == scale)
    lo, hi = exponent_range(fp8)
    fmax = float(jnp.finfo(fp8).max)
    back = np.asarray(dequantize(q, jnp.asarray(scale)))
    in_range = np.abs(x).max(axis=1) <= fmax * 2.0 ** hi
    ulp_rel = 2.0 ** -(MANTISSA_BITS[fp8] + 1)
    tiny = scale[:, None] * 2.0 ** (lo - 1)  # half the smallest subnormal step, in the row's scale
    err = np.abs(back - x)
    assert np.all((err <= ulp_rel * np.abs(x) + tiny)[in_range])
    assert np.all(back[0] == 0)


def test_quantize_clips_beyond_the_largest_scale():
    x = jnp.asarray([[1e9, -1e9, 1.0, 0.0]], jnp.float32)
    q, scale = quantize(x, E4M3)
    back = np.asarray(dequantize(q, scale))
    assert np.all(np.isfinite(back)) and back[0, 0] == 448 * 2.0 ** 8 and back[0, 1] == -back[0, 0]


@functools.partial(jax.jit, static_argnums=(2, 3, 4))  # (op by op: some 30 executables compiled a call)
def fp8_pool(k, v, fp8, layers=3, layer=1):
    """A pool ``[layers, N, bs + 1, 2, Hkv, D]`` in ``fp8`` whose layer ``layer`` holds ``k, v [N, bs, Hkv, D]``
    quantised per slot and head (values transposed in their slabs), the others NaN; NaN slots (never
    written) get NaN scales."""
    one = quantize_pool(pool_from_caches(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)), fp8)[0]
    n, bs, hkv, d = k.shape
    pool = jnp.full((layers,) + one.shape, jnp.nan, fp8).at[layer].set(one)
    assert pool.shape == pool_shape(layers, n, bs, hkv, d, fp8) and block_size_of(pool) == bs
    return pool


def run_case(seed, q_lens, kv_lens, bs, hq, hkv, d, fp8=E4M3, config=None, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    q, k, v, cu, kl, tables = random_batch(rng, q_lens, kv_lens, bs, hq, hkv, d)
    args = (jnp.asarray(q, dtype), fp8_pool(k * 3, v, fp8), 1, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables))
    out = np.asarray(paged_attention(*args, interpret=True, config=config), np.float32)
    ref = np.asarray(reference(*args), np.float32)
    assert np.all(np.isfinite(out)), "NaN or inf in the output (a stale slot or scale read?)"
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    assert np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30) < 1e-2
    assert np.all(out[cu[-1]:] == 0)
    # and the fp8 cache is close to attention over the unquantised K/V (the format's own error)
    exact = np.asarray(reference(jnp.asarray(q, jnp.float32), fp32_pool(k * 3, v), 0, *args[3:]), np.float32)
    assert np.linalg.norm(out - exact) / max(np.linalg.norm(exact), 1e-30) < (0.06 if fp8 == E4M3 else 0.12)


def fp32_pool(k, v):
    return jnp.stack([jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)], axis=2)[None]


# Ragged batches (decode, prefill, prefix hits, an empty sequence), lengths 1, bs-1, bs, bs+1 and long;
# block size 64 (an fp8 pool's default: a KV tile is one block) and smaller (a block id per slot).
CASES = [
    ([1, 1, 12, 1, 0, 1], [1, 63, 76, 65, 4, 200], 64, 16, 8, 128, E4M3),
    ([5, 1, 1, 33], [12, 31, 33, 300], 32, 8, 1, 64, E5M2),  # MQA
    ([1, 1, 12, 1], [1, 15, 28, 17], 16, 16, 8, 128, E4M3),
    ([1, 7, 1], [130, 70, 64], 128, 8, 2, 128, E5M2),  # two tiles a block; e5m2 through whole-tile reads
]


@pytest.mark.parametrize("case", [0, *(pytest.param(c, marks=pytest.mark.slow) for c in range(1, len(CASES)))])
def test_attention_over_an_fp8_pool_matches_the_reference(case):
    run_case(300 + case, *CASES[case])


def test_fp8_attention_with_queries_beyond_f16_range_matches_the_reference():
    """The kernel multiplies fp8 tiles converted to f16 by f16 queries: bf16 queries past f16's range
    (65504) are divided by a power of two that multiplies the scores back, never inf; all-zero queries
    are not scaled at all."""
    rng = np.random.default_rng(5)
    q, k, v, cu, kl, tables = random_batch(rng, [1, 1, 3], [70, 9, 64], 64, 4, 2, 64)
    q = q * 3e4  # some elements past 65504
    assert np.abs(q).max() > 65504
    q[cu[1]:cu[2]] = 0  # and a sequence whose queries are all zero over large keys (uniform attention, no NaN)
    k[tables[1]] *= 1e6
    args = (jnp.asarray(q, jnp.bfloat16), fp8_pool(k, v, E4M3), 1, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables))
    out = np.asarray(paged_attention(*args, interpret=True), np.float32)
    ref = np.asarray(reference(*args), np.float32)
    assert np.all(np.isfinite(out))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_bf16_queries_over_fp8_keep_batch_invariance_and_rows_independent(fp8):
    """bf16 queries take the kernel's f16 path (each row's queries and V scales normalised per row). In
    the batch-invariant configuration a token computed inside a prefill chunk equals, bitwise, the
    same token decoded alone, even when a later token of its tile has a larger V scale and another
    row of its query tile has huge or non-finite queries; small queries over large keys stay accurate."""
    rng = np.random.default_rng(21)
    hq, hkv, d, bs = 8, 1, 64, 64  # group 8: two tokens per 16-row query tile
    k = rng.standard_normal((2, bs, hkv, d)) * 4
    v = rng.standard_normal((2, bs, hkv, d)) * np.exp(rng.standard_normal((2, bs, 1, 1)))  # scales vary per token
    v[0, 39] *= 64  # the chunk's second token: the largest V scale of the tile
    k[0, 40:], v[0, 40:] = np.nan, np.nan  # stale slots
    k[1], v[1] = np.nan, np.nan
    pool = fp8_pool(k, v, fp8)
    tables = jnp.asarray([[0]], jnp.int32)
    q = rng.standard_normal((2, hq, d))
    for big in (1e9, np.inf):
        q[1, 3] = big  # the second token's fourth head
        qb = jnp.asarray(q, jnp.bfloat16)
        chunk = paged_attention(qb, pool, 1, jnp.asarray([0, 2], jnp.int32), jnp.asarray([40], jnp.int32), tables,
                                interpret=True, batch_invariant=True)
        alone_args = (qb[:1], pool, 1, jnp.asarray([0, 1], jnp.int32), jnp.asarray([39], jnp.int32), tables)
        alone = paged_attention(*alone_args, interpret=True, batch_invariant=True)
        np.testing.assert_array_equal(np.asarray(chunk[0], np.float32), np.asarray(alone[0], np.float32))
        ref = np.asarray(reference(*alone_args), np.float32)
        got = np.asarray(paged_attention(*alone_args, interpret=True), np.float32)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-3
    # queries of order 1e-6 over keys of order 1e6: scaled up into f16's normal range, not flushed
    small_k = np.where(np.isnan(k), np.nan, k * 2.5e5)
    args = (jnp.asarray(q[:1] * 1e-6, jnp.bfloat16), fp8_pool(small_k, v, fp8), 1, jnp.asarray([0, 1], jnp.int32),
            jnp.asarray([39], jnp.int32), tables)
    got, ref = np.asarray(paged_attention(*args, interpret=True), np.float32), np.asarray(reference(*args), np.float32)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-3


@pytest.mark.slow  # (the quick subset keeps the default configuration's check above)
def test_attention_over_an_fp8_pool_every_configuration():
    q_lens, kv_lens, bs, hq, hkv, d = [1] * 6, [1, 15, 64, 65, 60, 150], 64, 8, 2, 64
    decode = choose_config(6, 6, hq, hkv, bs, 320, fp8=True)
    assert decode.num_splits > 1 and decode.block_k == FP8_TILE == 64
    run_case(401, q_lens, kv_lens, bs, hq, hkv, d, config=decode)
    run_case(402, [40, 33], [70, 40], bs, hq, hkv, d,
             config=choose_config(76, 2, hq, hkv, bs, 80, decode=False, fp8=True))
    with pytest.raises(ValueError, match="fp8 pool is read in tiles of 64"):
        run_case(403, [1], [20], bs, hq, hkv, d, config=choose_config(1, 1, hq, hkv, 128, 256))
    # (the batch-invariant configuration: the block-size test below)


@pytest.mark.slow
def test_batch_invariant_attention_over_fp8_pools_of_every_block_size_agrees_bitwise():
    """The same tokens written into fp8 pools of block size 8 (a 64-slot tile spans eight blocks) and 64
    (one block a tile), blocks in random order, NaN wherever nothing was written, read by float32 and
    by bf16 queries (the kernel's f16 path) in the batch-invariant configuration: each matches the
    reference, and the two agree bitwise (the kernel reads 64-slot tiles whatever the block size)."""
    rng = np.random.default_rng(11)
    hq, hkv, d, q_lens, kv_lens = 8, 2, 64, [1, 5, 1], [70, 5, 20]
    k = rand(rng, (sum(kv_lens), hkv, d), jnp.bfloat16, 3.0)
    v = rand(rng, (sum(kv_lens), hkv, d), jnp.bfloat16)
    q32 = rand(rng, (sum(q_lens) + 2, hq, d), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    outs = []
    for q, bs in ((q32, 8), (q32, 64), (q32.astype(jnp.bfloat16), 8), (q32.astype(jnp.bfloat16), 64)):
        width = max(-(-n // bs) for n in kv_lens)
        n = len(kv_lens) * width + 2
        tables = rng.permutation(n)[: len(kv_lens) * width].reshape(len(kv_lens), width).astype(np.int32)
        slots = np.concatenate([tables[i, np.arange(kl) // bs] * bs + np.arange(kl) % bs
                                for i, kl in enumerate(kv_lens)]).astype(np.int32)
        pool = jnp.full(pool_shape(1, n, bs, hkv, d, E4M3), jnp.nan, E4M3)
        pool = write_kv(pool, 0, k, v, jnp.asarray(slots))
        args = (q, pool, 0, cu, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables))
        outs.append(np.asarray(paged_attention(*args, interpret=True, batch_invariant=True), np.float32))
        np.testing.assert_allclose(outs[-1], np.asarray(reference(*args), np.float32),
                                   rtol=2e-2, atol=2e-2)
    assert np.all(np.isfinite(outs[0])) and np.all(np.isfinite(outs[2]))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[2], outs[3])


def test_write_kv_quantises_each_token_into_the_scale_row():
    rng = np.random.default_rng(3)
    layers, n, bs, hkv, d, t = 2, 5, 8, 2, 32, 9
    pool = jnp.zeros(pool_shape(layers, n, bs, hkv, d, E4M3), E4M3)
    k, v = rand(rng, (t, hkv, d), jnp.bfloat16, 4.0), rand(rng, (t, hkv, d), jnp.bfloat16, 0.01)
    slots = jnp.asarray(rng.permutation(n * bs)[:t], jnp.int32).at[2].set(-1)
    new = write_kv(pool, 1, k, v, slots)
    assert new.shape == pool.shape and new.dtype == E4M3 and scale_rows(new.dtype) == 1
    for i, s in enumerate(np.asarray(slots)):
        if s < 0:
            continue
        blk, off = s // bs, s % bs
        for kv, x in ((0, k[i]), (1, v[i])):
            want_q, want_s = quantize(x, E4M3)
            got = new[1, blk, off, 0] if kv == 0 else values_from_slab(new[1, blk, :bs, 1])[off]
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want_q, np.float32))
            np.testing.assert_array_equal(np.asarray(new[1, blk, bs, kv, :, off], np.float32), np.asarray(want_s))
    # nothing else changed: keys by slot, values by slot once un-transposed, scales by slot
    written = np.zeros((layers, n, bs), bool)
    for s in np.asarray(slots):
        if s >= 0:
            written[1, s // bs, s % bs] = True
    pool_f = np.asarray(new, np.float32)
    keys_changed = np.any(pool_f[:, :, :bs, 0] != 0, axis=(3, 4))
    values_changed = np.any(np.asarray(values_from_slab(new[:, :, :bs, 1]), np.float32) != 0, axis=(3, 4))
    scales_changed = np.any(np.moveaxis(pool_f[:, :, bs, :, :, :bs], -1, 2) != 0, axis=(3, 4))
    assert not np.any(pool_f[:, :, bs, :, :, bs:] != 0)
    for changed in (keys_changed, values_changed, scales_changed):
        assert not np.any(changed & ~written)
    with pytest.raises(ValueError, match="block_size must be <= 32"):
        pool_shape(1, 4, 64, 2, 32, E4M3)


@pytest.mark.parametrize("family,t", [("qwen3", 5), pytest.param("qwen2", 11, marks=pytest.mark.slow)])
def test_fused_qkv_epilogue_writes_what_write_kv_writes(family, t):
    """The GPU's fused qkv epilogue (interpret mode) quantises exactly as the XLA path: pools bitwise equal."""
    rng = np.random.default_rng(9 + t)
    hq, hkv, d, layers, blocks, bs = 6, 2, 32, 2, 6, 8
    width = (hq + 2 * hkv) * d
    qkv = rand(rng, (t, width), jnp.bfloat16, 3.0)
    bias = rand(rng, (width,), jnp.bfloat16, 0.5) if family == "qwen2" else None
    qn, kn = (rand(rng, (d,), jnp.bfloat16, 0.3) + 1, rand(rng, (d,), jnp.bfloat16, 0.3) + 1) \
        if family == "qwen3" else (None, None)
    positions = jnp.asarray(rng.integers(0, 5000, t), jnp.int32)
    slots = jnp.asarray(rng.permutation(blocks * bs)[:t], jnp.int32).at[1].set(-1)
    pool = jnp.full(pool_shape(layers, blocks, bs, hkv, d, E4M3), jnp.nan, E4M3)
    want_q, want_pool = xla_epilogue(qkv, bias, qn, kn, positions, pool, 1, slots, hq, hkv, d, 1e-6, 1e6)
    cos, sin = rope_cos_sin(positions, d, 1e6, jnp.bfloat16)
    q, got_pool = qkv_epilogue(qkv[None], bias, qn, kn, cos, sin, pool, 1, slots, eps=1e-6, dtype=jnp.bfloat16,
                               interpret=True)
    np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))
    got, want = np.asarray(got_pool, np.float32), np.asarray(want_pool, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))
    assert not np.all(np.isnan(got[1]))


@pytest.mark.parametrize("gib, fused", [(1, True), (3, True), (4.5, True)])
def test_the_fused_kv_write_takes_fp8_pools_of_any_size(gib, fused):
    """``models.ops.fused_qkv`` runs the fused epilogue kernel (Triton) over fp8 pools below 2, between 2
    and 4 and above 4 GiB (``kv_write.widen_triton_offsets``), not XLA's ops: traced only, nothing allocated."""
    from jaxpaged.models.ops import fused_qkv

    hq, hkv, d, t = 16, 8, 128, 4
    s = jax.ShapeDtypeStruct
    pool = s(pool_shape(28, int(gib * 2**30 // (28 * 65 * 2 * hkv * d)), 64, hkv, d, E4M3), E4M3)
    args = (s((t, 1024), jnp.bfloat16), s((1024, (hq + 2 * hkv) * d), jnp.bfloat16), None, s((d,), jnp.bfloat16),
            s((d,), jnp.bfloat16), s((t,), jnp.int32), pool, 3, s((t,), jnp.int32))
    jaxpr = jax.make_jaxpr(lambda *a: fused_qkv(*a[:7], 3, a[8], eps=1e-6, theta=1e6))(*args[:7], 3, args[8])
    assert ("qkv_epilogue" in str(jaxpr)) == fused
    assert ("scatter" in str(jaxpr)) != fused


def test_triton_lowering_addresses_fp8_pools_of_any_size(sm90_triton_modules):
    """jax's Pallas-Triton lowering picks 64-bit offsets only for an array of more than 2**32 bytes, so a
    3 GiB fp8 pool (1.5 x 2**31 elements) would get 32-bit offsets, which Triton sign-extends: its second
    half addressed below its start. ``kv_write.widen_triton_offsets`` makes it pick 64-bit offsets past
    2**31 elements: the attention kernel, lowered for an sm_90 GPU here without one (no pool is
    allocated), addresses a 1 GiB pool with 32-bit offsets and pools of 3 and 4.5 GiB with 64-bit ones."""
    from jaxpaged.kernels import kv_write, paged_attention as module

    assert kv_write.pallas_addressable(3 << 30, 1) and kv_write.widen_triton_offsets()
    modules = sm90_triton_modules
    s, w = jax.ShapeDtypeStruct, 8
    args = [s((4, 4, 128), jnp.bfloat16), None, s((), jnp.int32), s((5,), jnp.int32), s((4,), jnp.int32),
            s((4, w), jnp.int32)]
    pool = lambda gib: s((28, int(gib * 2**30 // (28 * 65 * 2 * 2 * 128)), 65, 2, 2, 128), jnp.float8_e4m3fn)  # noqa: E731
    offset_bits = {}
    for gib in (1, 3, 4.5):
        args[1] = pool(gib)  # 28 layers, 2 KV heads, head_dim 128
        modules.clear()
        jax.jit(module.paged_attention).trace(*args).lower(lowering_platforms=("cuda",))
        pointers = [line for line in modules[0].splitlines() if "tt.addptr" in line and "f8E4M3FN" in line]
        assert pointers  # the pool's K, V and scale loads
        offset_bits[gib] = {64 if "xi64>" in line or ": i64" in line else 32 for line in pointers}
    assert offset_bits == {1: {32}, 3: {64}, 4.5: {64}}, offset_bits


# The Mosaic GPU kernels over fp8 pools (their CPU interpreter): one pool block a KV tile (64 slots, the fp8
# default; 128); decode steps (``uniform_decode``: kernels/mosaic/decode.py) with split-K and
# without, and G = 7, whose last token's rows are read from before its own (its R = 8 rows would pass the end
# of q); a decode-shaped launch not marked so, holding a short chunk (the query tiles); a short
# launch that is not decode-shaped (the query tiles, split); prefill launches
# on the warp-specialised kernel (kernels/mosaic/prefill.py: each compute warpgroup converts
# the tiles and zeroes its own stale values) with prefix hits, the causal diagonal inside a block, a
# sequence's last key mid-block, G = 7, and the one-warpgroup kernel's prefill tiles.
MOSAIC_CASES = [
    ([1, 1, 1, 1], [1, 63, 64, 300], 64, 4, 2, 128, E4M3, dict(uniform_decode=True, num_splits=2)),  # split-K
    ([1, 20, 0, 5], [9, 100, 4, 5], 64, 4, 2, 64, E5M2, dict(block_q=32)),  # one-warpgroup prefill tiles
    ([1, 1], [127, 300], 128, 8, 1, 128, E4M3, dict(uniform_decode=True, num_splits=1)),  # MQA, blocks of 128
    ([1] * 5, [7, 64, 129, 300, 65], 64, 14, 2, 64, E4M3, dict(uniform_decode=True, num_splits=1)),  # G = 7
    ([1] * 3, [5, 64, 200], 64, 4, 1, 64, E5M2, dict(uniform_decode=True, num_splits=1)),  # e5m2: a tile's largest
    ([2, 1, 1, 0], [130, 64, 9, 4], 64, 4, 2, 64, E4M3, {}),  # decode-shaped, a chunk: the query tiles
    ([9, 0], [140, 4], 64, 4, 2, 64, E4M3, {}),  # 9 tokens of 2 sequences: the query tiles, split
    ([150, 1, 40], [150, 9, 300], 64, 4, 2, 64, E4M3, {}),  # warp-specialised: pairs, prefix, mid-block ends
    ([100, 13, 3], [230, 13, 40], 64, 14, 2, 64, E5M2, {}),  # G = 7 over e5m2 (each tile's largest V scale)
    ([129, 7], [200, 7], 128, 2, 2, 128, E4M3, {}),  # blocks of 128: the one-warpgroup kernel (shared memory)
    ([40, 9], [100, 70], 64, 4, 2, 64, E4M3, dict(num_slots=1)),  # one slot: the one-warpgroup kernel
]


@pytest.mark.parametrize("case", [0, 1, pytest.param(2, marks=pytest.mark.slow), 3, 4, 5, 6, 7, 8,
                                  pytest.param(9, marks=pytest.mark.slow), 10])
def test_mosaic_attention_over_an_fp8_pool_matches_the_reference(case):
    """Every slot nothing was written to is NaN, its scale too; the kernel converts the fp8 tiles to f16
    exactly and applies the scales to the scores' and probabilities' columns (module docstring)."""
    from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu

    q_lens, kv_lens, bs, hq, hkv, d, fp8, kw = MOSAIC_CASES[case]
    rng = np.random.default_rng(500 + case)
    q, k, v, cu, kl, tables = random_batch(rng, q_lens, kv_lens, bs, hq, hkv, d)
    v = v * np.exp(2 * rng.standard_normal((k.shape[0], bs, 1, 1)))  # V scales that vary from token to token
    args = (jnp.asarray(q * 50, jnp.bfloat16), fp8_pool(k * 3, v, fp8), 1, jnp.asarray(cu), jnp.asarray(kl),
            jnp.asarray(tables))
    out = np.asarray(paged_attention_mgpu(*args, interpret=True, **kw), np.float32)
    ref = np.asarray(reference(*args), np.float32)
    assert np.all(np.isfinite(out)), "NaN or inf in the output (a stale slot or scale read?)"
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3
    assert np.all(out[cu[-1]:] == 0)


@pytest.mark.slow
def test_mosaic_prefill_over_fp8_has_no_shared_memory_races():
    """The interpreter's race detector over the warp-specialised kernel's fp8 path: the memory warpgroup
    copies fp8 slots the two compute warpgroups each convert into tiles of their own."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu

    rng = np.random.default_rng(9)
    q, k, v, cu, kl, tables = random_batch(rng, [70, 1, 9], [100, 200, 70], 64, 4, 2, 64)
    args = (jnp.asarray(q, jnp.bfloat16), fp8_pool(k, v, E4M3), 1, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables))
    out = paged_attention_mgpu(*args, interpret=plgpu.InterpretGPUParams(detect_races=True), decode=False)
    assert not gpu_interpret.get_races().races_found
    ref = np.asarray(reference(*args), np.float32)
    assert np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref) < 2e-3


def test_mosaic_decode_shifts_e4m3_v_scales_by_a_constant_across_their_whole_range():
    """Over e4m3 the decode kernel multiplies P by its V scales times 2^7 instead of dividing by each tile's
    largest scale: V rows whose scales sit at both ends of e4m3's range (2^-9 and 2^8) in one tile must
    neither overflow f16 (P V-scale 2^7 <= 2^15) nor lose the small rows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxpaged.kernels.mosaic.decode import paged_decode_mgpu, v_shift

    assert v_shift(E4M3) == 7 and v_shift(E5M2) is None
    lo, hi = exponent_range(E4M3)
    rng = np.random.default_rng(7)
    q, k, v, cu, kl, tables = random_batch(rng, [1, 1], [64, 130], 64, 4, 2, 64)
    v = v / np.abs(v).max(-1, keepdims=True)  # rows of largest magnitude 1, then times 448 x 2^e:
    e = rng.choice([lo - 2, lo, 0, hi - 1, hi], size=v.shape[:-1] + (1,))  # scales 2^-9 .. 2^8 in one tile
    e[tables[0, 0]] = lo - 3  # the first sequence: every row at the smallest scale
    v = v * 448.0 * 2.0 ** e
    args = (jnp.asarray(q * 20, jnp.bfloat16), fp8_pool(k, v, E4M3), 1, jnp.asarray(cu), jnp.asarray(kl),
            jnp.asarray(tables))
    out = np.asarray(paged_decode_mgpu(*args[:2], jnp.int32(1), *args[3:], scale=64 ** -0.5,
                                       interpret=plgpu.InterpretGPUParams(), block_kv=64, num_slots=2, num_splits=1),
                     np.float32)
    ref = np.asarray(paged_attention_reference(*args), np.float32)
    assert np.all(np.isfinite(out)), "f16 overflow (P times a V scale past 65,504?)"
    for t in range(2):  # each sequence against its own size (the first one's outputs are ~2^-20 of the second's)
        assert np.linalg.norm(out[t] - ref[t]) / np.linalg.norm(ref[t]) < 2e-3, t


def test_mosaic_kernel_over_fp8_lowers_for_hopper_and_refuses_what_it_cannot_read():
    from test_paged_attention_mgpu import kernel_names

    from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu

    if jax.default_backend() != "cpu":
        pytest.skip("cross-lowering check for machines without a GPU")
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    q = jax.ShapeDtypeStruct((4, 16, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct(pool_shape(3, 64, 64, 8, 128, E4M3), E4M3)
    fn = jax.jit(lambda *a, **kw: paged_attention_mgpu(a[0], a[1], 2, *a[2:], **kw), static_argnames="uniform_decode")
    text = fn.trace(q, pool, i32(5), i32(4), i32(4, 20), uniform_decode=True).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text
    assert kernel_names(text) == ["paged_decode_fp8"]
    # decode-shaped but unmarked (a prompt chunk, maybe after a cached prefix), and a short launch that
    # is not (32 tokens of 4 sequences): the query tiles
    text = fn.trace(q, pool, i32(5), i32(4), i32(4, 20)).lower(lowering_platforms=("cuda",)).as_text()
    assert kernel_names(text) == ["paged_attention_tiles"]
    text = fn.trace(q.update(shape=(32, 16, 128)), pool, i32(5), i32(4), i32(4, 20)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert kernel_names(text) == ["paged_attention_tiles"]
    # a prefill launch: the warp-specialised kernel over the fp8 pool
    text = fn.trace(q.update(shape=(256, 16, 128)), pool, i32(5), i32(4), i32(4, 20)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text
    assert kernel_names(text) == ["paged_prefill"]
    # a 3 GiB pool (1.5 x 2**31 one-byte elements: past the Triton kernels' 32-bit offsets) lowers too
    big = jax.ShapeDtypeStruct(pool_shape(28, 864, 64, 8, 128, E4M3), E4M3)
    assert 2**31 < big.size <= 2**32
    text = fn.trace(q, big, i32(5), i32(4), i32(4, 20), uniform_decode=True).lower(
        lowering_platforms=("cuda",)).as_text()
    assert kernel_names(text) == ["paged_decode_fp8"]
    small = jnp.zeros(pool_shape(1, 4, 16, 1, 64, E4M3), E4M3)
    meta = (jnp.asarray([0, 1], jnp.int32), jnp.asarray([3], jnp.int32), jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(ValueError, match="one block a KV tile"):
        paged_attention_mgpu(jnp.zeros((1, 2, 64), jnp.bfloat16), small, 0, *meta, interpret=True)
    with pytest.raises(ValueError, match="must be bfloat16 over an fp8 pool"):
        paged_attention_mgpu(jnp.zeros((1, 2, 64), jnp.float32), small, 0, *meta, interpret=True)
