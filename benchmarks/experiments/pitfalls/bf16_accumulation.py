"""Pitfall: accumulating attention scores in half precision degrades long sequences.

Attention over ``L`` keys sums ``L`` exponentials (the softmax denominator) and ``L`` weighted value
rows. A bf16 accumulator keeps 8 significant bits: once the running sum is ~256 times a new term,
that term rounds away, so the error grows with ``L``. Our kernels keep scores, running max, sum and
the output accumulator in fp32 whatever the storage dtype (``docs/NUMERICS.md``);
only the inputs (K/V in the pool) and the output are bf16.

Measured here, for one decode query per head (8 heads, head_dim 128) over ``L`` keys of bf16 K/V,
against a float64 computation on the same bf16 inputs: relative error of

* ``fp32 accumulation``: the reference kernel (``kernels/paged_attention_reference.py``), bf16 in, fp32 math;
* ``bf16 accumulation``: the same online softmax over tiles of 16 keys (flash-attention style) with
  scores, running max, running sum and accumulator rounded to bf16 after every tile (written here
  for the demo; no jaxpaged kernel does this).

    python benchmarks/experiments/pitfalls/bf16_accumulation.py [--lengths 256 1024 4096 16384]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.kv_write import pool_from_caches
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference

HEADS, DIM, TILE = 8, 128, 16


def bf16_online_attention(q, k, v):
    """``q [H, D]``, ``k, v [L, H, D]`` (bf16) -> ``[H, D]``; every running quantity kept in bf16."""
    bf = jnp.bfloat16
    scale = jnp.asarray(DIM**-0.5, bf)
    tiles_k = k.reshape(-1, TILE, HEADS, DIM)
    tiles_v = v.reshape(-1, TILE, HEADS, DIM)

    def body(carry, kv):
        m, l, acc = carry
        kt, vt = kv
        s = (jnp.einsum("hd,thd->ht", q, kt, preferred_element_type=bf) * scale).astype(bf)  # [H, TILE]
        m_new = jnp.maximum(m, s.max(-1)).astype(bf)
        corr = jnp.exp(m - m_new).astype(bf)
        p = jnp.exp(s - m_new[:, None]).astype(bf)
        l = (l * corr + p.sum(-1, dtype=bf)).astype(bf)
        acc = (acc * corr[:, None] + jnp.einsum("ht,thd->hd", p, vt, preferred_element_type=bf)).astype(bf)
        return (m_new, l, acc), None

    init = (jnp.full((HEADS,), -jnp.inf, bf), jnp.zeros((HEADS,), bf), jnp.zeros((HEADS, DIM), bf))
    (m, l, acc), _ = jax.lax.scan(body, init, (tiles_k, tiles_v))
    return (acc / l[:, None]).astype(bf)


def fp32_reference(q, k, v):
    """The engine's reference kernel on a one-sequence pool: bf16 storage, fp32 scores/sum/accumulator."""
    length = k.shape[0]
    pool_k = k.reshape(-1, TILE, HEADS, DIM)
    pool_v = v.reshape(-1, TILE, HEADS, DIM)
    table = jnp.arange(pool_k.shape[0], dtype=jnp.int32)[None]
    return paged_attention_reference(q[None], pool_from_caches(pool_k, pool_v), 0, jnp.array([0, 1], jnp.int32),
                                     jnp.array([length], jnp.int32), table)[0]


def float64_truth(q, k, v) -> np.ndarray:
    q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    s = np.einsum("hd,lhd->hl", q, k) * DIM**-0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hl,lhd->hd", p / p.sum(-1, keepdims=True), v)


def rel_err(x, truth: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(x.astype(jnp.float32), np.float64) - truth) / np.linalg.norm(truth))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    args = ap.parse_args(argv)
    rows = []
    key = jax.random.key(0)
    print(f"{'L':>6s} {'fp32 accumulation':>17s} {'bf16 accumulation':>17s}")
    for length in args.lengths:
        kq, kk, kv, key = jax.random.split(key, 4)
        q = jax.random.normal(kq, (HEADS, DIM)).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (length, HEADS, DIM)).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (length, HEADS, DIM)).astype(jnp.bfloat16)
        truth = float64_truth(q, k, v)
        row = dict(length=length, fp32_accumulation=rel_err(fp32_reference(q, k, v), truth),
                   bf16_accumulation=rel_err(bf16_online_attention(q, k, v), truth))
        rows.append(row)
        print(f"{length:6d} {row['fp32_accumulation']:17.2e} {row['bf16_accumulation']:17.2e}")
    print("fp32 accumulation stays at bf16 output rounding (~2e-3); bf16 accumulation grows with L")
    return dict(rows=rows)


if __name__ == "__main__":
    main()
