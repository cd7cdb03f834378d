"""BlockAllocator (free list, ref counts, LRU pool of cached blocks) and the max_len ContiguousReserver."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from jaxpaged.kv import (
    BlockAllocator, BlockStateError, ContiguousReserver, DoubleFreeError, OutOfBlocksError, check_block_size,
    max_len_run_length,
)
from kv_helpers import BlockState, block_state


@pytest.mark.parametrize("bad", [0, -16, 3, 12, 24, 1.0, "16", True, None])
def test_block_size_must_be_positive_power_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        check_block_size(bad)
    with pytest.raises(ValueError, match="power of two"):
        BlockAllocator(8, bad)


@pytest.mark.parametrize("good", [1, 2, 16, 256])
def test_block_size_powers_of_two_accepted(good):
    assert BlockAllocator(4, good).block_size == good


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 16)


def test_allocate_free_roundtrip_and_counts():
    a = BlockAllocator(4, 16)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_used_blocks == 3 and a.num_free_blocks == 1
    assert all(a.ref_count(b) == 1 and block_state(a, b) is BlockState.REFERENCED for b in got)
    a.free(got)
    assert a.num_free_blocks == 4 and a.num_used_blocks == 0
    assert all(block_state(a, b) is BlockState.FREE for b in got)


def test_out_of_blocks_is_all_or_nothing():
    a = BlockAllocator(4, 16)
    a.allocate(3)
    with pytest.raises(OutOfBlocksError, match="need 2 blocks"):
        a.allocate(2)
    assert a.num_free_blocks == 1  # nothing was taken


def test_double_free_raises():
    a = BlockAllocator(2, 16)
    (b,) = a.allocate(1)
    a.decref(b)
    with pytest.raises(DoubleFreeError, match=f"block {b}"):
        a.decref(b)


def test_incref_of_free_block_raises():
    a = BlockAllocator(2, 16)
    with pytest.raises(BlockStateError, match="free block"):
        a.incref(0)


def test_mark_cached_requires_reference():
    a = BlockAllocator(2, 16)
    with pytest.raises(BlockStateError):
        a.mark_cached(0)


def test_cached_block_goes_to_lru_and_can_be_taken_back():
    a = BlockAllocator(3, 16)
    (b,) = a.allocate(1)
    a.mark_cached(b)
    a.decref(b)
    assert block_state(a, b) is BlockState.CACHED and a.is_evictable(b)
    assert a.num_cached_blocks == 1 and a.num_available_blocks == 3 and a.num_used_blocks == 0
    a.incref(b)  # a prefix hit revives it
    assert block_state(a, b) is BlockState.REFERENCED and not a.is_evictable(b)
    assert a.num_cached_blocks == 0


def test_free_list_used_before_eviction_then_lru_order():
    evicted: list[int] = []
    a = BlockAllocator(4, 16, on_evict=lambda b: evicted.append(b))
    blocks = a.allocate(4)
    for b in blocks:
        a.mark_cached(b)
    a.free(blocks[:2])  # released tail first: blocks[1] then blocks[0]
    a.decref(blocks[3])
    a.decref(blocks[2])  # LRU order: blocks[1], blocks[0], blocks[3], blocks[2]
    assert a.evictable_block_ids() == [blocks[1], blocks[0], blocks[3], blocks[2]]
    got = a.allocate(3)
    assert evicted == [blocks[1], blocks[0], blocks[3]]
    assert sorted(got) == sorted(evicted)
    assert block_state(a, blocks[2]) is BlockState.CACHED and a.num_evictions == 3
    assert all(not a.is_cached(b) for b in got)


def test_eviction_only_when_free_list_empty():
    evicted: list[int] = []
    a = BlockAllocator(4, 16, on_evict=lambda b: evicted.append(b))
    (c,) = a.allocate(1)
    a.mark_cached(c)
    a.decref(c)
    got = a.allocate(3)
    assert evicted == [] and c not in got
    a.allocate(1)
    assert evicted == [c]


def test_on_evict_detached_blocks_are_uncached():
    a = BlockAllocator(4, 16)
    blocks = a.allocate(3)
    for b in blocks:
        a.mark_cached(b)
    a.decref(blocks[0])  # LRU head
    a.decref(blocks[1])  # also cached, unreferenced
    # blocks[2] stays referenced; evicting blocks[0] "detaches" both others
    a.on_evict = lambda b: [blocks[1], blocks[2]]
    a.allocate(1)  # free list has one block: no eviction yet
    assert a.num_evictions == 0
    a.allocate(1)
    assert a.num_evictions == 1
    assert block_state(a, blocks[1]) is BlockState.FREE  # detached unreferenced -> free list
    assert block_state(a, blocks[2]) is BlockState.REFERENCED and not a.is_cached(blocks[2])
    a.decref(blocks[2])
    assert block_state(a, blocks[2]) is BlockState.FREE


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]), st.integers(0, 7)),
                max_size=60))
def test_allocator_partition_property(ops):
    """Under any sequence of operations every block is exactly one of free / referenced / cached."""
    n = 8
    a = BlockAllocator(n, 4, on_evict=lambda b: None)
    held: list[int] = []  # multiset of references we hold
    for op, k in ops:
        if op == "alloc":
            if k <= a.num_available_blocks:
                held += a.allocate(k)
            else:
                with pytest.raises(OutOfBlocksError):
                    a.allocate(k)
        elif op == "free" and held:
            a.decref(held.pop(k % len(held)))
        elif op == "cache" and held:
            a.mark_cached(held[k % len(held)])
        elif op == "hit" and a.evictable_block_ids():
            b = a.evictable_block_ids()[k % a.num_cached_blocks]
            a.incref(b)
            held.append(b)
        free, lru = set(a.free_block_ids()), set(a.evictable_block_ids())
        for b in range(n):
            assert a.ref_count(b) == held.count(b)
            assert (b in free) + (b in lru) + (a.ref_count(b) > 0) == 1
            assert (b in lru) <= a.is_cached(b)
        assert a.num_free_blocks + a.num_cached_blocks + a.num_used_blocks == n


# ---- max_len reservation -------------------------------------------------------------------------

def test_run_length():
    assert max_len_run_length(100, 16) == 7
    assert max_len_run_length(128, 16) == 8
    with pytest.raises(ValueError, match="max_model_len"):
        max_len_run_length(None, 16)


def test_first_fit_and_release():
    r = ContiguousReserver(10)
    assert r.reserve(4) == [0, 1, 2, 3]
    assert r.reserve(3) == [4, 5, 6]
    r.release([0, 1, 2, 3])
    assert r.reserve(2) == [0, 1]  # first fit, not best fit
    assert r.free_runs() == [(2, 2), (7, 3)]
    assert r.reserve(3) == [7, 8, 9]
    assert r.num_used_blocks == 8 and r.num_free_blocks == 2


def test_fragmentation_detected():
    r = ContiguousReserver(8)
    a, b, c = r.reserve(3), r.reserve(2), r.reserve(3)
    r.release(a)
    r.release(c)
    assert r.num_free_blocks == 6 and r.largest_free_run() == 3
    assert r.reserve(4) is None and r.is_fragmentation(4)
    assert r.reserve(7) is None and not r.is_fragmentation(7)  # plainly too few free blocks
    assert b == [3, 4]


def test_release_unreserved_is_double_free():
    r = ContiguousReserver(4)
    run = r.reserve(2)
    r.release(run)
    with pytest.raises(DoubleFreeError):
        r.release(run)
