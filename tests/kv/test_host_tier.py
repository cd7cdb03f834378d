"""The host tier's bookkeeping: slots and their LRU, write-back on eviction, reload on a hit, the trie's
tiers, events and counters, and graceful degradation when the tier is too small (the random
interleavings are in ``test_kv_manager.KVMachine``'s ``host`` mode)."""

from __future__ import annotations

import pytest

from jaxpaged.request import Sequence
from jaxpaged.kv import KVCacheManager, explain_prefix
from jaxpaged.kv.errors import BlockStateError
from jaxpaged.kv.host_tier import HostBlockPool, ReloadCost, Transfer


def test_host_block_pool_lru_pins_and_release():
    evicted = []
    pool = HostBlockPool(3, on_evict=evicted.append)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2) and pool.num_free_slots == 0 and pool.num_used_slots == 3
    pool.touch(a)  # LRU order now b, c, a
    pool.pin(b)  # b cannot be evicted
    assert pool.allocate() == c and evicted == [c]
    pool.unpin(b)  # most recently used again: order a, c, b
    assert pool.allocate() == a and evicted == [c, a]
    pool.release(b)
    assert pool.num_free_slots == 1 and pool.used_slots() == {a, c}
    with pytest.raises(BlockStateError, match="host slot 1"):
        pool.release(b)
    assert pool.allocate() == b
    for slot in (a, b, c):
        pool.pin(slot)
    assert pool.allocate() is None  # every used slot pinned
    assert HostBlockPool(0).allocate() is None
    with pytest.raises(ValueError, match="num_slots"):
        HostBlockPool(-1)


def run(mgr: KVCacheManager, rid: str, tokens: list[int]) -> Sequence:
    """Admits a sequence, "computes" all its tokens, caches its full blocks, and frees it."""
    s = Sequence(rid, tokens)
    mgr.admit(s)
    s.num_computed_tokens = s.num_tokens
    mgr.cache_full_blocks(s)
    mgr.free(s)
    return s


def test_eviction_offloads_and_a_hit_reloads_in_order():
    mgr = KVCacheManager(4, 2, num_host_blocks=8, event_log=True)
    first = list(range(1, 8))  # 3 full blocks + 1 token
    run(mgr, "a", first)
    assert mgr.take_transfers() == []
    table_a = [0, 1, 2, 3]
    run(mgr, "b", [50 + t for t in range(7)])  # needs all 4 blocks: the 3 cached ones go to the host
    offloads = mgr.take_transfers()
    assert [t.kind for t in offloads] == ["offload"] * 3
    assert sorted(t.block_id for t in offloads) == table_a[:3]
    assert [node.tier for node in mgr.trie.path(first)] == ["host"] * 3
    s = Sequence("c", first)
    mgr.admit(s)  # a hit on the host tier: device blocks allocated, reloads queued
    reloads = mgr.take_transfers()
    assert [t.kind for t in reloads if t.kind == "reload"] == ["reload"] * 3
    by_slot = {t.slot: t.block_id for t in offloads}
    hit_nodes = mgr.trie.path(first)
    assert [t.slot for t in reloads if t.kind == "reload"] == [n.host_slot for n in hit_nodes]
    assert [t.block_id for t in reloads if t.kind == "reload"] == mgr.block_table(s)[:3]
    assert set(by_slot) == {n.host_slot for n in hit_nodes}
    # The evicted b blocks were offloaded before the reloads that reuse their device blocks.
    assert reloads.index(next(t for t in reloads if t.kind == "reload")) == sum(t.kind == "offload" for t in reloads)
    assert s.num_cached_tokens == 6 and s.num_host_cached_tokens == 6
    assert [node.tier for node in hit_nodes] == ["device+host"] * 3  # the host copy stays
    st = mgr.stats()
    assert (st.host_hit_blocks, st.blocks_reloaded, st.host_blocks, st.host_blocks_used) == (3, 3, 8, 6)
    assert st.blocks_offloaded == 6 and st.prefix_hit_tokens == 6 and "host tier 6/8" in str(st)
    kinds = {e.kind for e in mgr.events}
    assert {"offload", "reload", "evict"} <= kinds
    mgr.free(s)
    mgr.check_invariants()


def test_reevicting_a_block_with_a_host_copy_copies_nothing():
    mgr = KVCacheManager(4, 2, num_host_blocks=8)
    first, other = list(range(1, 8)), [50 + t for t in range(7)]
    run(mgr, "a", first)
    run(mgr, "b", other)
    run(mgr, "c", first)  # reloads a's blocks (they keep their host copies), offloads b's
    mgr.take_transfers()
    run(mgr, "d", other)  # evicts a's blocks again: already on the host, so only reloads of b's
    assert {t.kind for t in mgr.take_transfers()} == {"reload"}
    assert [node.tier for node in mgr.trie.path(first)] == ["host"] * 3
    mgr.check_invariants()


@pytest.mark.parametrize("slots", [1, 2])
def test_a_host_tier_smaller_than_a_prefix_degrades_to_recompute(slots):
    """Fewer slots than the prefix has blocks: the tier keeps what fits (most recently evicted), hits
    stop where the chain breaks, nothing fails."""
    mgr = KVCacheManager(4, 2, num_host_blocks=slots)
    first = list(range(1, 8))
    run(mgr, "a", first)
    run(mgr, "b", [50 + t for t in range(7)])
    mgr.take_transfers()
    assert mgr.host.num_used_slots == slots
    s = run(mgr, "c", first)
    # The first blocks were released last, so evicted last, and stay; a deeper block without its
    # parent would be unreachable, so it leaves with its subtree.
    assert s.num_cached_tokens == s.num_host_cached_tokens == 2 * slots
    mgr.check_invariants()


def test_host_eviction_of_a_host_only_parent_removes_its_subtree():
    mgr = KVCacheManager(8, 2, num_host_blocks=8)
    p = mgr.policy
    run(mgr, "a", list(range(1, 8)))  # blocks 0, 1, 2 cached
    nodes = mgr.trie.path(list(range(1, 8)))
    # Move the root block to the host by hand (as an eviction of it alone would), then reclaim its slot.
    root_block = nodes[0].block_id
    p.allocator.incref(root_block)
    slot = p.host.allocate()
    mgr.trie.set_host(nodes[0], slot)
    mgr.trie.drop_gpu(root_block)
    p.allocator.uncache(root_block)
    p.allocator.decref(root_block)
    p._on_host_evict(slot)
    p.host.release(slot)
    assert mgr.trie.path(list(range(1, 8))) == [] and len(mgr.trie) == 0
    assert mgr.num_cached_blocks == 0 and mgr.host.num_used_slots == 0
    mgr.check_invariants()


def test_explain_prefix_names_the_tier_of_each_shared_block():
    mgr = KVCacheManager(4, 2, num_host_blocks=8)
    first = list(range(1, 8))
    run(mgr, "a", first)
    run(mgr, "b", [50 + t for t in range(7)])
    tiers = [node.tier for node in mgr.trie.path(first)]
    d = explain_prefix(first, first[:5] + [99], 2, cached_tiers=tiers)
    assert d.shared_full_blocks == 2 and d.cached_tiers == ("host", "host")
    assert "cached now: 2 host" in str(d)
    assert explain_prefix(first, first, 2, cached_tiers=[]).cached_tiers == ("not cached",) * 3


def test_transfer_names_and_manager_without_a_tier():
    assert Transfer("offload", 3, 1).block_id == 3
    mgr = KVCacheManager(4, 2)
    assert mgr.host is None and mgr.take_transfers() == [] and mgr.stats().host_blocks == 0
    with pytest.raises(ValueError, match="reservation='paged'"):
        KVCacheManager(4, 2, reservation="max_len", enable_prefix_caching=False, max_model_len=4, num_host_blocks=2)


def test_reload_cost_weighs_the_copy_against_recomputing():
    cost = ReloadCost(seconds_per_block=10e-6, fixed_seconds=50e-6, recompute_seconds_per_token=1e-6, block_size=16)
    # a block: 16 us to recompute, 10 us to copy plus the reload's 50 us launch
    assert not cost.worth_reloading(1) and not cost.worth_reloading(8)
    assert cost.worth_reloading(9) and cost.ever_worth_reloading  # 140 < 144
    never = ReloadCost(seconds_per_block=20e-6, fixed_seconds=0.0, recompute_seconds_per_token=1e-6, block_size=16)
    assert not never.ever_worth_reloading and not never.worth_reloading(10_000)


def test_host_hits_cheaper_to_recompute_are_recomputed():
    mgr = KVCacheManager(4, 2, num_host_blocks=8)
    first = list(range(1, 8))  # 3 full blocks + 1 token
    run(mgr, "a", first)
    run(mgr, "b", [50 + t for t in range(7)])  # the 3 cached blocks go to the host
    assert [t.kind for t in mgr.take_transfers()] == ["offload"] * 3
    # Reloads pay from 4 blocks on: a hit of 3 host blocks is recomputed, no reload queued.
    mgr.set_reload_cost(ReloadCost(seconds_per_block=1.0, fixed_seconds=1.5, recompute_seconds_per_token=0.6,
                                   block_size=2))
    s = Sequence("c", first)
    assert mgr.prefix_hit_blocks(s) == 0
    mgr.admit(s)
    assert s.num_cached_tokens == 0
    assert [t.kind for t in mgr.take_transfers()] == ["offload"] * 3  # b's blocks make room: no reload
    stats = mgr.stats()
    assert stats.host_hits_recomputed == 3 and stats.blocks_reloaded == 0
    mgr.free(s)
    # Cheap copies: the same hit is reloaded.
    mgr.set_reload_cost(ReloadCost(seconds_per_block=0.1, fixed_seconds=0.0, recompute_seconds_per_token=1.0,
                                   block_size=2))
    s = Sequence("d", [50, 51, 52, 53, 54, 55, 9])  # b's prefix, on the host now
    mgr.admit(s)
    assert [t.kind for t in mgr.take_transfers() if t.kind == "reload"] == ["reload"] * 3
    mgr.free(s)
    mgr.check_invariants()


def test_no_offload_when_a_reload_can_never_pay():
    mgr = KVCacheManager(4, 2, num_host_blocks=8)
    mgr.set_reload_cost(ReloadCost(seconds_per_block=5.0, fixed_seconds=0.0, recompute_seconds_per_token=1.0,
                                   block_size=2))
    run(mgr, "a", list(range(1, 8)))
    run(mgr, "b", [50 + t for t in range(7)])  # evicts the 3 cached blocks: dropped, not copied
    assert mgr.take_transfers() == [] and mgr.host.num_used_slots == 0
    assert mgr.stats().blocks_offloaded == 0
    mgr.check_invariants()
