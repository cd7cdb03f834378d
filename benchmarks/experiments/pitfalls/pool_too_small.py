"""Pitfall: a KV pool too small for the working set evicts cached prefixes before they are reused.

"OOM while memory is not full": the pool is preallocated, so device memory looks fine, but the
blocks running requests hold plus the prefixes worth keeping exceed the pool; the LRU pool of cached
blocks is evicted to admit new work, and the next request with that prefix computes it again. Seen
in ``engine.stats()``: ``evictions`` high, ``prefix_hit_rate`` low, ``prefill_tokens`` well above the
unique prompt tokens; the event log (``event_log=True``) shows ``evict`` events between a prefix's
uses. Fix: a bigger pool (``num_blocks``, or ``memory_fraction`` on a GPU), fewer concurrent requests
(``max_num_seqs``), ``scheduling_policy="prefix_affinity"`` (requests of one prefix run together), or
a host tier (``kv_offloading_size``, GiB of host memory): evicted blocks are copied there and copied
back on the next hit instead of recomputed (``host_hit_tokens`` in the stats; worth it where copying a
token's K/V is cheaper than computing it: a 7B model, not a 0.6B one, ``benchmarks/RESULTS.md``).

    python benchmarks/experiments/pitfalls/pool_too_small.py
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import tiny_engine  # noqa: E402

from jaxpaged import SamplingParams  # noqa: E402
from jaxpaged.llm import run_to_completion  # noqa: E402

SETTINGS = [  # (label, engine settings)
    ("pool of 10 blocks", dict(num_blocks=10)),
    ("pool of 10, scheduling_policy=prefix_affinity", dict(num_blocks=10, scheduling_policy="prefix_affinity")),
    ("pool of 10, host tier of 16 blocks (kv_offloading_size)", dict(num_blocks=10, kv_offloading_size=16 * 24_576 / 2**30)),
    ("pool of 24 blocks (the fix)", dict(num_blocks=24)),
]


def workload(vocab: int = 512) -> list[list[int]]:
    """12 requests, 3 agents with a 48-token (3-block) system prompt each, arriving interleaved."""
    rng = random.Random(0)
    systems = [[rng.randrange(1, vocab) for _ in range(48)] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(1, vocab) for _ in range(rng.randint(2, 9))] for i in range(12)]


def main(argv=None) -> dict:
    prompts = workload()
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    unique = 3 * 48 + sum(len(p) - 48 for p in prompts)  # what a cache that never forgets would prefill
    report = {}
    print(f"12 requests, 3 system prompts of 3 blocks, 2 running at a time; {unique} prompt tokens are unique")
    print(f"{'setting':56s} {'evictions':>9s} {'evict events':>12s} {'hit rate':>8s} {'from host':>9s} {'prefilled':>9s}")
    for label, settings in SETTINGS:
        engine = tiny_engine(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, event_log=True, **settings)
        run_to_completion(engine, prompts, sp)
        s = engine.stats()
        report[label] = dict(evictions=s["evictions"], evict_events=len(engine.kv.events.of_kind("evict")),
                             prefix_hit_rate=s["prefix_hit_rate"], prefill_tokens=s["prefill_tokens"],
                             host_hit_tokens=s["host_hit_tokens"], unique_prompt_tokens=unique)
        r = report[label]
        print(f"{label:56s} {r['evictions']:9d} {r['evict_events']:12d} {r['prefix_hit_rate']:8.1%} "
              f"{r['host_hit_tokens']:9d} {r['prefill_tokens']:9d}")
    print("fix: raise num_blocks / memory_fraction, lower max_num_seqs, use scheduling_policy='prefix_affinity', "
          "or add a host tier (kv_offloading_size)")
    return report


if __name__ == "__main__":
    main()
