"""SamplingParams: how to pick tokens and when to stop, with vLLM's names, defaults and semantics.

Every field is checked when the object is made (and again by the engine at ``add_request``): a wrong
type is a ``TypeError``, a value out of range a ``ValueError``, each naming the field. ``bool`` is not
accepted where a number is meant (``temperature=True`` is a mistake, not 1.0); numpy scalars are.

Semantics (vLLM's):
* ``temperature == 0`` is greedy; ``top_k`` -1 / 0 = off; ``top_p`` in (0, 1]; ``min_p`` in [0, 1]
  keeps tokens whose probability is at least ``min_p`` times the most likely token's.
* ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] subtract ``p * [token generated]`` and
  ``f * count`` (output tokens only) from the logits; ``repetition_penalty`` > 0 divides positive
  logits and multiplies negative ones of every token seen in the prompt or the output (1 = off).
* ``stop``: strings matched on the detokenized output (across token boundaries); the text is cut
  before the match unless ``include_stop_str_in_output``. ``stop_token_ids``: ids that end the request
  (the token is kept). ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled, and no stop
  condition applies, before that many tokens.
* ``logprobs = k``: per generated token, the log-probabilities (of the model's raw distribution) of
  the ``k`` most likely tokens and of the sampled one; ``prompt_logprobs = k`` likewise per prompt token.
* ``n``: independent samples of one prompt (sharing its cached prompt blocks); with a ``seed``, sample
  ``i`` uses ``seed + i``.
* ``structured_outputs``: a ``StructuredOutputsParams`` (JSON schema, regex, choice, grammar or any JSON
  object): only tokens that keep the output inside it can be sampled, and the request ends ("stop")
  once it is complete; EOS only where it may end. Other settings apply among the allowed tokens.
* ``output_kind``: what ``LLMEngine.step()`` returns for this request: ``FINAL_ONLY`` (default, one
  output when it finishes), ``CUMULATIVE`` (everything so far, every step) or ``DELTA`` (what is new).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers

from .structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_TOP_K = 2**31 - 1  # top_k travels to the device as int32
MAX_SEED = 2**63 - 1  # seeds are 64-bit integers (the device uses their low 32 bits)
MAX_FLOAT32 = 3.4028234663852886e38  # temperature, repetition_penalty: float32 on the device
MAX_COUNT = 2**31 - 1  # max_tokens, min_tokens: token counts, compared with int32 positions on the device


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _number(name: str, value, lo: float, hi: float, *, lo_open=False, hi_open=False, hint="") -> float:
    if not _is_real(value):
        raise TypeError(f"SamplingParams.{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    bad = math.isnan(v) or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi)
    if bad:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"SamplingParams.{name} must be in {lb}{lo}, {hi}{rb}{hint}, got {value!r}")
    return v


def _int(name: str, value, lo: int, hint: str = "", allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not _is_int(value):
        raise TypeError(f"SamplingParams.{name} must be an integer{' or None' if allow_none else ''}, got "
                        f"{type(value).__name__} {value!r}")
    if value < lo:
        raise ValueError(f"SamplingParams.{name} must be >= {lo}{hint}, got {value!r}")
    return int(value)


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop (see the module docstring). ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k filter
    top_p: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks and normalises every field (``TypeError`` / ``ValueError`` naming the field)."""
        t = self.temperature
        if not _is_real(t):
            raise TypeError(f"SamplingParams.temperature must be a number, got {type(t).__name__} {t!r}")
        if math.isnan(t) or not 0 <= t <= MAX_FLOAT32:
            raise ValueError(f"SamplingParams.temperature must be finite (in float32) and >= 0 (0 = greedy), "
                             f"got {t!r}")
        self.temperature = float(t)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or a positive integer <= {MAX_TOP_K}, "
                             f"got {self.top_k!r}")
        self.top_k = int(self.top_k)
        p = self.top_p
        if not _is_real(p) or math.isnan(p) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        self.top_p = float(p)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_COUNT):
            raise ValueError(f"SamplingParams.max_tokens must be a positive integer <= {MAX_COUNT} or None, "
                             f"got {self.max_tokens!r}")
        self.max_tokens = None if self.max_tokens is None else int(self.max_tokens)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"SamplingParams.seed must be an integer in [0, {MAX_SEED}] or None, got {self.seed!r}")
        self.seed = None if self.seed is None else int(self.seed)
        self.n = _int("n", self.n, 1)
        self.stop_token_ids = self._token_ids("stop_token_ids", self.stop_token_ids)
        self.stop = self._stop_strings(self.stop)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > MAX_COUNT:
            raise ValueError(f"SamplingParams.min_tokens must be <= {MAX_COUNT}, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens "
                             f"({self.max_tokens})")
        self.min_p = _number("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, 0.0, MAX_FLOAT32,
                                          lo_open=True, hint=" (1 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            k = _int(name, getattr(self, name), 0, allow_none=True)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.{name} must be <= {MAX_LOGPROBS}, got {k}")
            setattr(self, name, k)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"SamplingParams.output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams or None, got "
                                f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop strings need detokenize=True")
        # Read by the step builder for every request of every step: computed once here, not per step.
        self._device_features = (self.uses_penalties or self.min_p > 0 or self.min_tokens > 0
                                 or self.logprobs is not None or self.prompt_logprobs is not None
                                 or self.structured_outputs is not None)

    @staticmethod
    def _token_ids(name: str, ids) -> list[int] | None:
        if ids is None:
            return None
        if _is_int(ids) or isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"SamplingParams.{name} must be a list of ints, got {type(ids).__name__} {ids!r}"
                            + (f" (write [{ids}])" if _is_int(ids) else ""))
        ids = list(ids)
        bad = [x for x in ids if not _is_int(x) or x < 0]
        if bad:
            raise TypeError(f"SamplingParams.{name} must be a list of non-negative ints, got {bad[0]!r} in it")
        return [int(x) for x in ids]

    @staticmethod
    def _stop_strings(stop) -> list[str] | None:
        if stop is None:
            return None
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"SamplingParams.stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("SamplingParams.stop must not contain an empty string")
        return list(stop)

    # ---- what the engine and the step builder need to know ------------------------------------------
    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_device_features(self) -> bool:
        """True if this request needs a sampler variant beyond temperature / top-k / top-p (as of the
        last ``validate()``; the engine validates a copy of every request's params when it is added)."""
        return self._device_features

    @classmethod
    def from_optional(cls, sp, where: str = "sampling_params") -> "SamplingParams":
        """``None`` -> defaults; a ``SamplingParams`` as is; anything else is a ``TypeError`` that says so."""
        if sp is None:
            return cls()
        if isinstance(sp, cls):
            return sp
        if isinstance(sp, dict):
            raise TypeError(f"{where} must be a SamplingParams, got a dict: write SamplingParams(**{sp!r})")
        raise TypeError(f"{where} must be a SamplingParams or None, got {type(sp).__name__} {sp!r}")
