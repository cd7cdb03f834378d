"""SamplingParams (vLLM's names and defaults) and the device sampler used inside the jitted step.

Randomness is per request: the key of request ``r`` at its ``n``-th generated token is
``fold_in(PRNGKey(seed_r), n)``, so a request with a seed yields the same tokens whatever else is
batched with it. Requests without a seed get one drawn from the engine's generator at submission.
Everything else is per row too: the top-k / top-p filter touches only the rows that ask for it, and in
the batch-invariant mode its sums (softmax denominator, cumulative sum) run in a fixed order that
depends on the vocabulary size only (:func:`fixed_order_sum`, ``lax.associative_scan``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from .kernels.shapes import next_pow2


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k filter
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ValueError`` naming the field for any value the sampler cannot honour."""
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"SamplingParams.seed must be a non-negative integer or None, got {self.seed!r}")
        if self.stop_token_ids is not None and not all(isinstance(x, int) for x in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")


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


SAMPLING_MODES = ("random", "filtered")


def sampling_mode(temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float]) -> str:
    """The compiled sampler variant a step needs, decided on the host from its requests' params.

    ``filtered`` if some sampling row (``temperature > 0``) asks for top-k or top-p (a sort per row),
    else ``random``. Choosing here rather than with a device-side ``cond`` keeps the step free of host
    round trips (XLA copies a ``cond``'s predicate to the host and waits for it mid-step). Greedy rows
    need no variant of their own: they take the argmax of the logits in either.
    """
    if any(t > 0 and (k > 0 or p < 1.0) for t, k, p in zip(temperature, top_k, top_p)):
        return "filtered"
    return "random"


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, counters: jax.Array, mode: str = "filtered",
           batch_invariant: bool = False) -> jax.Array:
    """Picks one token per row. ``logits f32[S, V]``; per-row ``temperature f32``, ``top_k i32``,
    ``top_p f32``, ``seeds u32``, ``counters i32`` (tokens generated so far). Returns ``i32[S]``.

    Gumbel-max sampling from ``softmax(logits / T)``; rows with ``T == 0`` take the argmax of the
    logits. One argmax over the vocabulary serves both kinds of rows. ``mode`` (static, see
    :func:`sampling_mode`): ``random`` skips the top-k / top-p sort, which no row of such a step
    needs; the filter changes only the rows that ask for it, so both modes give the same tokens for
    every other row. ``batch_invariant`` (static): fixed-order sums in the top-p filter.
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode must be one of {SAMPLING_MODES}, got {mode!r}")
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if mode == "filtered":
        scaled = _filter_top_k_top_p(scaled, top_k, top_p, batch_invariant)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    noisy = jnp.where((temperature > 0)[:, None], scaled + gumbel, logits)
    return jnp.argmax(noisy, axis=-1).astype(jnp.int32)
