"""Sampling: the user's ``SamplingParams``, the host-side metadata a step carries, the device sampler
(inside the jitted step) and its logits processors (penalties, min_p, logprobs, structured outputs' masks)."""

from .params import RequestOutputKind, SamplingParams
from .structured import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
