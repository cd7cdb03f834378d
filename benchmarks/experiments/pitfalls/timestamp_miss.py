"""Pitfall: a timestamp inside the system prompt makes every request's prefix unique: hit rate ~0.

Prefix caching shares only *full blocks identical from the first token*. A system prompt that says
"Current time: 10:42:17" differs between two requests at the timestamp, so every block from the
one holding it onward is private. Found with ``engine.explain_prefix(a, b)`` (the first block where
two prompts diverge) and the KV event log (``EngineConfig(event_log=True)``: a ``hit`` event lists
the cached blocks a request reused). Fix: move the variable part after the shared prompt.

    python benchmarks/experiments/pitfalls/timestamp_miss.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import tiny_engine  # noqa: E402

from jaxpaged import SamplingParams  # noqa: E402
from jaxpaged.llm import run_to_completion  # noqa: E402

RULES = ("You are the support assistant of ACME Corp. Answer in two sentences at most. Never reveal "
         "internal ticket numbers. Escalate refunds above 100 euros to a human. Be polite and precise. ")
QUESTIONS = ["Where is my order?", "Can I get a refund?", "How do I reset my password?", "Do you ship to Norway?"]
TIMES = ["10:42:17", "10:42:55", "10:43:08", "10:44:31"]


def prompts(timestamp_inside: bool) -> list[str]:
    if timestamp_inside:
        return [f"Current time: {t}. " + RULES + "User: " + q for t, q in zip(TIMES, QUESTIONS)]
    return [RULES + f"Current time: {t}. User: " + q for t, q in zip(TIMES, QUESTIONS)]


def serve(texts: list[str]) -> dict:
    engine = tiny_engine(event_log=True)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = [run_to_completion(engine, [t], sp)[0] for t in texts]  # one after another: the cache is warm
    hits = {o.request_id: sum(len(e.block_ids) for e in engine.kv.events.for_request(o.request_id) if e.kind == "hit")
            for o in outs}
    return dict(hit_rate=engine.stats()["prefix_hit_rate"], hit_blocks_per_request=list(hits.values()),
                explain=str(engine.explain_prefix(texts[0], texts[1])),
                shared_full_blocks=engine.explain_prefix(texts[0], texts[1]).shared_full_blocks,
                num_tokens=len(engine.tokenizer.encode(texts[0])))


def main(argv=None) -> dict:
    inside, moved = serve(prompts(True)), serve(prompts(False))
    print("timestamp first, then the rules:")
    print(f"  explain_prefix(request 0, request 1): {inside['explain']}")
    print(f"  'hit' events (blocks reused) per request: {inside['hit_blocks_per_request']}; "
          f"hit rate {inside['hit_rate']:.1%}")
    print("the rules first, then the timestamp:")
    print(f"  explain_prefix(request 0, request 1): {moved['explain']}")
    print(f"  'hit' events (blocks reused) per request: {moved['hit_blocks_per_request']}; "
          f"hit rate {moved['hit_rate']:.1%}")
    print("fix: keep everything that varies per request after the shared prefix")
    return dict(inside=inside, moved=moved)


if __name__ == "__main__":
    main()
