"""Incremental detokenization and stop strings, per generated sequence (host side).

Byte-level BPE tokens do not align with characters: one emoji can span three tokens, and decoding
them one at a time gives replacement characters (U+FFFD). The detokenizer decodes a short window
(``ids[prefix_offset:]``) and emits only the text past what the window's first part
(``ids[prefix_offset:read_offset]``) already produced, and only once it no longer ends in U+FFFD
(the scheme of Hugging Face's ``TextStreamer`` and vLLM). So streamed text never splits a character,
and the pieces concatenate to the text of the whole sequence.

Stop strings are searched in the text after every token, across token boundaries (only the new
text and ``len(stop) - 1`` characters before it are searched). On a match the text is cut before the
stop string (after it with ``include_stop_str_in_output``). While a request runs, the last
``len(longest stop) - 1`` characters are held back from streamed output, since they may turn out to
be the start of a stop string that is cut later (vLLM does the same).
"""

from __future__ import annotations

from typing import Sequence as SequenceT

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, grown token by token. ``stop``: strings that end it."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: SequenceT[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0, offset: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or ())
        self.include_stop = include_stop_str_in_output
        self.holdback = 0 if (not self.stop or include_stop_str_in_output) else max(map(len, self.stop)) - 1
        self.text = ""
        self.num_tokens = 0  # output tokens consumed
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_reason: str | None = None
        self.min_tokens = min_tokens  # stop strings count only after this many tokens (vLLM)
        self.offset = offset  # ids passed in are the whole sequence; output starts here

    def _decode(self, ids: SequenceT[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add_token(self, ids: SequenceT[int]) -> str | None:
        """Consumes output token ``self.num_tokens`` (``ids``: the sequence's tokens, output from
        ``offset``). Returns the stop string it completed, if any (the text is then cut and later
        tokens are ignored)."""
        if self.stop_reason is not None:
            return None
        self.num_tokens += 1
        o = self.offset
        before = self._decode(ids[o + self.prefix_offset: o + self.read_offset])
        now = self._decode(ids[o + self.prefix_offset: o + self.num_tokens])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return None  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += now[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, self.num_tokens
        return self._check_stop(start) if self.stop and self.num_tokens > self.min_tokens else None

    def flush(self, ids: SequenceT[int]) -> None:
        """At the end: emits whatever the last tokens decode to, even an incomplete character."""
        if self.stop_reason is None and self.read_offset < self.num_tokens:
            o = self.offset
            before = self._decode(ids[o + self.prefix_offset: o + self.read_offset])
            self.text += self._decode(ids[o + self.prefix_offset: o + self.num_tokens])[len(before):]
            self.read_offset = self.num_tokens

    def _check_stop(self, new_start: int) -> str | None:
        for s in self.stop:
            idx = self.text.find(s, max(0, new_start - len(s) + 1))
            if idx >= 0:
                self.text = self.text[: idx + len(s) if self.include_stop else idx]
                self.stop_reason = s
                return s
        return None

    def visible_text(self, finished: bool) -> str:
        """The text that may be shown now: all of it when finished, else without the hold-back."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
