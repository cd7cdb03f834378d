"""vLLM-shaped results: ``RequestOutput`` with ``CompletionOutput``s and per-request timing metrics.

Logprobs have vLLM's shape: per position a dict ``token_id -> Logprob(logprob, rank, decoded_token)``
holding the top-k tokens and the sampled (or, for the prompt, the actual next) token; ``rank`` is
1-based (1 = most likely). ``prompt_logprobs[0]`` is ``None`` (the first token has no context).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Logprob:
    """One token's log-probability under the model's distribution, its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


def to_logprob_dict(token: int, token_lp: float, rank: int, ids: np.ndarray, values: np.ndarray, k: int,
                    decode) -> dict[int, Logprob]:
    """vLLM's per-position dict: the chosen token first, then the top-``k`` (ranks 1..k)."""
    out = {int(token): Logprob(float(token_lp), int(rank), decode(int(token)))}
    for r, (i, v) in enumerate(zip(ids[:k].tolist(), values[:k].tolist()), start=1):
        if i not in out:
            out[i] = Logprob(float(v), r, decode(i))
    return out


@dataclasses.dataclass
class CompletionOutput:
    """One generated completion (``index`` in ``0..n-1``). In a ``DELTA`` output, ``text``,
    ``token_ids`` and ``logprobs`` hold only what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token/string), "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


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
    prompt_logprobs: PromptLogprobs | None = None
    num_host_cached_tokens: int = 0  # of num_cached_tokens: copied back from the host tier (kv_offloading_size)


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One ``DELTA`` output equal to two consecutive ones of the same request: a consumer that fell behind
    (a server writing to a slow client) takes what queued up as one output instead of one per step."""
    by_index = {c.index: c for c in earlier.outputs}
    outputs = []
    for c in later.outputs:
        e = by_index.pop(c.index, None)
        if e is not None:
            logprobs = None if e.logprobs is None and c.logprobs is None else (e.logprobs or []) + (c.logprobs or [])
            c = dataclasses.replace(c, text=e.text + c.text, token_ids=e.token_ids + c.token_ids, logprobs=logprobs)
        outputs.append(c)
    outputs = sorted([*by_index.values(), *outputs], key=lambda c: c.index)
    return dataclasses.replace(later, outputs=outputs,
                               prompt_logprobs=later.prompt_logprobs or earlier.prompt_logprobs)
