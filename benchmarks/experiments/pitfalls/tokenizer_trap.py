"""Pitfall: strings that look equal are different token sequences, so they share no cached blocks.

Prefix caching compares token ids, not text. Three traps, each shown with the tokenizer and
``explain_prefix`` (which reports the first differing token and block):

1. invisible characters: a non-breaking space (U+00A0) or a trailing space before a newline;
2. Unicode normalisation: "é" as one code point (NFC) or "e" + a combining accent (NFD);
3. the boundary: ``encode(system) + encode(user)`` is not ``encode(system + user)``: byte-level BPE
   merges across the join, so a system prompt tokenized alone is not a prefix of the full prompt.

Fix: build prompts from token ids (tokenize the shared part once and append), normalise text
(``unicodedata.normalize("NFC", s)``), and compare ``tokenizer.encode`` outputs, not strings.

    python benchmarks/experiments/pitfalls/tokenizer_trap.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import tiny_engine  # noqa: E402

SYSTEM = "You are a careful assistant. Use metric units. Cite sources when you can. Keep answers short. "
PAIRS = {
    "non-breaking space": (SYSTEM + "Answer in English.\nQ: hi", SYSTEM.replace("careful assistant", "careful\u00a0assistant") + "Answer in English.\nQ: hi"),
    "trailing space": (SYSTEM + "Answer in English.\nQ: hi", SYSTEM + "Answer in English. \nQ: hi"),
    "NFC vs NFD accent": (SYSTEM + "Caf\u00e9 menu.\nQ: hi", SYSTEM + "Cafe\u0301 menu.\nQ: hi"),
}


def main(argv=None) -> dict:
    engine = tiny_engine()
    tok = engine.tokenizer
    report = {}
    for name, (a, b) in PAIRS.items():
        why = engine.explain_prefix(a, b)
        report[name] = dict(tokens_equal=tok.encode(a) == tok.encode(b),
                            first_diff_token=why.first_diff_token, first_diff_block=why.first_diff_block,
                            explain=str(why))
        print(f"{name}: {a[-30:]!r} vs {b[-30:]!r}")
        print(f"  tokens equal: {report[name]['tokens_equal']}; explain_prefix: {why}")
    user = "Hello, please summarise the report."  # SYSTEM ends with a space: " Hello" is one word when joined
    joined = tok.encode(SYSTEM + user)
    separate = tok.encode(SYSTEM) + tok.encode(user)
    why = engine.explain_prefix(joined, separate)
    report["boundary"] = dict(tokens_equal=joined == separate, first_diff_token=why.first_diff_token,
                              system_tokens=len(tok.encode(SYSTEM)), explain=str(why))
    print("encode(system + user) vs encode(system) + encode(user):")
    print(f"  equal: {joined == separate}; explain_prefix: {why}")
    n = len(tok.encode(SYSTEM))
    print(f"  around the join: {tok.encode(SYSTEM)[-2:]} + {tok.encode(user)[:2]} vs {joined[n - 2:n + 1]}: "
          f"the system prompt alone ends in a token the joined prompt does not have")
    print("fix: tokenize the shared prefix once and append token ids; normalise text; compare token ids")
    return report


if __name__ == "__main__":
    main()
