"""Pallas ragged paged attention (interpret mode on CPU) against the reference; KV write; backend switch.

Every case draws fresh random inputs, places blocks in random physical order and fills every unused
pool slot (spare blocks and the tails of partial blocks) with NaN, so a read past ``kv_lens`` shows up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import attention_backends as backend
from jaxpaged.models import ops
from jaxpaged.kernels.kv_write import pool_from_caches, write_kv, write_kv_donated
from jaxpaged.kernels.paged_attention import AttentionConfig, choose_config, invariant_config, paged_attention
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
from test_reference import random_batch

# Jitted once per shape (as the engine's step runs it): op by op, each call compiled dozens of executables.
reference = jax.jit(paged_attention_reference, static_argnums=2)
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def run_case(seed, q_lens, kv_lens, bs, hq, hkv, d, dtype, config=None, *, kernel=None, interpret=True, **kw):
    """One random batch through ``kernel`` (default: the Triton kernel with ``config``; ``kw`` go to
    ``kernel``) against the reference, stale slots and neighbouring layers NaN; returns the output."""
    if kernel is None:
        kernel, kw = paged_attention, dict(kw, config=config)
    rng = np.random.default_rng(seed)
    q, k, v, cu, kl, tables = random_batch(rng, q_lens, kv_lens, bs, hq, hkv, d)
    # The layer under test sits between two NaN layers: reading any other layer poisons the output.
    layer = pool_from_caches(jnp.asarray(k, dtype), jnp.asarray(v, dtype))
    pool = jnp.concatenate([jnp.full_like(layer, jnp.nan), layer, jnp.full_like(layer, jnp.nan)])
    args = (jnp.asarray(q, dtype), pool, 1, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables))
    out = np.asarray(kernel(*args, interpret=interpret, **kw), np.float32)
    ref = np.asarray(reference(*args), np.float32)
    assert np.all(np.isfinite(out)), "NaN or inf in the output (stale slot read?)"
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel < (1e-6 if dtype == jnp.float32 else 5e-3), rel
    assert np.all(out[cu[-1]:] == 0), "padding tokens must give zeros"
    return out


# Mixed ragged batches (decode + prefill + prefix hits + empty sequences) over block sizes, head dims,
# GQA ratios and dtypes; lengths 1, bs-1, bs, bs+1 and long in each.
MIXED = [
    # (q_lens, kv_lens, bs, hq, hkv, d, dtype)
    ([1, 1, 1, 1, 9, 0, 1], [1, 7, 8, 9, 40, 6, 150], 8, 4, 4, 64, jnp.float32),  # G=1
    ([1, 1, 1, 20, 1, 3], [1, 15, 16, 17, 300, 3], 16, 16, 8, 128, jnp.float32),  # G=2
    ([1, 31, 2, 1, 1, 70], [31, 32, 33, 1, 500, 100], 32, 16, 2, 64, jnp.float32),  # G=8
    ([1, 1, 12, 1, 0, 1], [1, 15, 28, 17, 4, 400], 16, 16, 8, 128, jnp.bfloat16),
    ([5, 1, 1, 33], [12, 7, 9, 33], 8, 8, 1, 128, jnp.bfloat16),  # G=8, MQA
    ([1, 1, 1, 40], [1, 31, 33, 1000], 32, 4, 2, 64, jnp.bfloat16),
    ([2, 1, 17], [2, 100, 30], 16, 6, 2, 64, jnp.float32),  # G=3, not a power of two
]


@pytest.mark.parametrize("case", [c if c < 2 else pytest.param(c, marks=pytest.mark.slow) for c in range(len(MIXED))])
def test_mixed_batch_default_config(case):
    run_case(100 + case, *MIXED[case])


@pytest.mark.parametrize("case", [1, 3, 6])
def test_mixed_batch_batch_invariant_config(case):
    q_lens, kv_lens, bs, hq, hkv, d, dtype = MIXED[case]
    run_case(200 + case, q_lens, kv_lens, bs, hq, hkv, d, dtype, config=invariant_config(hq, hkv, bs))


@pytest.mark.parametrize("bs,hq,hkv,d,dtype", [
    (8, 8, 8, 64, jnp.float32), (16, 16, 8, 128, jnp.bfloat16), (32, 16, 2, 64, jnp.float32),
])
def test_decode_batch_uses_split_k(bs, hq, hkv, d, dtype):
    kv_lens = [1, bs - 1, bs, bs + 1, 7 * bs + 3, 20 * bs]
    config = choose_config(len(kv_lens), len(kv_lens), hq, hkv, bs, 20 * bs)
    assert config.num_splits > 1 and config.block_m == 16
    run_case(7 * bs + hkv, [1] * len(kv_lens), kv_lens, bs, hq, hkv, d, dtype)


@pytest.mark.parametrize("bs,hq,hkv,prefix", [(8, 4, 4, 0), (16, 16, 8, 37), (32, 16, 2, 64)])
def test_prefill_with_and_without_prefix(bs, hq, hkv, prefix):
    q_lens = [70, 33]
    kv_lens = [70 + prefix, 33 + 2 * prefix]
    config = choose_config(sum(q_lens) + 3, 2, hq, hkv, bs, max(kv_lens) + bs)
    assert config.num_splits == 1 and config.reverse_tiles
    run_case(bs + prefix, q_lens, kv_lens, bs, hq, hkv, 64, jnp.float32)


@pytest.mark.parametrize("config", [
    AttentionConfig(block_m=16, block_k=16, num_splits=1, num_warps=4, num_stages=2),
    AttentionConfig(block_m=16, block_k=32, num_splits=8, num_warps=4, num_stages=2),  # many empty splits
    AttentionConfig(block_m=32, block_k=16, num_splits=3, num_warps=4, num_stages=2),
    AttentionConfig(block_m=64, block_k=64, num_splits=1, num_warps=4, num_stages=2, reverse_tiles=True),
    AttentionConfig(block_m=16, block_k=64, num_splits=2, num_warps=4, num_stages=3, mask_loads=False),
    AttentionConfig(block_m=16, block_k=64, num_splits=1, num_warps=4, num_stages=3, reverse_tiles=True,
                    mask_all=True, mask_loads=False),
])
def test_explicit_configs(config):
    q_lens, kv_lens = [1, 19, 1, 0, 6, 1], [1, 40, 16, 5, 17, 130]
    run_case(config.block_m + config.num_splits, q_lens, kv_lens, 16, 8, 4, 64, jnp.float32, config)


def test_only_padding_and_empty_sequences():
    run_case(1, [0, 0], [5, 0], 8, 4, 2, 64, jnp.float32)


def test_invalid_inputs_raise():
    q = jnp.ones((4, 8, 64), jnp.float32)
    kc = jnp.ones((2, 10, 16, 2, 4, 64), jnp.float32)  # pool [L, N, bs, 2, Hkv, D]
    cu, kl, bt = jnp.array([0, 4], jnp.int32), jnp.array([4], jnp.int32), jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(jnp.ones((4, 6, 64)), kc, 0, cu, kl, bt, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(jnp.ones((4, 8, 32)), kc, 0, cu, kl, bt, interpret=True)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, kc, 0, cu.astype(jnp.float32), kl, bt, interpret=True)
    with pytest.raises(ValueError, match="S\\+1"):
        paged_attention(q, kc, 0, jnp.array([0, 2, 4], jnp.int32), kl, bt, interpret=True)
    with pytest.raises(ValueError, match="layer"):
        paged_attention(q, kc, 2, cu, kl, bt, interpret=True)
    with pytest.raises(ValueError, match="kv_pool"):
        paged_attention(q, kc[0], 0, cu, kl, bt, interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        paged_attention(q, kc, 0, cu, kl, bt, interpret=True,
                        config=AttentionConfig(16, 8, 1, 4, 2))
    with pytest.raises(ValueError, match="block_m"):
        paged_attention(q, kc, 0, cu, kl, bt, interpret=True,
                        config=AttentionConfig(24, 16, 1, 4, 2))


def test_write_kv_matches_numpy_and_drops_padding():
    rng = np.random.default_rng(11)
    nl, nb, bs, hkv, d, t = 3, 7, 16, 2, 64, 12
    pool_np = rng.standard_normal((nl, nb, bs, 2, hkv, d)).astype(np.float32)
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in rng.standard_normal((2, t, hkv, d)))
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[[0, 5]] = -1
    expected = pool_np.copy()  # only layer 1 changes
    for i, s in enumerate(slots):
        if s >= 0:
            expected[1, s // bs, s % bs, 0] = np.asarray(k[i], np.float32)
            expected[1, s // bs, s % bs, 1] = np.asarray(v[i], np.float32)
    pool, slots = jnp.asarray(pool_np), jnp.asarray(slots)
    got = jax.jit(write_kv, static_argnums=1)(pool, 1, k, v, slots)
    np.testing.assert_array_equal(np.asarray(got), expected)
    donated = write_kv_donated(pool + 0, 1, k, v, slots)
    np.testing.assert_array_equal(np.asarray(donated), expected)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(pool, 1, k, v, slots[:-1])
    with pytest.raises(ValueError, match="layer"):
        write_kv(pool, 3, k, v, slots)


def test_backend_switch():
    ref_fn = backend.get_attention_fn("reference")
    assert ref_fn is paged_attention_reference
    assert backend.resolve_backend("auto") == ("triton" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        backend.get_attention_fn("pallas")
    rng = np.random.default_rng(5)
    q, k, v, cu, kl, tables = (jnp.asarray(x) for x in random_batch(rng, [1, 3], [9, 3], 8, 4, 2, 64))
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    pool = pool_from_caches(k, v)
    for name in ("triton", "mosaic"):  # Mosaic GPU's interpreter off the GPU
        out = backend.get_attention_fn(name)(q, pool, 0, cu, kl, tables)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_fn(q, pool, 0, cu, kl, tables)), rtol=1e-5,
                                   atol=1e-5)


def test_mosaic_backend_refuses_what_it_cannot_run():
    backend.check_attention_backend("mosaic", jnp.bfloat16, False, 128, 16)
    backend.check_attention_backend("triton", jnp.float8_e4m3fn, True, 32, 256)
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*batch_invariant"):
        backend.check_attention_backend("mosaic", jnp.bfloat16, True, 128, 16)
    backend.check_attention_backend("mosaic", jnp.float8_e4m3fn, False, 128, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*fp8 pool.*block_size"):
        backend.check_attention_backend("mosaic", jnp.float8_e4m3fn, False, 128, 16)
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*bfloat16 activations.*float32"):
        backend.check_attention_backend("mosaic", jnp.float8_e4m3fn, False, 128, 64, jnp.float32)
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*block_size 256"):
        backend.check_attention_backend("mosaic", jnp.bfloat16, False, 128, 256)


def test_launch_configuration_follows_what_the_step_holds():
    """A 64-token prefill chunk padded to 256 sequence slots used to get the decode configuration."""
    padded_guess = choose_config(64, 256, 16, 8, 16, 4096)
    assert padded_guess.block_m == 16 and not padded_guess.reverse_tiles  # T <= 2S: decode tiles
    prefill = choose_config(64, 256, 16, 8, 16, 4096, decode=False)
    assert prefill.block_m >= 64 and prefill.num_splits == 1 and prefill.reverse_tiles
    decode = choose_config(64, 256, 16, 8, 16, 4096, decode=True)
    assert decode.block_m == 16


def test_triton_deprecation_is_said_once_not_warned_at_every_lowering(caplog):
    import logging
    import warnings

    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.INFO, logger="jaxpaged.models.ops"):
        warnings.simplefilter("always")
        ops.prepare_triton_lowering.cache_clear()
        ops.prepare_triton_lowering()
        ops.prepare_triton_lowering()
        for _ in range(3):  # as jax's Triton lowering warns
            warnings.warn(ops.TRITON_DEPRECATION + " and will be removed", DeprecationWarning)
        warnings.warn("another deprecation", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["another deprecation"]
    assert sum("deprecated" in r.getMessage() for r in caplog.records) == 1


def test_triton_dialect_module_is_found_by_mlir_without_failed_imports():
    """Touching a Triton op's owner makes MLIR look up the ``tt`` dialect's Python module; after
    ``prepare_triton_lowering`` that lookup finds it instead of failing (five imports per op before)."""
    import collections
    import importlib._bootstrap as bootstrap

    from jax._src.lib import triton
    from jax._src.lib.mlir import ir

    ops.prepare_triton_lowering.cache_clear()
    ops.prepare_triton_lowering()
    failed = collections.Counter()
    find_and_load = bootstrap._find_and_load

    def counting(name, import_):
        failed[name] += 1
        return find_and_load(name, import_)

    bootstrap._find_and_load = counting
    try:
        with ir.Context() as ctx, ir.Location.unknown():
            triton.dialect.register_dialect(ctx)
            module = ir.Module.create()
            with ir.InsertionPoint(module.body):
                for _ in range(10):
                    assert triton.dialect.get_program_id(0).owner.name == "tt.get_program_id"
    finally:
        bootstrap._find_and_load = find_and_load
    assert not [name for name in failed if name.endswith(".tt")], failed


def test_auto_backend_is_mosaic_for_fp8_pools_on_hopper_only(monkeypatch):
    """``"auto"`` picks the Mosaic GPU kernel over an fp8 pool where it reads it (Hopper, blocks >= 64, bf16
    activations, one device, not batch-invariant), the Triton kernel on other GPU engines."""
    fp8, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    choose = lambda *a, **kw: backend.choose_attention_backend(*a, **kw).name  # noqa: E731
    if jax.default_backend() == "cpu":
        assert choose("auto", fp8, False, 128, 64, bf16) == "reference"
    assert choose("mosaic", fp8, False, 128, 64, bf16) == "mosaic"
    with pytest.raises(ValueError, match="attention_backend='mosaic'.*block_size"):
        choose("mosaic", fp8, False, 128, 16, bf16)

    class Device:
        compute_capability = "9.0"

    monkeypatch.setattr(backend, "_on_gpu", lambda: True)
    monkeypatch.setattr(backend.jax, "devices", lambda *a: [Device()])
    assert choose("auto", fp8, False, 128, 64, bf16) == "mosaic"
    assert choose("auto", jnp.float8_e5m2, False, 64, 128, bf16) == "mosaic"
    assert choose("triton", fp8, False, 128, 64, bf16) == "triton"
    for args in [(bf16, False, 128, 16, bf16), (fp8, True, 128, 64, bf16), (fp8, False, 128, 16, bf16),
                 (fp8, False, 128, 64, jnp.float32), (fp8, False, 256, 64, bf16)]:
        assert choose("auto", *args) == "triton", args
    assert choose("auto", fp8, False, 128, 64, bf16, tensor_parallel_size=2) == "triton"
    Device.compute_capability = "8.0"  # an A100
    assert choose("auto", fp8, False, 128, 64, bf16) == "triton"
