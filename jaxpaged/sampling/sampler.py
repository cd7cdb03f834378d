"""SamplingParams (vLLM's names and defaults) and the device sampler used inside the jitted step.

Randomness is per request: the Gumbel noise of request ``r`` at its ``n``-th generated token is a
counter-based hash of ``(seed_r, n, token id)`` (:func:`gumbel_noise`), so a request with a seed
yields the same tokens whatever else is batched with it. Requests without a seed get one drawn from
the engine's generator at submission.
Everything else is per row too: the top-k / top-p filter touches only the rows that ask for it, and in
the batch-invariant mode its sums (softmax denominator, cumulative sum) run in a fixed order that
depends on the vocabulary size only (:func:`fixed_order_sum`, ``lax.associative_scan``).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels.gumbel_argmax import gumbel_argmax, gumbel_from_bits, gumbel_keys, uniform_bits
from ..kernels.shapes import next_pow2
from .params import RequestOutputKind, SamplingParams  # noqa: F401  (re-exported)


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree of elementwise adds (zero-padded to a power of
    two): the order depends on the axis length only, never on the other dimensions. Keeps the axis."""
    n = x.shape[-1]
    width = next_pow2(n)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                        batch_invariant: bool = False) -> jax.Array:
    """Masks logits outside each row's top-k and top-p nucleus to -inf. ``logits f32[S, V]``.
    Rows that ask for neither keep their logits exactly (rounding in the cumulative sum must not cut
    their tail because another row in the batch asked for a filter)."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    if batch_invariant:
        e = jnp.exp(sorted_logits - sorted_logits[:, :1])  # the row max is the first sorted logit
        probs = e / fixed_order_sum(e)
        cum = jax.lax.associative_scan(jnp.add, probs, axis=-1)
    else:
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep_sorted = (cum - probs) < top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    wants = ((top_k > 0) | (top_p < 1.0))[:, None]
    return jnp.where(wants & (logits < threshold), -jnp.inf, logits)


def apply_min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """``scaled f32[S, V]`` (temperature applied) -> the same with tokens of probability below
    ``min_p[s] * max probability`` masked to -inf. ``p_i >= m * p_max`` is ``l_i - l_max >= log m``:
    no softmax (and no sum over the vocabulary) needed. ``min_p == 0`` leaves a row unchanged."""
    top = jnp.max(scaled, axis=-1, keepdims=True)
    keep = (scaled - top) >= jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    return jnp.where(keep | (min_p <= 0)[:, None], scaled, -jnp.inf)


def gumbel_noise(seeds: jax.Array, counters: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise ``f32[S, vocab]``: row ``s`` is a function of ``(seeds[s], counters[s])``
    and the token id only (per request, independent of the batch).

    A counter-based hash instead of ``jax.random`` (threefry, ~20 rounds per pair of words): two
    rounds of a 32-bit finaliser per element, keyed by two 32-bit row keys derived from the seed and
    the counter, 23 bits to a uniform, then ``-log(-log(u))`` (``kernels.gumbel_argmax``:
    :func:`gumbel_keys`, :func:`uniform_bits`, :func:`gumbel_from_bits`, which the GPU's sampler
    kernel draws from too).
    """
    key_a, key_b = gumbel_keys(seeds, counters)
    col = jax.lax.broadcasted_iota(jnp.uint32, (seeds.shape[0], vocab), 1)
    return gumbel_from_bits(uniform_bits(col, key_a[:, None], key_b[:, None]))


SAMPLING_MODES = ("random", "filtered")


def sampling_mode(temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float]) -> str:
    """The compiled sampler variant a step needs, decided on the host from its requests' params.

    ``filtered`` if some sampling row (``temperature > 0``) asks for top-k or top-p (a sort per row),
    else ``random``. Choosing here rather than with a device-side ``cond`` keeps the step free of host
    round trips (XLA copies a ``cond``'s predicate to the host and waits for it mid-step). Greedy rows
    need no variant of their own: they take the argmax of the logits in either.
    """
    t, k, p = np.asarray(temperature), np.asarray(top_k), np.asarray(top_p)
    return "filtered" if bool(np.any((t > 0) & ((k > 0) | (p < 1.0)))) else "random"  # vectorised: per step


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, counters: jax.Array, mode: str = "filtered",
           batch_invariant: bool = False, min_p: jax.Array | None = None,
           argmax_kernel: bool | None = None) -> jax.Array:
    """Picks one token per row. ``logits f32[S, V]``; per-row ``temperature f32``, ``top_k i32``,
    ``top_p f32``, ``seeds u32``, ``counters i32`` (tokens generated so far). Returns ``i32[S]``.

    Gumbel-max sampling from ``softmax(logits / T)``; rows with ``T == 0`` take the argmax of the
    logits. One argmax over the vocabulary serves both kinds of rows. ``mode`` (static, see
    :func:`sampling_mode`): ``random`` skips the top-k / top-p sort, which no row of such a step
    needs; the filter changes only the rows that ask for it, so both modes give the same tokens for
    every other row. ``batch_invariant`` (static): fixed-order sums in the top-p filter.
    ``min_p f32[S]`` (optional: only the min-p step variant passes it): after the temperature, drops
    tokens whose probability is below ``min_p`` times the row's largest (vLLM's order: temperature,
    min-p, top-k / top-p). Per row, no reduction across rows. The temperature is a multiplication by
    ``1 / T`` (one division per row, not per logit).
    ``argmax_kernel`` (static; ``None``: on a GPU): the noise and the argmax as one Pallas pass
    (``kernels.gumbel_argmax``, the GPU's fast logarithm: see there), in every mode; the filters and
    min-p run before it in XLA. ``True`` off a GPU runs it in interpret mode (tests).
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
    on_gpu = jax.default_backend() == "gpu"
    if argmax_kernel is None:
        argmax_kernel = on_gpu
    sampled = temperature > 0
    # 1 / T, kept a positive normal number for every sampled row (0 marks the greedy ones in the kernel).
    inv_temperature = jnp.where(sampled, jnp.maximum(1.0 / jnp.where(sampled, temperature, 1.0),
                                                     np.finfo(np.float32).tiny), 0.0).astype(jnp.float32)
    if argmax_kernel and mode == "random" and min_p is None:  # one pass over the logits as they are
        return gumbel_argmax(logits, inv_temperature, seeds, counters, interpret=not on_gpu)
    logits = logits.astype(jnp.float32)
    scaled = logits * jnp.where(sampled, inv_temperature, 1.0)[:, None]
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if mode == "filtered":
        scaled = _filter_top_k_top_p(scaled, top_k, top_p, batch_invariant)
    if argmax_kernel:  # scaled already: x * 1 + noise rounds as the random mode's x * (1 / T) + noise;
        # greedy rows take their raw logits, as XLA's path below does
        x = jnp.where(sampled[:, None], scaled, logits)
        return gumbel_argmax(x, sampled.astype(jnp.float32), seeds, counters, interpret=not on_gpu)
    gumbel = gumbel_noise(seeds, counters, logits.shape[-1])
    noisy = jnp.where(sampled[:, None], scaled + gumbel, logits)
    return jnp.argmax(noisy, axis=-1).astype(jnp.int32)
