"""The reference kernels against a dense, per-sequence float64 numpy attention and a plain numpy write."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.kv_write import pool_from_caches
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
from jaxpaged.kernels.paged_attention_reference import token_layout

# Jitted once per shape, as the engine's step runs it (op by op, each call compiled dozens of executables).
reference = jax.jit(paged_attention_reference, static_argnums=2)


def dense_attention(q, k_seq, v_seq, kv_len, scale):
    """``q [n, Hq, D]`` new tokens at the end of ``kv_len`` keys ``k_seq, v_seq [kv_len, Hkv, D]``."""
    n, hq, _ = q.shape
    hkv = k_seq.shape[1]
    k = np.repeat(k_seq, hq // hkv, axis=1)  # repeat_kv order: q head h reads kv head h // G
    v = np.repeat(v_seq, hq // hkv, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    pos = kv_len - n + np.arange(n)
    s = np.where(np.arange(kv_len)[None, None, :] <= pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def random_batch(rng, q_lens, kv_lens, bs, hq, hkv, d, pad_tokens=3, spare_blocks=5):
    """Pool with blocks in random physical order; unused slots and partial tails hold NaN."""
    s = len(q_lens)
    w = max(1, max(math.ceil(k / bs) for k in kv_lens))
    num_blocks = s * w + spare_blocks
    tables = rng.permutation(num_blocks)[: s * w].reshape(s, w).astype(np.int32)
    k = rng.standard_normal((num_blocks, bs, hkv, d))
    v = rng.standard_normal((num_blocks, bs, hkv, d))
    used = np.zeros((num_blocks, bs), bool)
    for i, kl in enumerate(kv_lens):
        p = np.arange(kl)
        used[tables[i, p // bs], p % bs] = True
    k[~used] = np.nan
    v[~used] = np.nan
    q = rng.standard_normal((sum(q_lens) + pad_tokens, hq, d))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, k, v, cu, np.asarray(kv_lens, np.int32), tables


def dense_expected(q, k, v, cu, kv_lens, tables):
    out = np.zeros_like(q)
    bs = k.shape[1]
    for i, kl in enumerate(kv_lens):
        a, b = cu[i], cu[i + 1]
        if b == a:
            continue
        pos = np.arange(kl)
        ks, vs = k[tables[i, pos // bs], pos % bs], v[tables[i, pos // bs], pos % bs]
        out[a:b] = dense_attention(q[a:b], ks, vs, kl, q.shape[-1] ** -0.5)
    return out


@pytest.mark.parametrize(
    "q_lens,kv_lens,bs,hq,hkv,d",
    [
        ([1, 1, 1, 1], [1, 7, 8, 9], 8, 4, 4, 64),  # decode: lengths 1, bs-1, bs, bs+1
        ([5, 0, 16, 1], [5, 3, 40, 77], 16, 8, 4, 64),  # prefill, padding sequence, prefix hit, decode
        ([3, 33], [35, 33], 32, 16, 2, 128),  # GQA 8, prefix hit spanning blocks
        ([2, 1], [2, 100], 16, 6, 2, 64),  # group of 3 (not a power of two)
    ],
)
def test_reference_matches_dense_numpy(q_lens, kv_lens, bs, hq, hkv, d):
    rng = np.random.default_rng(sum(kv_lens) + bs)
    q, k, v, cu, kl, tables = random_batch(rng, q_lens, kv_lens, bs, hq, hkv, d)
    expected = dense_expected(q, k, v, cu, kl, tables)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    out = reference(f32(q), pool_from_caches(f32(k), f32(v)), 0, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables))
    out = np.asarray(out)
    assert np.all(np.isfinite(out)), "NaN from stale slots reached the output"
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert np.all(out[cu[-1]:] == 0), "padding tokens must give zeros"


def test_token_layout():
    cu = jnp.array([0, 2, 2, 5], jnp.int32)
    kv = jnp.array([10, 4, 3], jnp.int32)
    seq, pos, valid = token_layout(cu, kv, 7)
    np.testing.assert_array_equal(np.asarray(seq)[:5], [0, 0, 2, 2, 2])
    np.testing.assert_array_equal(np.asarray(pos)[:5], [8, 9, 0, 1, 2])
    np.testing.assert_array_equal(np.asarray(valid), [1, 1, 1, 1, 1, 0, 0])
