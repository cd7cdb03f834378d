"""The grammar backend of structured outputs: llguidance, behind one small interface.

* ``GrammarCompiler(tokenizer_json, vocab_size, eos_token_ids)``: compiles a request's
  ``StructuredOutputsParams`` into a grammar, in a small thread pool (llguidance releases the GIL while
  it builds one), cached by the constraint's canonical text: ``submit(params) -> Future``. A grammar it
  cannot compile is a ``ValueError`` naming the field, from the future.
* ``GrammarMatcher``: one sequence's position in its grammar: ``fill_bitmask``, ``accept(token)``,
  ``is_terminated()``, ``rollback(n)``. Each of a request's ``n`` samples has its own (a copy of the
  compiled grammar's start state).
* ``fill_bitmasks(rows, bitmask)``: the token masks of many sequences at once, in llguidance's threads.
* ``StructuredState``: what a ``Sequence`` carries: its grammar (while compiling, a future) and matcher.

The bitmask of a row is ``i32[ceil(V / 32)]``, bit ``j % 32`` of word ``j // 32`` set when token ``j``
may come next (``V``: the model's vocabulary, which may be larger than the tokenizer's; tokens the
tokenizer lacks are never allowed). llguidance is an optional dependency (``pip install
jaxpaged[structured]``), imported only when a request asks for structured output.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
from typing import Sequence as SequenceT

import numpy as np

from .structured import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (by their constraint's text)
COMPILE_THREADS = 2


def available() -> bool:
    """Whether the grammar backend (llguidance) is installed."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError as err:
        raise ValueError("structured outputs need llguidance: pip install 'jaxpaged[structured]'") from err
    return llguidance


def bitmask_width(vocab_size: int) -> int:
    """Words of a row's bitmask: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One sequence's state in its grammar (an ``llguidance.LLMatcher``)."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]`` (``i32[rows, W]``, C-contiguous)."""
        _llguidance().numpy.fill_next_token_bitmask(self._m, bitmask, row)
        self._check()

    def accept(self, token: int) -> bool:
        """Advances by the sampled ``token``; False (and the matcher is in error) if the grammar refuses it."""
        return self._m.consume_token(token)

    def is_terminated(self) -> bool:
        """True once the grammar is complete (or EOS was accepted): nothing more may be generated."""
        return self._m.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` accepted tokens."""
        if not self._m.rollback(num_tokens):
            self._check()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def _check(self) -> None:
        if self._m.is_error():
            raise RuntimeError(f"structured output matcher failed: {self._m.get_error()}")


@functools.lru_cache(maxsize=1)
def _executor():
    return _llguidance().LLExecutor()


def fill_bitmasks(rows: SequenceT[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
    """``matcher.fill_bitmask(bitmask, row)`` for every ``(matcher, row)``, in llguidance's threads (the
    GIL released). Raises if a matcher is in error (the caller then tries the rows one by one)."""
    if len(rows) == 1:
        rows[0][0].fill_bitmask(bitmask, rows[0][1])
        return
    _llguidance().numpy.fill_next_token_bitmask_par(_executor(), [(m._m, row) for m, row in rows], bitmask)
    for m, _ in rows:
        m._check()


class CompiledGrammar:
    """A compiled grammar: each ``matcher()`` starts a sequence at its beginning."""

    def __init__(self, prototype) -> None:
        self._prototype = prototype

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy())


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, off the caller's thread, cached by text.

    ``tokenizer_json``: the tokenizer's ``tokenizer.json`` text (the ``tokenizers`` library's
    ``to_str()``); ``vocab_size``: the model's (logits) vocabulary; ``eos_token_ids``: the tokens that
    end a sequence (allowed where the grammar may end).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: SequenceT[int],
                 threads: int = COMPILE_THREADS, cache_size: int = CACHE_SIZE) -> None:
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self._tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxpaged-grammar")
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the ``CompiledGrammar`` for ``params`` (the cached one if compiled or compiling)."""
        key = (*params.key(), params.disable_any_whitespace)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self.compile, params)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compiles ``params`` now; a ``ValueError`` naming the field if it cannot be compiled."""
        llg = _llguidance()
        kind, text = params.key()
        field = params.kind
        try:
            if kind == "json":
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    text, defaults={"whitespace_flexible": not params.disable_any_whitespace})
            else:
                grammar = llg.grammar_from(kind, text)  # "grammar": Lark, or GBNF converted to Lark
        except (ValueError, TypeError, RuntimeError) as err:
            raise ValueError(f"StructuredOutputsParams.{field} cannot be compiled: {err}") from None
        prototype = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise ValueError(f"StructuredOutputsParams.{field} cannot be compiled: {prototype.get_error()}")
        return CompiledGrammar(prototype)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredState:
    """A sequence's structured output: its grammar (a future while it compiles) and its matcher."""

    __slots__ = ("grammar", "_matcher")

    def __init__(self, grammar: concurrent.futures.Future) -> None:
        self.grammar = grammar
        self._matcher: GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """The grammar is compiled (or failed: ``failure``); the sequence may be scheduled."""
        return self.grammar.done()

    @property
    def failure(self) -> BaseException | None:
        return self.grammar.exception() if self.grammar.done() else None

    @property
    def matcher(self) -> GrammarMatcher:
        """The sequence's matcher (made from the compiled grammar on first use: call once ``ready``)."""
        if self._matcher is None:
            self._matcher = self.grammar.result().matcher()
        return self._matcher
