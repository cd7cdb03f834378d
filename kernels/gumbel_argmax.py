"""Gumbel-max sampling's argmax over the vocabulary (Pallas, Triton lowering): one pass over the logits
that draws the noise, scales by the temperature and keeps each chunk's best token; XLA then picks the
best of the ``ceil(V / block)`` chunk winners per row.

Why: XLA runs the random-mode sampler (``jaxpaged.sampling.sample``) as two row reductions over the
``[S, V]`` float32 logits; at batch 256 (V = 151,936) they took 154 us of a 4.5 ms decode step on
the H200 (``benchmarks/profile_step.py``, RESULTS.md, session 8), about 3x the time one read of the
logits needs. Here program ``(row, chunk)`` reads ``block`` logits of one row, so every batch size
spreads over the SMs.

Same values as the XLA path: the noise is the same counter-based hash of (seed, counter, token id)
(:func:`gumbel_keys`, :func:`gumbel_from_hash`, shared with ``sampling.gumbel_noise``), the
temperature divides as there, greedy rows (temperature 0) take the logits as they are, and ties go
to the lowest token id as with ``jnp.argmax`` (the first chunk with the best value, then the first
index in it). In interpret mode (CPU) the kernel runs XLA's own ops: tokens equal ``sample``'s
bitwise. On the GPU the kernel's ``log`` is CUDA's ``logf`` and XLA's its own, so a row's noise can
differ from the XLA path's in the last bit: a different token only where two candidates tie to
within that bit. Each row is still a function of its own logits, seed and counter only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK = 4096  # logits per program (16 KB of float32)


def mix32(x: jax.Array) -> jax.Array:
    """A bijective 32-bit finaliser (xor-shift / multiply, MurmurHash3's constants): every input bit
    moves every output bit. ``uint32`` in and out."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_keys(seeds: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two 32-bit row keys ``(key_a, key_b) u32[S]`` of the noise, from ``seeds`` and ``counters``."""
    seeds = seeds.astype(jnp.uint32)
    counters = counters.astype(jnp.uint32)
    key_a = mix32(mix32(seeds ^ jnp.uint32(0x3C6EF372)) ^ counters)
    key_b = mix32(key_a ^ jnp.uint32(0x9E3779B9) ^ (seeds * jnp.uint32(0x7FEB352D)))
    return key_a, key_b


def gumbel_from_hash(cols: jax.Array, key_a: jax.Array, key_b: jax.Array) -> jax.Array:
    """Standard Gumbel noise at token ids ``cols u32`` for row keys ``key_a, key_b`` (broadcast):
    two rounds of :func:`mix32`, the top 23 bits to a uniform in ``(0, 1)`` (never 0 or 1: 23 bits
    plus a half are exact in float32), then ``-log(-log(u))``."""
    x = mix32(mix32(cols * jnp.uint32(0x9E3779B9) ^ key_a) ^ key_b)
    u = ((x >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))  # exact in f32: 2**-24 .. 1 - 2**-24
    return -jnp.log(-jnp.log(u))


def _kernel(logits_ref, temp_ref, key_a_ref, key_b_ref, val_ref, idx_ref, *, block: int):
    row, chunk = pl.program_id(0), pl.program_id(1)
    vocab = logits_ref.shape[1]
    cols = chunk * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    ok = cols < vocab
    logits = plgpu.load(logits_ref.at[row, cols], mask=ok, other=0).astype(jnp.float32)
    t = temp_ref[row]
    noise = gumbel_from_hash(cols.astype(jnp.uint32), key_a_ref[row], key_b_ref[row])
    scaled = logits / jnp.where(t > 0, t, 1.0)
    noisy = jnp.where(t > 0, scaled + noise, logits)
    noisy = jnp.where(ok, noisy, -jnp.inf)
    best = jnp.max(noisy)
    first = jnp.min(jnp.where(ok & (noisy == best), cols, jnp.iinfo(jnp.int32).max))
    val_ref[row, chunk] = best
    idx_ref[row, chunk] = first


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def gumbel_argmax(logits: jax.Array, temperature: jax.Array, seeds: jax.Array, counters: jax.Array, *,
                  block: int = BLOCK, interpret: bool = False) -> jax.Array:
    """``logits [S, V]`` (any float dtype, read as float32), per-row ``temperature f32[S]``, ``seeds``,
    ``counters [S]`` -> ``i32[S]``: ``argmax(logits / T + gumbel)`` for rows with ``T > 0``, else
    ``argmax(logits)`` (``jaxpaged.sampling.sample``'s random mode, without min-p)."""
    if logits.ndim != 2 or temperature.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [S, V] with temperature [S], got {logits.shape} and {temperature.shape}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    num_rows, vocab = logits.shape
    key_a, key_b = gumbel_keys(seeds, counters)
    chunks = pl.cdiv(vocab, block)
    vals, idxs = pl.pallas_call(
        functools.partial(_kernel, block=block),
        grid=(num_rows, chunks),
        out_shape=(jax.ShapeDtypeStruct((num_rows, chunks), jnp.float32),
                   jax.ShapeDtypeStruct((num_rows, chunks), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"gumbel_argmax_b{block}",
    )(logits, temperature.astype(jnp.float32), key_a, key_b)
    best = jnp.argmax(vals, axis=-1)  # the first chunk holding the row's best value
    return jnp.take_along_axis(idxs, best[:, None], axis=-1)[:, 0].astype(jnp.int32)
