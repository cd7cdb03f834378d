"""vLLM-shaped results: ``RequestOutput`` with ``CompletionOutput``s and per-request timing metrics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One generated completion (jaxpaged generates one per request: ``n == 1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS or a stop token), "length" (max_tokens / max_model_len)


@dataclasses.dataclass
class RequestMetrics:
    """Monotonic-clock timestamps (seconds) and the derived latencies users ask about."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: arrival to first generated token, queueing included."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    """The result of one request, in the order the prompts were given."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache at (first) admission
    metrics: RequestMetrics
