"""Sampler features beyond temperature / top-k / top-p, as static step variants.

A step whose requests use none of penalties, min_p, min_tokens, logprobs or prompt_logprobs compiles
and runs exactly the default step (``SamplerFeatures()`` is falsy, no extra input travels, the jitted
function is the one it always was). A step that uses some gets a variant chosen on the host: the
static ``SamplerFeatures`` (which features, and the padded sizes of their inputs) is part of the
step's layout, like ``sampling_mode``, so there is no device-side branch and no host round trip.

Inputs (``FeatureInputs``, all 32-bit, packed with the rest of the step; ``S`` padded sequences):
  presence_penalty, frequency_penalty, repetition_penalty f32[S]; history i32[S, H] (each request's
  tokens so far, prompt first, -1 padding; the last one may be a placeholder the device fills in);
  history_len, num_prompt i32[S]; min_p f32[S]; min_tokens i32[S]; stop_ids i32[S, K] (EOS unless
  ignore_eos, and stop_token_ids; -1 padding); prompt_indices, prompt_targets i32[P] (a prompt token's
  index in the step and the prompt token that follows it, for prompt_logprobs); bitmask i32[S, W] (the
  tokens each row may sample, structured outputs: ``bitmask.py``; -1, all allowed, in other rows).
Outputs (``aux`` dict): "logprobs" and "prompt_logprobs", each ``logprobs.token_logprobs``' dict;
"logits" (f32[S, V], the raw logits) in a step with constrained rows.

Structured outputs sample in a second program (vLLM's split of ``execute_model`` and ``sample_tokens``):
a row's token mask needs the token the previous step sampled for it, which with async scheduling is
still on the device when the step is launched. So the step (``constrained``) samples every row as usual
and also returns its logits; once the host has the previous tokens and the masks (computed while the
step runs), :func:`resample_rows` samples the constrained rows again from those logits under their masks
and writes their tokens over the step's. Nobody waits and every row decodes every step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels.shapes import next_pow2
from .bitmask import apply_token_bitmask
from .grammar import fill_bitmasks
from .logprobs import token_logprobs
from .penalties import apply_penalties, mask_stop_tokens
from .sampler import sample


@dataclasses.dataclass(frozen=True)
class SamplerFeatures:
    """Static: which features a step computes and the padded sizes of their inputs."""

    penalties: bool = False
    min_p: bool = False
    min_tokens: bool = False
    logprobs: int = -1  # top-k per sampled token; -1: none
    prompt_logprobs: int = -1  # top-k per prompt token; -1: none
    history_width: int = 0  # H
    num_stop_ids: int = 0  # K
    num_prompt_positions: int = 0  # P
    bitmask_width: int = 0  # W = ceil(V / 32): token masks (``resample_rows``' inputs), else 0
    constrained: bool = False  # some row is constrained: the step returns its raw logits (aux["logits"])

    def __bool__(self) -> bool:
        return self != NO_FEATURES

    def fields(self, s: int) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
        """``(name, shape, dtype)`` of the feature inputs of a step with ``s`` padded sequences."""
        i32, f32 = np.dtype(np.int32), np.dtype(np.float32)
        h, k, p = self.history_width, self.num_stop_ids, self.num_prompt_positions
        return (("presence_penalty", (s,), f32), ("frequency_penalty", (s,), f32),
                ("repetition_penalty", (s,), f32), ("history", (s, h), i32), ("history_len", (s,), i32),
                ("num_prompt", (s,), i32), ("min_p", (s,), f32), ("min_tokens", (s,), i32),
                ("stop_ids", (s, k), i32), ("prompt_indices", (p,), i32), ("prompt_targets", (p,), i32),
                ("bitmask", (s, self.bitmask_width), i32))

    def padding_inputs(self, s: int) -> "FeatureInputs":
        """Inputs of this variant for ``s`` padded sequences and no real one (ahead-of-time compilation)."""
        return FeatureInputs(**{name: np.zeros(shape, dtype) for name, shape, dtype in self.fields(s)})


NO_FEATURES = SamplerFeatures()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureInputs:
    """Device inputs of the features (see the module docstring for shapes)."""

    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    history: jax.Array
    history_len: jax.Array
    num_prompt: jax.Array
    min_p: jax.Array
    min_tokens: jax.Array
    stop_ids: jax.Array
    prompt_indices: jax.Array
    prompt_targets: jax.Array
    bitmask: jax.Array


def prompt_logprob_positions(scheduled) -> list[tuple[int, object, int]]:
    """``(row, seq, position)`` for every prompt token whose next-token logprobs a step computes:
    positions ``p`` of the scheduled chunk with ``p + 1 < num_prompt_tokens``. Call before the
    scheduler advances the sequences (the engine maps results back with it)."""
    out = []
    for row, (seq, n) in enumerate(scheduled):
        if seq.sampling_params.prompt_logprobs is None:
            continue
        start = seq.num_computed_tokens
        for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
            out.append((row, seq, p))
    return out


def build_feature_inputs(scheduled, s_pad: int, cu_q_lens: np.ndarray | None, eos_token_ids=(),
                         vocab_size: int = 0, masks: bool = False) -> tuple[SamplerFeatures, FeatureInputs | None]:
    """Host side: the features ``scheduled`` needs and their padded numpy inputs. A step with a
    structured output (``seq.structured``, ``grammar.StructuredState``) is ``constrained`` (it returns
    its logits). ``masks``: the inputs of :func:`resample_rows` instead, ``scheduled`` being the
    constrained rows: each gets its matcher's token mask (``vocab_size``: the model's, the mask's
    width; a matcher that fails raises here), and no prompt logprobs (``cu_q_lens`` unused)."""
    if not any(s.sampling_params._device_features for s, _ in scheduled):  # the default step: one pass
        return NO_FEATURES, None
    seqs = [s for s, _ in scheduled]
    sps = [s.sampling_params for s in seqs]
    n = len(seqs)
    pen_rows = [i for i, sp in enumerate(sps) if sp.uses_penalties]
    stop_lists = [[] if sp.min_tokens == 0 else (list(() if sp.ignore_eos else eos_token_ids)
                                                 + list(sp.stop_token_ids or ())) for sp in sps]
    plp = [] if masks else prompt_logprob_positions(scheduled)
    lps = [sp.logprobs for sp in sps if sp.logprobs is not None]
    plps = [sp.prompt_logprobs for sp in sps if sp.prompt_logprobs is not None]
    constrained = [i for i, s in enumerate(seqs) if s.structured is not None]
    features = SamplerFeatures(
        penalties=bool(pen_rows), min_p=any(sp.min_p > 0 for sp in sps),
        min_tokens=any(stop_lists), logprobs=max(lps, default=-1),
        prompt_logprobs=max(plps, default=-1) if plp else -1,
        history_width=next_pow2(max(len(seqs[i].token_ids) for i in pen_rows), 16) if pen_rows else 0,
        num_stop_ids=next_pow2(max(map(len, stop_lists)), 4) if any(stop_lists) else 0,
        num_prompt_positions=next_pow2(len(plp), 16) if plp else 0,
        bitmask_width=-(-vocab_size // 32) if constrained and masks else 0,
        constrained=bool(constrained) and not masks)
    arrays = {name: np.zeros(shape, dtype) for name, shape, dtype in features.fields(s_pad)}
    arrays["repetition_penalty"][:] = 1.0
    arrays["history"][:] = -1
    arrays["stop_ids"][:] = -1
    if features.bitmask_width:
        arrays["bitmask"][:] = -1
        fill_bitmasks([(seqs[i].structured.matcher, i) for i in constrained], arrays["bitmask"])
    arrays["presence_penalty"][:n] = [sp.presence_penalty for sp in sps]
    arrays["frequency_penalty"][:n] = [sp.frequency_penalty for sp in sps]
    arrays["repetition_penalty"][:n] = [sp.repetition_penalty for sp in sps]
    for i in pen_rows:
        toks = seqs[i].token_ids
        arrays["history"][i, : len(toks)] = toks  # a trailing placeholder (-1) is filled in on the device
        arrays["history_len"][i] = len(toks)
        arrays["num_prompt"][i] = seqs[i].num_prompt_tokens
    arrays["min_p"][:n] = [sp.min_p for sp in sps]
    arrays["min_tokens"][:n] = [sp.min_tokens for sp in sps]
    for i, ids in enumerate(stop_lists):
        arrays["stop_ids"][i, : len(ids)] = ids
    for j, (row, seq, p) in enumerate(plp):
        arrays["prompt_indices"][j] = cu_q_lens[row] + p - seq.num_computed_tokens
        arrays["prompt_targets"][j] = seq.token_ids[p + 1]
    return features, FeatureInputs(**arrays)


def sample_step(hidden: jax.Array, compute_logits: Callable[[jax.Array], jax.Array], inputs, token_ids: jax.Array,
                batch_invariant: bool = False) -> tuple[jax.Array, dict]:
    """Device side: logits at ``inputs.logits_indices`` -> ``(tokens i32[S], aux)``.

    ``hidden [T, hidden]``: the model's final hidden states; ``token_ids i32[T]``: the step's tokens
    with placeholders filled in. Without features this is exactly the default sampler (``aux == {}``).
    On a GPU the noise and argmax run as one Pallas pass (``sampler.sample``).
    """
    logits = compute_logits(hidden[inputs.logits_indices])  # [S, V] fp32
    f, x = inputs.features, inputs.extras
    if not f:
        return sample(logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.seeds, inputs.counters,
                      inputs.sampling_mode, batch_invariant=batch_invariant), {}
    current = token_ids[inputs.logits_indices]  # the token each row's logits follow (placeholder resolved)
    tokens, aux = _sample_features(logits, current, inputs, batch_invariant)
    if f.prompt_logprobs >= 0:
        prompt_logits = compute_logits(hidden[x.prompt_indices])  # [P, V]
        aux["prompt_logprobs"] = token_logprobs(prompt_logits, x.prompt_targets, f.prompt_logprobs, batch_invariant)
    if f.constrained:
        aux["logits"] = logits
    return tokens, aux


def _sample_features(logits: jax.Array, current: jax.Array, inputs, batch_invariant: bool) -> tuple[jax.Array, dict]:
    """``logits f32[S, V]`` through the features of ``inputs.features`` (token masks first, as vLLM:
    penalties and filters see the masked logits), then sampled: ``(tokens, aux)`` with the sampled
    tokens' logprobs (of the raw logits) where asked. ``current``: the token each row's logits follow."""
    f, x = inputs.features, inputs.extras
    processed = logits.astype(jnp.float32)
    if f.bitmask_width:
        processed = apply_token_bitmask(processed, x.bitmask)
    if f.penalties:
        rows = jnp.arange(x.history.shape[0])
        last = jnp.maximum(x.history_len - 1, 0)
        history = x.history.at[rows, last].set(jnp.where(x.history_len > 0, current, x.history[rows, last]))
        processed = apply_penalties(processed, history, x.num_prompt, x.presence_penalty, x.frequency_penalty,
                                    x.repetition_penalty)
    if f.min_tokens:
        processed = mask_stop_tokens(processed, x.stop_ids, inputs.counters < x.min_tokens)
    tokens = sample(processed, inputs.temperature, inputs.top_k, inputs.top_p, inputs.seeds, inputs.counters,
                    inputs.sampling_mode, batch_invariant=batch_invariant, min_p=x.min_p if f.min_p else None)
    aux = {}
    if f.logprobs >= 0:
        aux["logprobs"] = token_logprobs(logits, tokens, f.logprobs, batch_invariant)
    return tokens, aux


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowInputs:
    """:func:`resample_rows`' inputs (``C`` padded rows): rows i32[C], each one's row in the step (``R``,
    past every row, in padding); current i32[C], the token its logits follow; the sampler's per-row
    inputs as ``StepInputs``' (temperature, top_k, top_p, seeds, counters); the features' (``bitmask``
    set). ``sampling_mode`` and ``features`` are static."""

    rows: jax.Array
    current: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    extras: FeatureInputs
    sampling_mode: str = dataclasses.field(default="random", metadata=dict(static=True))
    features: SamplerFeatures = dataclasses.field(default=NO_FEATURES, metadata=dict(static=True))


def build_row_inputs(picked, inputs, num_rows: int, eos_token_ids=(), vocab_size: int = 0) -> RowInputs:
    """Host side: :func:`resample_rows`' inputs for ``picked``, ``(row, seq, n)`` of a ``constrained`` step
    (``inputs``: its host ``StepInputs``; ``num_rows``: its token buffer's rows, the padding rows' index),
    once the tokens the step read are known: the masks need them. A matcher that fails raises here."""
    s_pad = inputs.logits_indices.shape[0]
    features, extras = build_feature_inputs([(seq, n) for _, seq, n in picked], s_pad, None, eos_token_ids,
                                            vocab_size, masks=True)
    if features.logprobs >= 0:  # as many top logprobs as the step's, which these rows are written over
        features = dataclasses.replace(features, logprobs=inputs.features.logprobs)
    idx = np.array([row for row, _, _ in picked], np.int64)
    c = len(picked)

    def take(a: np.ndarray, fill) -> np.ndarray:
        out = np.full(s_pad, fill, a.dtype)
        out[:c] = a[idx]
        return out

    rows = np.full(s_pad, num_rows, np.int32)
    rows[:c] = idx
    current = np.zeros(s_pad, np.int32)
    current[:c] = [seq.token_ids[seq.num_computed_tokens + n - 1] for _, seq, n in picked]
    return RowInputs(rows, current, take(inputs.temperature, 0), take(inputs.top_k, 0), take(inputs.top_p, 1),
                     take(inputs.seeds, 0), take(inputs.counters, 0), extras, inputs.sampling_mode, features)


def padding_row_inputs(s_pad: int, num_rows: int, mode: str, features: SamplerFeatures) -> RowInputs:
    """:func:`resample_rows`' inputs with no real row (ahead-of-time compilation)."""
    z = np.zeros(s_pad, np.int32)
    return RowInputs(np.full(s_pad, num_rows, np.int32), z, np.zeros(s_pad, np.float32), z, np.ones(s_pad, np.float32),
                     np.zeros(s_pad, np.uint32), z, features.padding_inputs(s_pad), mode, features)


def resample_rows(tokens: jax.Array, logits: jax.Array, x: RowInputs, logprobs: dict | None = None,
                  batch_invariant: bool = False) -> tuple[jax.Array, dict | None]:
    """Device side, structured outputs' second program: the rows ``x.rows`` of a ``constrained`` step
    sampled again from its raw ``logits f32[S, V]`` under their token masks, written over ``tokens i32[R]``
    (the step's output) and, where asked, over its ``logprobs`` (``token_logprobs``' dict, rows of the
    step). A row draws the same noise as in the step (its seed and counter), so its token is the one the
    step would have sampled from the masked logits."""
    picked = logits[jnp.minimum(x.rows, logits.shape[0] - 1)]
    new, aux = _sample_features(picked, x.current, x, batch_invariant)
    tokens = tokens.at[x.rows].set(new, mode="drop")
    if logprobs is not None and "logprobs" in aux:
        logprobs = {k: v.at[x.rows].set(aux["logprobs"][k], mode="drop") for k, v in logprobs.items()}
    return tokens, logprobs
