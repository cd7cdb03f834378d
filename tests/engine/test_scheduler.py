"""Scheduler behaviour around the prefix cache: requests that share a prefix and arrive together."""

from __future__ import annotations

import random

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
from jaxpaged.llm import run_to_completion
from jaxpaged.kv import KVCacheManager
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.request import Sequence


def test_simultaneous_requests_compute_a_shared_prefix_once():
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    rng = random.Random(0)
    system = [rng.randrange(512) for _ in range(100)]  # 6 full blocks of 16
    prompts = [system + [rng.randrange(512) for _ in range(rng.randint(3, 20))] for _ in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = LLMEngine(params, EngineConfig(kv_cache_dtype="float32", block_size=16, num_blocks=128, max_model_len=256,
                                                enable_prefix_caching=caching))
        outs = run_to_completion(engine, prompts, sp)
        results[caching] = ([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs],
                            engine.stats())
    (tokens_on, cached_on, stats_on), (tokens_off, _, stats_off) = results[True], results[False]
    assert tokens_on == tokens_off
    assert cached_on == [0] + [96] * 7  # the later requests waited one step and hit all 6 blocks
    assert stats_on["deferred_admissions"] >= 1
    assert stats_on["prefill_tokens"] == stats_off["prefill_tokens"] - 7 * 96


def test_remembered_match_sees_blocks_cached_since():
    """A request refused admission is matched again later: blocks cached meanwhile must count."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = Sequence("a", list(range(13)))  # 4 blocks: fills the pool
    kv.admit(a)
    b = Sequence("b", list(range(12)) + [99])
    assert not kv.can_admit(b)  # no room, and nothing cached yet
    a.num_computed_tokens = 13
    kv.cache_full_blocks(a)  # blocks 0-2 of a enter the trie
    kv.free(a)
    assert kv.prefix_hit_blocks(b) == 3
    assert kv.can_admit(b)
    kv.admit(b)
    assert b.num_cached_tokens == 12
