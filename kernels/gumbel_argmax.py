"""Gumbel-max sampling's noise and its argmax over the vocabulary (Pallas, Triton lowering): one pass
over the logits, each program a row's run of ``steps`` chunks of ``block`` logits, then XLA picks the
best of a row's part winners.

Why: XLA's sampler (two row reductions over the ``[S, V]`` float32 logits, drawing the noise in the
first) took a few times a bare argmax's time, a visible share of a batch-256 decode step
(docs/DECISIONS.md). The pass is bound by arithmetic, not
by the read: two accurate ``logf`` per logit (~20 instructions each), a correctly rounded division by
the temperature and the hash. A Pallas pass with the same arithmetic was no faster. This one
draws the same kind of noise with far fewer instructions:

  * the temperature is a multiplication by ``1 / T`` (computed once per row by the caller);
  * ``-log`` of the uniform uses the hardware's base-2 logarithm (``lg2.approx.ftz.f32``, one special
    function unit instruction, relative error ~2**-22) where that is accurate, and a 6-term series of
    ``-log(1 - w)`` for ``w = 1 - u < 1/16`` (truncation below 1e-8 relative), where ``log(u)`` of a
    ``u`` next to 1 would lose the digits that decide the largest noises (the winners);
  * greedy rows (``1 / T == 0``) skip the noise and take the argmax of their logits.

The noise (:func:`gumbel_from_bits`) is defined once, with the logarithm passed in: XLA's path
(``jaxpaged.sampling.sampler``, used off the GPU) and this kernel in interpret mode compute it with
``jnp.log2`` and agree bitwise; on the GPU the kernel's ``lg2.approx`` moves a noise by ~2e-6 at most,
which changes a token only where two candidates tie to that precision. Each row depends on its own
logits, ``1 / T``, seed and counter only (batch invariant). Ties go to the lowest token id and a NaN
beats every number, as with ``jnp.argmax``: values are compared as ``int32`` order keys
(:func:`order_key`: NaN above ``+inf``, ``-0 == +0``), each lane keeps its first best across its
chunks, then one max and one min over the lanes give a part's winner (two block reductions; four, to
handle NaN on the float values, made the pass slower).

The multiplication by ``1 / T`` is ``mul.rn.f32`` on the GPU (no fused multiply-add with the noise), so
``x * (1 / T) + g`` is rounded exactly as XLA's ``scaled = x * (1 / T)`` followed by ``scaled * 1 + g``:
the filtered sampler modes pass their pre-scaled, masked logits with ``1 / T = 1`` and get the same
token as the random mode for every row that filters nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpaged.kernels.shapes import is_pow2, num_cores

LN2 = 0.6931471805599453
SERIES_BELOW = 1.0 / 16  # w = 1 - u below this: -log(u) from its series (see the module docstring)


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


def uniform_bits(cols: jax.Array, key_a: jax.Array, key_b: jax.Array) -> jax.Array:
    """23 random bits ``u32`` per token id ``cols u32`` (broadcast with the row keys): two rounds of
    :func:`mix32`, the top 23 bits kept."""
    return mix32(mix32(cols * jnp.uint32(0x9E3779B9) ^ key_a) ^ key_b) >> 9


def gumbel_from_bits(bits: jax.Array, log2: Callable[[jax.Array], jax.Array] = jnp.log2) -> jax.Array:
    """Standard Gumbel noise ``-log(-log(u))`` from 23 bits: ``u = (bits + 0.5) / 2**23`` in ``(0, 1)``
    (never 0 or 1) and ``w = 1 - u``, both exact in float32. ``E = -log(u)`` is the series
    ``w + w**2/2 + ... + w**6/6`` for ``w < 1/16`` and ``-ln 2 * log2(u)`` otherwise; the noise is
    ``-ln 2 * log2(E)``. ``log2``: ``jnp.log2`` (XLA) or the GPU's approximate one (the kernel)."""
    m = bits.astype(jnp.float32)
    u = (m + 0.5) * (1.0 / (1 << 23))
    w = ((float((1 << 23) - 1) - m) + 0.5) * (1.0 / (1 << 23))
    series = w * (1.0 + w * (1.0 / 2 + w * (1.0 / 3 + w * (1.0 / 4 + w * (1.0 / 5 + w * (1.0 / 6))))))
    e = jnp.where(w < SERIES_BELOW, series, -LN2 * log2(u))
    return -LN2 * log2(e)


def _lg2_approx(x: jax.Array) -> jax.Array:
    """The GPU's base-2 logarithm (one SFU instruction; float32, subnormals flushed)."""
    return plgpu.elementwise_inline_asm("lg2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def _mul_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` rounded on its own (``mul.rn`` is never contracted into a fused multiply-add)."""
    return plgpu.elementwise_inline_asm("mul.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


INT_MIN = -(2**31)
INT_MAX = 2**31 - 1


def order_key(values: jax.Array) -> jax.Array:
    """``int32`` keys in the order ``jnp.argmax`` ranks float32 values: monotone in the value, ``-0`` and
    ``+0`` equal, every NaN above ``+inf`` (a NaN wins). The sign-magnitude bits of a negative float
    are flipped so that larger floats have larger keys; ``key > best`` is then one integer compare."""
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    key = bits ^ ((bits >> 31) & INT_MAX)
    key = jnp.where(values == 0, 0, key)
    return jnp.where(jnp.isnan(values), INT_MAX, key)


def _kernel(x_ref, inv_ref, key_a_ref, key_b_ref, key_ref, idx_ref, *, block: int, steps: int, interpret: bool):
    """Program ``(row, part)``: ``steps`` chunks of ``block`` logits, chunk ``part * steps + i``; each lane
    keeps its best key and token id across the chunks (a strict ``>``: the lane's first best wins),
    then two reductions (the best key, the lowest id holding it) give the part's winner."""
    row, part = pl.program_id(0), pl.program_id(1)
    vocab = x_ref.shape[1]
    lanes = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    inv = inv_ref[row]

    def scan(values_of):
        def body(i, carry):
            best_key, best_idx = carry
            cols = (part * steps + i) * block + lanes
            ok = cols < vocab
            x = plgpu.load(x_ref.at[row, cols], mask=ok, other=0).astype(jnp.float32)
            key = jnp.where(ok, order_key(values_of(x, cols)), INT_MIN)
            better = key > best_key
            return jnp.where(better, key, best_key), jnp.where(better, cols, best_idx)

        init = (jnp.full((block,), INT_MIN, jnp.int32), jnp.full((block,), INT_MAX, jnp.int32))
        best_key, best_idx = jax.lax.fori_loop(0, steps, body, init)
        best = jnp.max(best_key)
        key_ref[row, part] = best
        idx_ref[row, part] = jnp.min(jnp.where(best_key == best, best_idx, INT_MAX))

    @pl.when(inv > 0)
    def _sampled():
        log2 = jnp.log2 if interpret else _lg2_approx
        mul = jnp.multiply if interpret else _mul_rn
        key_a, key_b = key_a_ref[row], key_b_ref[row]
        scan(lambda x, cols: mul(x, jnp.full_like(x, inv))
             + gumbel_from_bits(uniform_bits(cols.astype(jnp.uint32), key_a, key_b), log2))

    @pl.when(jnp.logical_not(inv > 0))  # every row takes one of the two branches (NaN too)
    def _greedy():
        scan(lambda x, cols: x)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Launch configuration: ``block`` logits per loop step, ``steps`` loop steps per program (so
    ``ceil(V / (block * steps))`` programs per row), warps and pipeline stages."""

    block: int
    steps: int = 1
    num_warps: int = 4
    num_stages: int = 1


def choose_config(num_rows: int, vocab: int) -> SamplerConfig:
    """Chunks of 4,096, 2,048 or 1,024 logits (the largest that still gives >= 2 programs per SM); with
    enough rows, 4 (or 2) chunks per program as long as that leaves >= 4 programs per SM, in two
    pipeline stages: the looped programs are as fast or faster than one chunk each at large batches."""
    block, cores = 1024, num_cores()
    for b in (4096, 2048):
        if num_rows * pl.cdiv(vocab, b) >= 2 * cores:
            block = b
            break
    chunks = pl.cdiv(vocab, block)
    for steps in (4, 2):
        if num_rows * pl.cdiv(chunks, steps) >= 4 * cores:
            return SamplerConfig(block, steps, num_warps=4, num_stages=2)
    return SamplerConfig(block)


@functools.partial(jax.jit, static_argnames=("block", "config", "interpret"))
def gumbel_argmax(x: jax.Array, inv_temperature: jax.Array, seeds: jax.Array, counters: jax.Array, *,
                  block: int | None = None, config: SamplerConfig | None = None,
                  interpret: bool = False) -> jax.Array:
    """``x [S, V]`` (logits, any float dtype, read as float32), ``inv_temperature f32[S]`` (``1 / T``;
    0 for greedy rows), ``seeds``, ``counters [S]`` -> ``i32[S]``: ``argmax(x * inv + gumbel)`` for rows
    with ``inv > 0``, else ``argmax(x)``. ``block``: shorthand for ``SamplerConfig(block)``; ``config``:
    the launch configuration (default :func:`choose_config`)."""
    if x.ndim != 2 or inv_temperature.shape != x.shape[:1]:
        raise ValueError(f"x must be [S, V] with inv_temperature [S], got {x.shape} and {inv_temperature.shape}")
    num_rows, vocab = x.shape
    if config is None:
        config = SamplerConfig(block) if block else choose_config(num_rows, vocab)
    if not is_pow2(config.block) or config.block < 16:
        raise ValueError(f"block must be a power of two >= 16, got {config.block}")
    if config.steps < 1:
        raise ValueError(f"steps must be >= 1, got {config.steps}")
    key_a, key_b = gumbel_keys(seeds, counters)
    parts = pl.cdiv(vocab, config.block * config.steps)
    keys, idxs = pl.pallas_call(
        functools.partial(_kernel, block=config.block, steps=config.steps, interpret=interpret),
        grid=(num_rows, parts),
        out_shape=(jax.ShapeDtypeStruct((num_rows, parts), jnp.int32),
                   jax.ShapeDtypeStruct((num_rows, parts), jnp.int32)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"gumbel_argmax_b{config.block}_s{config.steps}",
    )(x, inv_temperature.astype(jnp.float32), key_a, key_b)
    best = jnp.argmax(keys, axis=-1)  # the first part holding the row's best key
    return jnp.take_along_axis(idxs, best[:, None], axis=-1)[:, 0].astype(jnp.int32)
