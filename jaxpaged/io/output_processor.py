"""From sequences to ``RequestOutput``s: one user request (``n`` samples), streamed or final.

A ``RequestState`` is what one ``add_request`` queued: the prompt, its sampling params and its ``n``
sequences (``seq.parent`` points back, ``seq.index`` is the sample's index). After each engine step
``make_outputs`` turns the sequences that got a token or finished into outputs, by the request's
``output_kind`` (vLLM's ``RequestOutputKind``):
* ``FINAL_ONLY``: one output when every sample has finished (what ``generate`` collects);
* ``CUMULATIVE``: every step with new tokens, everything so far;
* ``DELTA``: every step with new tokens, only what is new (text, token ids, logprobs) since the last
  output; the pieces concatenate to the final text. With ``n > 1`` only the samples with news appear.
"""

from __future__ import annotations

import dataclasses

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, to_logprob_dict
from ..sampling.params import RequestOutputKind, SamplingParams
from ..request import Sequence


@dataclasses.dataclass
class RequestState:
    """One user request and what has been sent for it so far (per sample: tokens, characters, logprobs)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    first_scheduled: float | None = None
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    sent_tokens: list[int] = dataclasses.field(default_factory=list)
    sent_chars: list[int] = dataclasses.field(default_factory=list)
    sent_finished: list[bool] = dataclasses.field(default_factory=list)
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def make_detokenizer(tokenizer, sp: SamplingParams, num_prompt_tokens: int) -> IncrementalDetokenizer | None:
    """A per-token detokenizer when the request needs text before it ends (stop strings, streaming)."""
    if tokenizer is None or not sp.detokenize:
        return None
    if not sp.stop and sp.output_kind is RequestOutputKind.FINAL_ONLY:
        return None  # decoded once at the end
    return IncrementalDetokenizer(tokenizer, skip_special_tokens=sp.skip_special_tokens, stop=sp.stop,
                                  include_stop_str_in_output=sp.include_stop_str_in_output,
                                  min_tokens=sp.min_tokens, offset=num_prompt_tokens)


class OutputProcessor:
    """Builds ``RequestOutput``s; ``tokenizer`` may be None (token ids only, empty text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._piece_cache: dict[int, str] = {}

    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece_cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return piece

    def _text(self, seq: Sequence) -> str:
        sp = seq.sampling_params
        d = seq.detokenizer
        if d is not None:
            if seq.is_finished:
                d.flush(seq.token_ids)
            return d.visible_text(seq.is_finished)
        if self.tokenizer is None or not sp.detokenize or not seq.is_finished:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=sp.skip_special_tokens)

    def _logprobs(self, seq: Sequence, start: int, end: int) -> tuple[list | None, float | None]:
        if seq.logprobs is None:
            return None, None
        k = seq.sampling_params.logprobs
        out = [to_logprob_dict(tok, *entry, k=k, decode=self._piece)
               for tok, entry in zip(seq.output_token_ids[start:end], seq.logprobs[start:end])]
        return out, float(sum(e[0] for e in seq.logprobs[:end]))

    def _prompt_logprobs(self, state: RequestState) -> list | None:
        seq = state.seqs[0]
        if seq.prompt_logprobs is None:
            return None
        k = state.sampling_params.prompt_logprobs
        ids = state.prompt_token_ids
        return [None] + [to_logprob_dict(ids[p + 1], *seq.prompt_logprobs[p], k=k, decode=self._piece)
                         if p in seq.prompt_logprobs else None for p in range(len(ids) - 1)]

    @staticmethod
    def stop_strings(seqs: list[Sequence]) -> list[tuple[Sequence, str]]:
        """Grows the text of each sequence that is detokenized as it runs by its newest token; returns
        ``(sequence, stop string)`` for those whose text now holds one of their stop strings (after
        ``min_tokens``). The engine then ends them (``Scheduler.finish``)."""
        hits = []
        for seq in seqs:
            d = seq.detokenizer
            if d is not None:
                stop = d.add_token(seq.token_ids)
                if stop is not None:
                    hits.append((seq, stop))
        return hits

    def make_output(self, state: RequestState) -> RequestOutput | None:
        """The output for ``state`` now, by its ``output_kind``; None if there is nothing to send."""
        kind = state.sampling_params.output_kind
        finished = state.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for seq in state.seqs:
            i, ntok, text = seq.index, seq.num_output_tokens, self._text(seq)
            if kind is RequestOutputKind.DELTA:
                t0, c0 = state.sent_tokens[i], state.sent_chars[i]
                if ntok == t0 and len(text) == c0 and not (seq.is_finished and not state.sent_finished[i]):
                    continue  # no news for this sample
                lps, cum = self._logprobs(seq, t0, ntok)
                completions.append(CompletionOutput(i, text[c0:], seq.output_token_ids[t0:], seq.finish_reason,
                                                    seq.stop_reason, lps, cum))
            else:
                lps, cum = self._logprobs(seq, 0, ntok)
                completions.append(CompletionOutput(i, text, seq.output_token_ids, seq.finish_reason,
                                                    seq.stop_reason, lps, cum))
            state.sent_tokens[i], state.sent_chars[i] = ntok, len(text)
            state.sent_finished[i] = seq.is_finished
        if not completions:
            return None
        prompt_lps = None
        if not (kind is RequestOutputKind.DELTA and state.sent_prompt_logprobs):
            prompt_lps = self._prompt_logprobs(state)
            state.sent_prompt_logprobs = prompt_lps is not None
        seqs = state.seqs
        first_tokens = [s.first_token_time for s in seqs if s.first_token_time is not None]
        finish_times = [s.finish_time for s in seqs if s.finish_time is not None]
        metrics = RequestMetrics(seqs[0].arrival_time, state.first_scheduled, min(first_tokens, default=None),
                                 max(finish_times) if finished and finish_times else None)
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=finished,
                             num_cached_tokens=state.num_cached_tokens, metrics=metrics,
                             prompt_logprobs=prompt_lps, num_host_cached_tokens=state.num_host_cached_tokens)
