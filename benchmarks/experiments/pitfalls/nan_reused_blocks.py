"""Pitfall: blocks are reused without zeroing, so a stale slot may hold anything, NaN included.

The pool is never cleared (clearing would cost a memory pass per block). A kernel must therefore
mask every key at or past ``kv_lens`` *before* it touches the values: a softmax weight of exactly 0
does not help, because ``0 * NaN = NaN``. Two demonstrations:

1. one attention call over a block whose unused slots hold NaN: the reference kernel (masked values,
   ``kernels/paged_attention_reference.py``) gives finite output; a naive variant that multiplies the probabilities
   by the mask afterwards gives NaN;
2. the engine: greedy tokens from a NaN-poisoned pool, and from blocks reused after other requests,
   equal those from a fresh zeroed pool.

    python benchmarks/experiments/pitfalls/nan_reused_blocks.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import tiny_engine  # noqa: E402

from jaxpaged import SamplingParams  # noqa: E402
from jaxpaged.kernels.kv_write import pool_from_caches  # noqa: E402
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
from jaxpaged.llm import run_to_completion  # noqa: E402


def naive_attention(q, k_cache, v_cache, kv_len: int, block_table):
    """Decode attention for one sequence that masks *after* the softmax: ``p * mask @ V``.
    ``q [Hq, D]``, one layer's caches ``[B, bs, Hkv, D]`` (Hq == Hkv here). Stale NaN values leak through."""
    keys = k_cache[block_table].reshape(-1, *k_cache.shape[2:])  # [W*bs, H, D]
    values = v_cache[block_table].reshape(-1, *v_cache.shape[2:])
    mask = jnp.arange(keys.shape[0]) < kv_len
    scores = jnp.einsum("hd,shd->hs", q, jnp.where(mask[:, None, None], keys, 0)) * q.shape[-1] ** -0.5
    p = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1) * mask[None]  # exact zeros past kv_len
    return jnp.einsum("hs,shd->hd", p, values)  # 0 * NaN = NaN


def kernel_demo() -> dict:
    rng = np.random.default_rng(0)
    bs, heads, dim, kv_len = 16, 2, 32, 20  # 2 blocks; slots 4..15 of the second are stale
    k = rng.standard_normal((4, bs, heads, dim)).astype(np.float32)
    v = rng.standard_normal((4, bs, heads, dim)).astype(np.float32)
    k[2, 4:] = np.nan  # block 2 is the sequence's second block: stale past kv_len
    v[2, 4:] = np.nan
    table = np.array([1, 2], np.int32)
    q = rng.standard_normal((heads, dim)).astype(np.float32)
    ours = paged_attention_reference(jnp.asarray(q[None]), pool_from_caches(jnp.asarray(k), jnp.asarray(v)), 0,
                                     jnp.array([0, 1], jnp.int32),
                                     jnp.array([kv_len], jnp.int32), jnp.asarray(table[None]))[0]
    naive = naive_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_len, jnp.asarray(table))
    return dict(ours_finite=bool(jnp.all(jnp.isfinite(ours))), naive_finite=bool(jnp.all(jnp.isfinite(naive))))


def poison(pool):
    return jnp.full_like(pool, jnp.nan)


def engine_demo() -> dict:
    rng = np.random.default_rng(1)
    first = [list(rng.integers(1, 512, size=n)) for n in (40, 23, 61)]
    later = [list(rng.integers(1, 512, size=n)) for n in (35, 50)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in run_to_completion(tiny_engine(max_model_len=128, num_blocks=16), later, sp)]
    poisoned_engine = tiny_engine(max_model_len=128, num_blocks=16)
    poisoned_engine.kv_pool = poison(poisoned_engine.kv_pool)
    poisoned = [o.outputs[0].token_ids for o in run_to_completion(poisoned_engine, later, sp)]
    reuse_engine = tiny_engine(max_model_len=128, num_blocks=16, enable_prefix_caching=False)
    reuse_engine.kv_pool = poison(reuse_engine.kv_pool)
    run_to_completion(reuse_engine, first, sp)  # fills (and leaves stale) most of the 16 blocks
    reused = [o.outputs[0].token_ids for o in run_to_completion(reuse_engine, later, sp)]
    return dict(poisoned_pool_same_tokens=poisoned == clean, reused_blocks_same_tokens=reused == clean)


def main(argv=None) -> dict:
    k, e = kernel_demo(), engine_demo()
    print(f"attention over a block with NaN past kv_len: masked values (ours) finite: {k['ours_finite']}; "
          f"mask applied to the probabilities only (p * mask @ V) finite: {k['naive_finite']}")
    print(f"engine, greedy tokens: NaN-poisoned pool == fresh pool: {e['poisoned_pool_same_tokens']}; "
          f"blocks reused after other requests == fresh pool: {e['reused_blocks_same_tokens']}")
    return dict(kernel=k, engine=e)


if __name__ == "__main__":
    main()
