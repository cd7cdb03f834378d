"""PrefixTrie: token-exact matching of full blocks, cursors, salts, eviction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxpaged.kv import PrefixTrie
from kv_helpers import trie_evict, trie_match

BS = 4


def toks(n, start=0):
    return list(range(start, start + n))


def test_block_size_validated():
    with pytest.raises(ValueError, match="power of two"):
        PrefixTrie(6)


def test_empty_trie_matches_nothing():
    t = PrefixTrie(BS)
    assert trie_match(t, toks(20)) == [] and len(t) == 0


def test_insert_then_match_longest_run():
    t = PrefixTrie(BS)
    new, node = t.insert(toks(12), [7, 3, 9])
    assert new == [7, 3, 9] and node.block_id == 9 and len(t) == 3
    assert trie_match(t, toks(13)) == [7, 3, 9]
    assert trie_match(t, toks(10)) == [7, 3]  # third block not complete in the query
    assert trie_match(t, toks(6) + [99] * 10) == [7]  # diverges inside block 1


def test_fully_cached_prompt_leaves_one_token():
    """A prompt of exactly k cached blocks matches k-1: the last token still needs computing."""
    t = PrefixTrie(BS)
    t.insert(toks(12), [7, 3, 9])
    assert trie_match(t, toks(12)) == [7, 3]
    assert trie_match(t, toks(4)) == []
    assert trie_match(t, toks(5)) == [7]
    assert trie_match(t, []) == []


def test_partial_blocks_never_inserted():
    t = PrefixTrie(BS)
    new, _ = t.insert(toks(7), [1, 2])
    assert new == [1] and 2 not in t


def test_token_exact_no_false_hits():
    t = PrefixTrie(BS)
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    # Same second block under a different first block: must not hit block 11.
    assert trie_match(t, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == []
    assert trie_match(t, [1, 2, 3, 4, 5, 6, 7, 0, 9]) == [10]


def test_numpy_tokens_accepted():
    t = PrefixTrie(BS)
    t.insert(np.arange(8, dtype=np.int32), np.array([5, 6]))
    assert trie_match(t, np.arange(9, dtype=np.int64)) == [5, 6]
    assert trie_match(t, list(range(9))) == [5, 6]


def test_salts_are_separate_subtrees():
    t = PrefixTrie(BS)
    t.insert(toks(8), [1, 2], cache_salt="tenant-a")
    assert trie_match(t, toks(9)) == []
    assert trie_match(t, toks(9), cache_salt="tenant-b") == []
    assert trie_match(t, toks(9), cache_salt="tenant-a") == [1, 2]
    t.insert(toks(8), [3, 4])
    assert trie_match(t, toks(9)) == [3, 4]


def test_cursor_insertion_and_existing_nodes_followed():
    t = PrefixTrie(BS)
    new, node = t.insert(toks(4), [1])
    new, node = t.insert(toks(8), [1, 2], start_block=1, parent=node)
    assert new == [2] and node.block_id == 2
    # A second request computed the same two blocks in its own blocks 5, 6: existing nodes are
    # followed (duplicates not cached) and its third block goes under the existing node.
    new, node = t.insert(toks(12), [5, 6, 7])
    assert new == [7] and 5 not in t and 6 not in t
    assert trie_match(t, toks(13)) == [1, 2, 7]
    # Cursor already at the end: nothing to do.
    assert t.insert(toks(12), [5, 6, 7], start_block=3, parent=node) == ([], node)


def test_block_reused_for_other_tokens_rejected():
    t = PrefixTrie(BS)
    t.insert(toks(4), [1])
    with pytest.raises(ValueError, match="already cached"):
        t.insert(toks(4, start=100), [1])


def test_insert_validates_lengths():
    t = PrefixTrie(BS)
    with pytest.raises(ValueError):
        t.insert(toks(8), [1])


def test_evict_leaf_and_dead_cursor_restarts_from_root():
    t = PrefixTrie(BS)
    _, node = t.insert(toks(8), [1, 2])
    assert trie_evict(t, 2) == []
    assert not node.alive and 2 not in t
    assert trie_match(t, toks(9)) == [1]
    new, node2 = t.insert(toks(12), [1, 8, 9], start_block=2, parent=node)
    assert new == [8, 9] and trie_match(t, toks(13)) == [1, 8, 9]
    with pytest.raises(KeyError):
        trie_evict(t, 2)


def test_evict_interior_node_detaches_subtree():
    t = PrefixTrie(BS)
    t.insert(toks(12), [1, 2, 3])
    t.insert(toks(8) + [50, 51, 52, 53], [1, 2, 4])
    assert sorted(trie_evict(t, 2)) == [3, 4]
    assert len(t) == 1 and trie_match(t, toks(13)) == [1]


def test_empty_salt_root_dropped():
    t = PrefixTrie(BS)
    for salt in range(50):
        t.insert(toks(4), [salt], cache_salt=salt)
        trie_evict(t, salt)
    assert len(t._roots) == 0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=14), min_size=1, max_size=12))
def test_match_is_longest_exact_prefix(prompts):
    """Against a brute-force model: the hit is the longest run of inserted full blocks whose whole
    prefix equals the query's, never past len-1 tokens, and each hit block holds the queried tokens."""
    t = PrefixTrie(BS)
    holds: dict[int, tuple[int, ...]] = {}  # block id -> the full prefix its K/V encode
    next_id = 0
    for p in prompts:
        hits = trie_match(t, p)
        for i, b in enumerate(hits):
            assert holds[b] == tuple(p[: (i + 1) * BS])
        assert len(hits) * BS <= max(0, len(p) - 1)
        cached_prefixes = set(holds.values())
        expected = 0
        while (expected + 1) * BS <= len(p) - 1 and tuple(p[: (expected + 1) * BS]) in cached_prefixes:
            expected += 1
        assert len(hits) == expected
        ids = hits + list(range(next_id, next_id + len(p) // BS - len(hits) + 1))
        next_id += len(ids)
        new, _ = t.insert(p, ids)
        for b in new:
            i = ids.index(b)
            holds[b] = tuple(p[: (i + 1) * BS])
