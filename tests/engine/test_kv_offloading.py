"""The host tier end to end: ``KVTransfers`` copies blocks out of and back into the pool exactly, in
place; an engine with ``kv_offloading_size`` produces the same tokens as one without, with more prefix
hits, and degrades to recompute when the tier is too small. (Bitwise equality under
``batch_invariant=True`` across eviction and reload cycles: ``test_batch_invariance.py``.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
from jaxpaged.engine.kv_transfer import KVTransfers, host_memory_kind
from jaxpaged.kv.host_tier import Transfer
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_transfers_round_trip_blocks_exactly_and_in_place(dtype):
    """Offload three blocks, overwrite them, reload them into other blocks: bit-exact, the other blocks
    (NaN-poisoned) untouched, the pool updated in its own buffer; the copies live in host memory."""
    rng = np.random.default_rng(0)
    shape = (3, 10, 5, 2, 2, 8)  # [L, blocks, block rows (+ an fp8 scale row), K/V, heads, head_dim]
    values = rng.standard_normal(shape).astype(np.float32)
    values[:, 9] = np.nan
    pool = jax.device_put(jnp.asarray(values).astype(dtype), jax.local_devices()[0])
    original = np.asarray(pool.astype(jnp.float32))
    t = KVTransfers(pool, num_slots=4)
    pool = t.run(pool, [Transfer("offload", b, s) for b, s in ((3, 0), (5, 1), (7, 2))])
    t.finish_offloads()
    assert all(t.slots[s].sharding.memory_kind == host_memory_kind(jax.local_devices()[0]) for s in range(3))
    pool = pool.at[:, 3].set(0).at[:, 5].set(0)  # the device blocks are reused for something else
    before = pool.unsafe_buffer_pointer()
    pool = t.run(pool, [Transfer("reload", 0, 0), Transfer("reload", 1, 1), Transfer("reload", 2, 2)])
    assert pool.unsafe_buffer_pointer() == before  # donated: updated in place
    got = np.asarray(pool.astype(jnp.float32))
    for dst, src in ((0, 3), (1, 5), (2, 7)):
        np.testing.assert_array_equal(got[:, dst], original[:, src])
    np.testing.assert_array_equal(got[:, 9], original[:, 9])  # NaN block untouched (NaN == NaN here)
    np.testing.assert_array_equal(got[:, 4], original[:, 4])
    s = t.stats()
    assert s["offload_bytes"] == s["reload_bytes"] == 3 * pool.nbytes // 10
    assert s["offload_blocks"] == s["reload_blocks"] == 3
    assert s["reload_gbps"] == 0.0  # not measured: no bandwidth made up from waiting


def test_measured_copy_costs_leave_the_pool_in_place():
    """``measure`` times each way alone (1 and up to ``MAX_BLOCKS`` blocks): both measured, the pool still
    updated in its own buffer, the bandwidth reported from the per-block time."""
    pool = jax.device_put(jnp.ones((2, 12, 4, 2, 2, 8), jnp.bfloat16), jax.local_devices()[0])
    t = KVTransfers(pool, num_slots=2, reserve=False)
    before = pool.unsafe_buffer_pointer()
    pool = t.measure(pool, repeats=1)
    assert pool.unsafe_buffer_pointer() == before
    assert set(t.measured) == {"offload", "reload"}
    for fixed, per_block in t.measured.values():
        assert fixed >= 0 and per_block >= 0
    _, per_block = t.measured["reload"]
    assert t.stats()["reload_gbps"] == (pytest.approx(t.block_bytes / per_block / 1e9) if per_block else 0.0)


def test_transfers_keep_the_decided_order():
    """A block offloaded, then overwritten by a reload, then offloaded again in one list: each copy
    sees the data the ones before it left (runs of a kind batched, never reordered)."""
    pool = jax.device_put(jnp.arange(4 * 6, dtype=jnp.float32).reshape(1, 4, 6), jax.local_devices()[0])
    t = KVTransfers(pool, num_slots=3)
    pool = t.run(pool, [Transfer("offload", 1, 0), Transfer("offload", 2, 1), Transfer("reload", 1, 1),
                        Transfer("offload", 1, 2), Transfer("reload", 0, 2), Transfer("reload", 0, 0)])
    t.finish_offloads()
    got = np.asarray(pool)[0]
    np.testing.assert_array_equal(got[1], np.arange(12, 18))  # block 2's data
    np.testing.assert_array_equal(np.asarray(t.slots[2])[0], np.arange(12, 18))
    np.testing.assert_array_equal(got[0], np.arange(6, 12))  # the later reload into block 0 wins


@functools.cache
def params():
    return load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)


RNG = np.random.default_rng(1)
PREFIXES = [[int(t) for t in RNG.integers(1, 500, 64)] for _ in range(6)]
PROMPTS = [p + [int(t) for t in RNG.integers(1, 500, 5)] for p in PREFIXES]
SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK_BYTES = 24_576  # a block of the tiny qwen3 in float32, every layer (checked below)


@functools.cache
def rounds(kv_offloading_size: float, n: int = 3):
    """Six requests with 64-token prefixes, three times over, through a pool that holds about two."""
    eng = LLMEngine(params(), EngineConfig(block_size=16, num_blocks=16, max_model_len=128, max_num_batched_tokens=128,
                                           kv_offloading_size=kv_offloading_size, event_log=True))
    outs = [run_to_completion(eng, PROMPTS, SP) for _ in range(n)]
    eng.kv.check_invariants()
    return eng, [[o.outputs[0].token_ids for o in r] for r in outs], outs


def test_engine_with_a_host_tier_matches_the_engine_without_and_hits_more():
    base_engine, base, _ = rounds(0)
    eng, got, outs = rounds(0.01)
    assert got == base
    s, s0 = eng.stats(), base_engine.stats()
    assert s["host_block_bytes"] == BLOCK_BYTES
    assert s["host_blocks"] * s["host_block_bytes"] <= 0.01 * 2**30 < (s["host_blocks"] + 1) * s["host_block_bytes"]
    assert s["prefix_hit_rate"] > s0["prefix_hit_rate"] + 0.3
    assert s["blocks_reloaded"] == s["host_hit_blocks"] > 0 and s["blocks_offloaded"] > 0
    assert s["reload_bytes"] == s["blocks_reloaded"] * s["host_block_bytes"]
    # Every request of a later round found its 4 prefix blocks: on the host tier, mostly.
    later = [o for r in outs[1:] for o in r]
    assert all(o.num_cached_tokens == 64 for o in later)
    assert sum(o.num_host_cached_tokens for o in later) == 16 * s["host_hit_blocks"]
    kinds = {e.kind for e in eng.kv.events}
    assert {"offload", "reload", "evict"} <= kinds
    d = eng.explain_prefix(PROMPTS[0], PROMPTS[0][:40])
    assert d.shared_full_blocks == 2 and set(d.cached_tiers) <= {"device", "host", "device+host"}


@pytest.mark.parametrize("size", [1e-6, 2 * BLOCK_BYTES / 2**30])
def test_a_tier_smaller_than_a_block_or_a_prefix_degrades_to_recompute(size):
    """Less than one block (no tier at all) or two blocks (less than one 4-block prefix): the same
    tokens, never an error."""
    _, base, _ = rounds(0)
    eng, got, _ = rounds(size)
    assert got == base
    assert eng.stats()["host_blocks"] in (0, 2)


def test_kv_offloading_size_is_checked():
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB >= 0"):
        EngineConfig(kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)


def test_the_measured_reload_rule_keeps_the_tokens():
    """The GPU warm-up's measurement (``LLMEngine._measure_reload_cost``), run here on the CPU: a ``ReloadCost``
    from timed copies and a timed prefill step reaches the KV manager, and the engine's tokens stay those of
    an engine without a tier whichever way it decides."""
    _, base, _ = rounds(0)
    eng = LLMEngine(params(), EngineConfig(block_size=16, num_blocks=16, max_model_len=128, max_num_batched_tokens=128,
                                           kv_offloading_size=0.01))
    compiled = eng.runner.precompile(eng.params.state, eng.kv_pool, eng._warmup_steps(), eng._prev_tokens)
    eng._measure_reload_cost(compiled)
    cost = eng.reload_cost
    assert cost is not None and eng.kv.policy.reload_cost is cost and cost.block_size == 16
    assert cost.seconds_per_block >= 0 and cost.recompute_seconds_per_token > 0
    got = [[o.outputs[0].token_ids for o in run_to_completion(eng, PROMPTS, SP)] for _ in range(3)]
    assert got == base
    s = eng.stats()
    if cost.ever_worth_reloading:  # the 2nd and 3rd pass hit the host tier: reloaded or, if cheaper, recomputed
        assert s["blocks_offloaded"] > 0 and s["blocks_reloaded"] + s["host_hits_recomputed"] > 0
    else:  # copies that could never pay are not made
        assert s["blocks_offloaded"] == s["blocks_reloaded"] == 0
    eng.kv.check_invariants()
