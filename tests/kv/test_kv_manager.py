"""KVCacheManager end to end: admission with prefix hits, chunked prefill, decode growth, caching of
generated blocks, preemption, eviction, max_len reservation, stats, explain_prefix, the Sequence
block tables, and a hypothesis state machine over random interleavings that checks the invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpaged.engine.step_inputs import slot_mapping_batch
from jaxpaged.kv import (
    BlockStateError, BlockTables, DoubleFreeError, KVCacheManager, OutOfBlocksError, RequestTooLargeError,
    explain_prefix,
)
from jaxpaged.request import Sequence, SequenceStatus
from kv_helpers import BlockState, block_state, gather, trie_match

BS = 4


def seq(rid, tokens, salt=None):
    return Sequence(rid, list(tokens), cache_salt=salt)


def run_prefill(mgr, s, chunk=None):
    """Computes all known tokens of ``s`` (in chunks), caching full blocks, like the scheduler."""
    while s.num_computed_tokens < s.num_tokens:
        n = min(chunk or s.num_tokens, s.num_tokens - s.num_computed_tokens)
        mgr.append(s, n)
        s.num_computed_tokens += n
        mgr.cache_full_blocks(s)


def decode(mgr, s, token):
    """One decode step: the last sampled token is computed, a new one is sampled."""
    mgr.append(s, 1)
    s.num_computed_tokens += 1
    mgr.cache_full_blocks(s)
    s.append_token(token)


# ---- admission and prefix hits -------------------------------------------------------------------

def test_admit_allocates_whole_prompt_and_hits_shared_prefix():
    mgr = KVCacheManager(16, BS)
    a = seq("a", range(10))
    assert mgr.can_admit(a)
    mgr.admit(a)
    assert len(mgr.block_table(a)) == 3 and a.num_cached_tokens == 0 and a.num_computed_tokens == 0
    run_prefill(mgr, a)
    assert len(mgr.trie) == 2  # two full blocks, the partial third is not cached
    b = seq("b", list(range(9)) + [77, 78])
    mgr.admit(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert mgr.block_table(b)[:2] == mgr.block_table(a)[:2] and mgr.block_table(b)[2] != mgr.block_table(a)[2]
    assert mgr.allocator.ref_count(mgr.block_table(a)[0]) == 2
    mgr.check_invariants()


def test_fully_cached_prompt_recomputes_last_block():
    mgr = KVCacheManager(16, BS)
    a = seq("a", range(12))
    mgr.admit(a)
    run_prefill(mgr, a)
    b = seq("b", range(12))
    mgr.admit(b)
    assert b.num_cached_tokens == 8 and len(mgr.block_table(b)) == 3
    run_prefill(mgr, b)  # its third block duplicates a's: not cached twice
    assert len(mgr.trie) == 3
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_cached_blocks == 3 and mgr.num_free_blocks == 13
    mgr.check_invariants()


def test_chunked_prefill_caches_only_computed_full_blocks():
    mgr = KVCacheManager(16, BS)
    a = seq("a", range(14))
    mgr.admit(a)
    assert mgr.append(a, 5) == []  # admission already covered the prompt
    a.num_computed_tokens += 5
    assert mgr.cache_full_blocks(a) == [mgr.block_table(a)[0]]
    assert mgr.cache_full_blocks(a) == []  # idempotent
    a.num_computed_tokens += 5
    assert mgr.cache_full_blocks(a) == [mgr.block_table(a)[1]]
    other = seq("o", range(14))
    assert mgr.can_admit(other)
    mgr.admit(other)
    assert other.num_cached_tokens == 8


def test_decode_grows_one_block_per_block_size_and_caches_generated_tokens():
    mgr = KVCacheManager(16, BS)
    a = seq("a", range(6))
    mgr.admit(a)
    run_prefill(mgr, a)
    a.append_token(100)
    grown = []
    for t in range(101, 110):
        before = len(mgr.block_table(a))
        decode(mgr, a, t)
        grown.append(len(mgr.block_table(a)) - before)
    assert sum(grown) == math.ceil(15 / BS) - 2  # tokens 0..14 computed, 15 sampled
    assert a.num_computed_tokens == 15 and a.num_tokens == 16
    assert len(mgr.trie) == 3  # blocks 0..2 are full of computed K/V
    # A follow-up turn whose prompt is the whole conversation hits the generated blocks too.
    b = seq("b", a.token_ids + [1, 2])
    mgr.admit(b)
    assert b.num_cached_tokens == 12


def test_preempt_and_readmit_hits_own_blocks():
    mgr = KVCacheManager(8, BS)
    a = seq("a", range(9))
    mgr.admit(a)
    run_prefill(mgr, a)
    a.append_token(50)
    old = list(mgr.block_table(a))
    mgr.free(a)
    a.status = SequenceStatus.PREEMPTED
    assert mgr.block_table(a) == [] and a.num_computed_tokens == 0
    mgr.admit(a)
    assert a.num_cached_tokens == 8 and mgr.block_table(a)[:2] == old[:2]


def test_salt_isolates_tenants():
    mgr = KVCacheManager(16, BS)
    a = seq("a", range(9), salt="t1")
    mgr.admit(a)
    run_prefill(mgr, a)
    b = seq("b", range(9), salt="t2")
    mgr.admit(b)
    assert b.num_cached_tokens == 0
    c = seq("c", range(9))
    mgr.admit(c)
    assert c.num_cached_tokens == 0
    d = seq("d", range(9), salt="t1")
    mgr.admit(d)
    assert d.num_cached_tokens == 8


def test_no_prefix_caching():
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = seq("a", range(9))
    mgr.admit(a)
    run_prefill(mgr, a)
    assert mgr.trie is None and mgr.cache_full_blocks(a) == []
    mgr.free(a)
    assert mgr.num_free_blocks == 8 and mgr.num_cached_blocks == 0


def test_eviction_under_pressure_is_lru_and_logged():
    mgr = KVCacheManager(6, BS, event_log=True)
    a = seq("a", range(9))  # 3 blocks, 2 cacheable
    mgr.admit(a)
    run_prefill(mgr, a)
    old = list(mgr.block_table(a))
    mgr.free(a)
    assert mgr.num_cached_blocks == 2 and mgr.num_free_blocks == 4
    b = seq("b", range(100, 120))  # 5 blocks: the free list has 4, one cached block is evicted
    assert mgr.can_admit(b)
    mgr.admit(b)
    evicted = mgr.events.of_kind("evict")
    assert len(evicted) == 1 and evicted[0].block_ids == (old[1],)
    assert mgr.stats().evictions == 1 and len(mgr.trie) == 1  # the deeper block went first
    kinds = [e.kind for e in mgr.events]
    assert kinds[:2] == ["allocate", "insert"] and "free" in kinds and kinds[-1] == "allocate"
    mgr.check_invariants()


def test_evicting_parent_of_duplicate_detaches_and_cursor_recovers():
    """B recomputes a block A had cached (a fully cached prompt recomputes its last block), so B's
    next block hangs under A's node. Evicting A's unreferenced block detaches B's referenced child,
    which stops being cached; B's next insertion re-walks from the root and caches its own copies."""
    mgr = KVCacheManager(7, BS)
    a = seq("a", range(8))
    mgr.admit(a)
    run_prefill(mgr, a)
    a0, a1 = mgr.block_table(a)
    mgr.free(a)
    b = seq("b", range(8))
    mgr.admit(b)
    assert mgr.block_table(b)[0] == a0 and b.num_cached_tokens == 4
    run_prefill(mgr, b)
    b1 = mgr.block_table(b)[1]
    assert not mgr.allocator.is_cached(b1)  # duplicate of a1: not cached twice
    b.append_token(8)
    for t in range(9, 13):
        decode(mgr, b, t)
    b2 = mgr.block_table(b)[2]
    assert mgr.allocator.is_cached(b2) and mgr.trie.node(b2).parent.block_id == a1
    d = seq("d", range(100, 116))
    mgr.admit(d)  # needs 4 blocks, 3 free: evicts a1 (LRU), which detaches b2
    assert a1 in mgr.block_table(d) and not mgr.allocator.is_cached(b2)
    assert block_state(mgr.allocator, b2) is BlockState.REFERENCED and len(mgr.trie) == 1
    mgr.check_invariants()
    mgr.free(d)
    for t in range(13, 17):
        decode(mgr, b, t)
    b3 = mgr.block_table(b)[3]
    assert trie_match(mgr.trie, b.token_ids) == [a0, b1, b2, b3]
    mgr.free(b)
    mgr.check_invariants()


def test_out_of_blocks_leaves_state_unchanged():
    mgr = KVCacheManager(5, BS)
    a = seq("a", range(12))
    mgr.admit(a)
    b = seq("b", range(100, 112))
    assert not mgr.can_admit(b)
    with pytest.raises(OutOfBlocksError, match="'b'"):
        mgr.admit(b)
    assert mgr.block_table(b) == [] and mgr.num_free_blocks == 2
    mgr.admit(seq("c", [7]))
    run_prefill(mgr, a)
    a.append_token(1)
    for t in range(4):
        decode(mgr, a, t)  # the fourth block comes from the last free one
    assert len(mgr.block_table(a)) == 4 and mgr.num_free_blocks == 0
    assert a.num_computed_tokens == 16 and not mgr.can_append(a, 1)
    with pytest.raises(OutOfBlocksError, match="'a'"):
        mgr.append(a, 1)
    assert len(mgr.block_table(a)) == 4
    mgr.check_invariants()


# ---- clear errors ----------------------------------------------------------------------------------

def test_request_that_can_never_fit_names_request():
    mgr = KVCacheManager(4, BS)
    huge = seq("req-huge", range(17))
    with pytest.raises(RequestTooLargeError, match="req-huge.*only 4 blocks"):
        mgr.can_admit(huge)
    with pytest.raises(RequestTooLargeError, match="req-huge"):
        mgr.admit(huge)
    grow = seq("req-grow", range(16))
    mgr.admit(grow)
    grow.num_computed_tokens = 16
    with pytest.raises(RequestTooLargeError, match="req-grow"):
        mgr.can_append(grow, 1)


def test_max_model_len_enforced():
    mgr = KVCacheManager(64, BS, max_model_len=10)
    with pytest.raises(RequestTooLargeError, match="max_model_len=10"):
        mgr.can_admit(seq("x", range(11)))
    s = seq("y", range(10))
    mgr.admit(s)
    s.num_computed_tokens = 10
    with pytest.raises(RequestTooLargeError, match="'y'"):
        mgr.append(s, 1)


def test_double_free_and_double_admit():
    mgr = KVCacheManager(8, BS)
    a = seq("a", range(5))
    with pytest.raises(DoubleFreeError, match="'a'"):
        mgr.free(a)
    mgr.admit(a)
    with pytest.raises(BlockStateError, match="already holds"):
        mgr.admit(a)
    mgr.free(a)
    with pytest.raises(DoubleFreeError, match="already freed"):
        mgr.free(a)


def test_bad_configuration():
    with pytest.raises(ValueError, match="power of two"):
        KVCacheManager(8, 12)
    with pytest.raises(ValueError, match="reservation"):
        KVCacheManager(8, 4, reservation="greedy")
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        KVCacheManager(8, 4, reservation="max_len", max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(8, 4, reservation="max_len", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="more than the pool"):
        KVCacheManager(3, 4, reservation="max_len", enable_prefix_caching=False, max_model_len=16)
    with pytest.raises(ValueError, match="no tokens"):
        KVCacheManager(8, 4).can_admit(seq("e", []))


# ---- max_len reservation --------------------------------------------------------------------------

def test_max_len_reserves_contiguous_runs_and_counts_refusals():
    mgr = KVCacheManager(10, BS, reservation="max_len", enable_prefix_caching=False, max_model_len=12)
    seqs = [seq(f"r{i}", range(3)) for i in range(4)]
    for s in seqs[:3]:
        assert mgr.can_admit(s)
        mgr.admit(s)
    assert [mgr.block_table(s) for s in seqs[:3]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert not mgr.can_admit(seqs[3])  # one block left
    with pytest.raises(OutOfBlocksError, match="contiguous run of 3"):
        mgr.admit(seqs[3])
    st_ = mgr.stats()
    assert st_.max_len_admission_failures == 2 and st_.max_len_fragmentation_failures == 0
    assert st_.block_utilisation == pytest.approx(9 / 36)  # internal fragmentation
    assert mgr.append(seqs[0], 12) == []  # everything up to max_model_len is reserved already
    mgr.free(seqs[1])
    mgr.free(seqs[0])
    mgr.admit(seqs[3])
    assert mgr.block_table(seqs[3]) == [0, 1, 2]
    mgr.check_invariants()


class _Params:
    def __init__(self, max_tokens):
        self.max_tokens = max_tokens


def test_max_len_external_fragmentation_counted():
    """Per-request maximum lengths vary, so freed runs leave holes no new run fits in."""
    mgr = KVCacheManager(8, BS, reservation="max_len", enable_prefix_caching=False,
                         max_model_len=32, reserve_request_max_len=True)
    a, b, c = (Sequence(r, [1] * 4, sampling_params=_Params(m)) for r, m in
               [("a", 8), ("b", 4), ("c", 8)])
    for s in (a, b, c):
        mgr.admit(s)
    assert (mgr.block_table(a), mgr.block_table(b), mgr.block_table(c)) == ([0, 1, 2], [3, 4], [5, 6, 7])
    mgr.free(a)
    mgr.free(c)
    d = Sequence("d", [1] * 4, sampling_params=_Params(12))  # 4 blocks; 6 free, largest run 3
    assert mgr.num_free_blocks == 6 and not mgr.can_admit(d)
    with pytest.raises(OutOfBlocksError, match="largest run 3"):
        mgr.admit(d)
    st_ = mgr.stats()
    assert st_.max_len_admission_failures == 2 and st_.max_len_fragmentation_failures == 2
    assert "from fragmentation" in str(st_)
    with pytest.raises(RequestTooLargeError, match="'b'.*reservation"):
        b.num_computed_tokens = 8
        mgr.append(b, 1)
    mgr.check_invariants()


# ---- stats and explain_prefix -----------------------------------------------------------------------

def test_stats_utilisation_bytes_and_hit_rate():
    mgr = KVCacheManager(16, BS, bytes_per_token_slot=1024)
    a = seq("a", range(10))
    mgr.admit(a)
    run_prefill(mgr, a)
    b = seq("b", list(range(8)) + [9, 9])  # shares 2 blocks
    mgr.admit(b)
    s = mgr.stats()
    assert s.blocks_used == 4 and s.blocks_free == 12 and s.blocks_cached == 0
    assert s.filled_slots == 8 + 2 + 2 and s.allocated_slots == 16
    assert s.block_utilisation == pytest.approx(12 / 16)
    assert s.kv_bytes_in_use == 16 * 1024 and s.peak_blocks_used == 4
    assert s.prefix_queries == 2 and s.prefix_hit_blocks == 2 and s.prefix_hit_tokens == 8
    assert s.prefix_hit_rate == pytest.approx(8 / 20)
    mgr.free(a)
    mgr.free(b)
    s = mgr.stats()
    assert s.blocks_used == 0 and s.blocks_cached == 2 and s.peak_kv_bytes_in_use == 16 * 1024
    assert "prefix hit rate 40.0%" in str(s) and s.as_dict()["evictions"] == 0


def test_explain_prefix():
    system = list(range(40))
    a = system[:20] + [1111] + system[21:]  # e.g. a timestamp inside the system prompt
    d = explain_prefix(a, system, 16)
    assert (d.first_diff_token, d.first_diff_block, d.shared_full_blocks) == (20, 1, 1)
    assert (d.token_a, d.token_b) == (1111, 20)
    assert "first difference at token 20 (block 1, offset 4)" in str(d) and "share 1 full blocks" in str(d)
    same = explain_prefix(system, np.array(system), 16)
    assert same.identical and same.shared_full_blocks == 2 and "identical" in str(same)
    pre = explain_prefix(system[:33], system, 16)
    assert pre.first_diff_token == 33 and pre.token_a is None and pre.shared_full_blocks == 2
    assert "<end>" in str(pre)
    with pytest.raises(ValueError, match="power of two"):
        explain_prefix([1], [1], 10)


# ---- Sequence and the block tables --------------------------------------------------------------------

def test_sequence_fields_and_timestamps():
    s = Sequence("r", [1, 2, 3], sampling_params={"temperature": 0}, cache_salt="t", arrival_time=5.0)
    assert s.status is SequenceStatus.WAITING and s.prompt_token_ids == [1, 2, 3]
    s.append_token(9, now=6.0)
    s.append_token(8, now=7.0)
    assert s.output_token_ids == [9, 8] and s.num_tokens == 5 and s.first_token_time == 6.0
    assert s.last_token_id == 8 and s.num_output_tokens == 2 and s.num_uncomputed_tokens == 5
    s.finish("length", now=8.0)
    assert s.is_finished and s.finish_reason == "length" and s.finish_time == 8.0
    assert "'r'" in repr(s)


def test_block_tables_gather_and_slot_mapping():
    tables = BlockTables(rows=2, width=2)
    a, b, c = tables.add([3, 7, 2]), tables.add([5]), tables.add([])  # grows rows and width
    out = gather(tables, [a, b, c], 4)
    assert out.dtype == np.int32 and out.tolist() == [[3, 7, 2, 0], [5, 0, 0, 0], [0, 0, 0, 0]]
    tables.append(a, [9])
    assert gather(tables, [a], 4).tolist() == [[3, 7, 2, 9]] and tables.blocks(a) == [3, 7, 2, 9]
    with pytest.raises(ValueError, match="more than width=3"):
        gather(tables, [a], 3)
    assert gather(tables, [], 4).shape == (0, 4)
    got = slot_mapping_batch(gather(tables, [a, b], 4), np.array([0, 0, 1]), np.array([5, 13, 2]), 4)
    assert got.dtype == np.int32 and got.tolist() == [7 * 4 + 1, 9 * 4 + 1, 5 * 4 + 2]
    assert tables.remove(a) == [3, 7, 2, 9] and not tables.table[a].any() and tables.num_blocks(a) == 0


def test_block_tables_grow_and_match_after_frees():
    """The manager's matrix (rows and width double as needed) holds each admitted table in its own row,
    zeros elsewhere, through frees and growth; a sequence keeps only its row number."""
    mgr = KVCacheManager(400, 1, enable_prefix_caching=False)
    seqs = [seq(f"r{i}", range(1 + i % 5)) for i in range(70)]
    for s in seqs:
        mgr.admit(s)
    big = seq("big", range(100))
    mgr.admit(big)
    for s in seqs[::3]:
        mgr.free(s)
        assert s.block_table_row == -1 and mgr.block_table(s) == []
    live = [s for s in seqs if s.block_table_row >= 0] + [big]
    for s in live[:10]:
        s.num_computed_tokens = s.num_tokens
        mgr.append(s, 3)
    mgr.check_invariants()
    width = 128
    expect = np.zeros((len(live), width), np.int32)
    for i, s in enumerate(live):
        expect[i, : len(mgr.block_table(s))] = mgr.block_table(s)
    assert mgr.tables.table.shape[0] >= 71 and mgr.tables.width >= 100
    rows = [s.block_table_row for s in live]
    assert np.array_equal(gather(mgr.tables, rows, width), expect)
    assert np.array_equal(gather(mgr.tables, rows, 256)[:, :width], expect)
    for s in live:
        mgr.free(s)
    assert not mgr.tables.table.any() and mgr.tables.rows_in_use == 0
    mgr.check_invariants()


# ---- property test: random interleavings ------------------------------------------------------------

FAMILIES = [
    [i % 4 for i in range(48)],  # periodic: equal block contents at different depths
    [0] * 48,  # every block identical: only the parent path tells them apart
    list(range(5, 53)),
]
MAX_TOKENS = 40


class KVMachine(RuleBasedStateMachine):
    """Admit / grow (chunked prefill or decode) / finish / preempt / re-admit under a small pool, with
    or without a host tier under the prefix cache (its copies applied as the device would, in order)."""

    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(6, 32),
        mode=st.sampled_from(["cache", "cache", "host", "host", "nocache", "max_len"]),
        host_slots=st.sampled_from([1, 2, 5, 40]),
    )
    def setup(self, bs, num_blocks, mode, host_slots):
        self.bs, self.n = bs, num_blocks
        if mode == "max_len":
            self.max_model_len = bs * min(num_blocks, 6)
            self.mgr = KVCacheManager(num_blocks, bs, reservation="max_len",
                                      enable_prefix_caching=False, max_model_len=self.max_model_len)
        else:
            self.max_model_len = None
            self.mgr = KVCacheManager(num_blocks, bs, enable_prefix_caching=mode != "nocache",
                                      num_host_blocks=host_slots if mode == "host" else 0)
        if self.mgr.allocator is not None:
            inner = self.mgr.allocator.on_evict

            def spy(block_id):  # eviction never takes a block some block table holds
                assert self.mgr.allocator.ref_count(block_id) == 0
                assert all(block_id not in self.mgr.block_table(s) for s in self.running)
                return inner(block_id)

            self.mgr.allocator.on_evict = spy
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.finished: list[Sequence] = []
        # What each physical block holds, as the device would: (salt, tokens from position 0 through
        # the block's last written slot). None: allocated but not written yet. Host slots likewise.
        self.content: dict[int, tuple | None] = {}
        self.host_content: dict[int, tuple | None] = {}
        self.count = 0

    def _copy(self):
        """Runs the queued copies between the tiers, in order (what the engine does before a step)."""
        for t in self.mgr.take_transfers():
            if t.kind == "offload":
                self.host_content[t.slot] = self.content[t.block_id]
            else:
                self.content[t.block_id] = self.host_content[t.slot]

    def _too_large(self, num_tokens):
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            return True
        return math.ceil(num_tokens / self.bs) > self.n

    def _try_admit(self, s):
        if self._too_large(s.num_tokens):
            with pytest.raises(RequestTooLargeError, match=s.request_id):
                self.mgr.can_admit(s)
            self.finished.append(s)
            return
        if not self.mgr.can_admit(s):
            with pytest.raises(OutOfBlocksError):
                self.mgr.admit(s)
            assert self.mgr.block_table(s) == []
            self.waiting.append(s)
            return
        self.mgr.admit(s)
        self._copy()
        s.status = SequenceStatus.RUNNING
        bs, hits = self.bs, s.num_cached_tokens // self.bs
        assert s.num_cached_tokens % bs == 0 and s.num_cached_tokens <= s.num_tokens - 1
        for i, b in enumerate(self.mgr.block_table(s)[:hits]):  # a hit holds exactly the requested tokens
            assert self.content[b] == (s.cache_salt, tuple(s.token_ids[: (i + 1) * bs]))
        for b in self.mgr.block_table(s)[hits:]:
            self.content[b] = None
        self.running.append(s)

    @rule(family=st.integers(0, 2), plen=st.integers(0, 30),
          suffix=st.lists(st.integers(0, 3), max_size=8), salt=st.sampled_from([None, None, "t"]))
    def admit(self, family, plen, suffix, salt):
        tokens = FAMILIES[family][:plen] + suffix
        if not tokens:
            return
        self.count += 1
        self._try_admit(Sequence(f"req-{self.count}", tokens, cache_salt=salt))

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100))
    def readmit(self, i):
        self._try_admit(self.waiting.pop(i % len(self.waiting)))

    def _release(self, s, requeue):
        self.mgr.free(s)
        self.running.remove(s)
        (self.waiting if requeue else self.finished).append(s)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6), token=st.integers(0, 3))
    def step(self, i, n, token):
        s = self.running[i % len(self.running)]
        n = min(n, s.num_tokens - s.num_computed_tokens)
        required = s.num_computed_tokens + n
        if self._too_large(required):
            with pytest.raises(RequestTooLargeError, match=s.request_id):
                self.mgr.can_append(s, n)
            return self._release(s, requeue=False)
        if not self.mgr.can_append(s, n):
            with pytest.raises(OutOfBlocksError):
                self.mgr.append(s, n)
            return
        new = self.mgr.append(s, n)
        self._copy()
        for b in new:
            self.content[b] = None
        bs, table = self.bs, self.mgr.block_table(s)
        for j in range(s.num_computed_tokens // bs, (required - 1) // bs + 1):  # "compute" K/V
            end = min(required, (j + 1) * bs)
            self.content[table[j]] = (s.cache_salt, tuple(s.token_ids[:end]))
        s.num_computed_tokens = required
        self.mgr.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            if s.num_tokens >= MAX_TOKENS:
                return self._release(s, requeue=False)
            s.append_token(token)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self._release(self.running[i % len(self.running)], requeue=False)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def preempt(self, i):
        s = self.running[i % len(self.running)]
        self._release(s, requeue=True)
        assert self.mgr.block_table(s) == [] and s.num_computed_tokens == 0

    @precondition(lambda self: self.finished)
    @rule(i=st.integers(0, 100))
    def double_free(self, i):
        with pytest.raises(DoubleFreeError):
            self.mgr.free(self.finished[i % len(self.finished)])

    @invariant()
    def bookkeeping_matches_block_tables(self):
        if not hasattr(self, "mgr"):
            return
        mgr = self.mgr
        mgr.check_invariants()
        holders = [0] * self.n
        for s in self.running:
            assert len(self.mgr.block_table(s)) * self.bs >= s.num_computed_tokens
            for b in self.mgr.block_table(s):
                holders[b] += 1
        if mgr.allocator is None:
            assert mgr.num_used_blocks == sum(holders) == len(self.running) * mgr.policy.run_length
            for s in self.running:  # contiguous runs of the reserved length
                assert self.mgr.block_table(s) == list(range(self.mgr.block_table(s)[0], self.mgr.block_table(s)[0] + mgr.policy.run_length))
                assert len(self.mgr.block_table(s)) * self.bs >= self.max_model_len
            return
        alloc, trie = mgr.allocator, mgr.trie
        in_trie = set(trie.block_ids()) if trie is not None else set()
        for b in range(self.n):
            assert alloc.ref_count(b) == holders[b]
            expected = (BlockState.REFERENCED if holders[b] else
                        BlockState.CACHED if b in in_trie else BlockState.FREE)
            assert block_state(alloc, b) is expected
        assert alloc.num_free_blocks + alloc.num_cached_blocks + alloc.num_used_blocks == self.n
        for b in in_trie:  # every findable block holds exactly the tokens of its trie path
            node, keys = trie.node(b), []
            while node.parent is not None:  # and is reachable from its salt's root
                assert node.alive and node.parent.children[node.key] is node
                keys.append(node.key)
                node = node.parent
            assert trie._roots[node.key] is node
            path = tuple(t for key in reversed(keys) for t in key)
            assert self.content[b] == (node.key, path)
        host = mgr.host
        if host is not None:
            assert host.num_used_slots <= host.num_slots
            for slot in trie.host_slots():  # every host copy holds exactly the tokens of its trie path
                node, keys = trie.host_node(slot), []
                while node.parent is not None:
                    assert node.alive and node.parent.children[node.key] is node
                    keys.append(node.key)
                    node = node.parent
                assert self.host_content[slot] == (node.key, tuple(t for key in reversed(keys) for t in key))

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for s in list(self.running):
            self._release(s, requeue=False)
        mgr = self.mgr
        mgr.check_invariants()
        assert mgr.num_used_blocks == 0  # nothing leaks
        assert mgr.num_free_blocks + mgr.num_cached_blocks == self.n
        if mgr.trie is not None:
            assert mgr.num_cached_blocks == len(mgr.trie)
        if mgr.host is not None:  # every used host slot is a findable block
            assert mgr.host.num_used_slots == len(mgr.trie.host_slots())
        assert mgr.stats().blocks_used == 0


KVMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)
TestKVMachine = KVMachine.TestCase


def test_block_tables_gather_into_cuts_pads_and_checks_width():
    """``BlockTables.gather_into`` writes rows cut to a narrower width or zero-padded past the table's
    own width (a step's fixed width can exceed it), refuses a row longer than the width, and keeps
    ``row_lengths`` equal to ``lengths`` through appends, removals and growth."""
    import numpy as np
    import pytest

    from jaxpaged.kv.block_tables import BlockTables

    t = BlockTables(rows=2, width=2)
    a = t.add([5, 6, 7])  # grows the width
    b = t.add([9])
    c = t.add([1, 2])  # grows the rows
    assert t.row_lengths == t.lengths.tolist() and t.row_lengths[a] == 3
    rows = np.array([c, a], np.int64)
    wide = np.full((2, t.width + 3), -7, np.int32)
    t.gather_into(rows, wide)
    assert wide.tolist() == [[1, 2] + [0] * (t.width + 1), [5, 6, 7] + [0] * t.width]
    narrow = np.full((1, 3), -7, np.int32)
    t.gather_into(np.array([a], np.int64), narrow)
    assert narrow.tolist() == [[5, 6, 7]]
    with pytest.raises(ValueError, match="more than width=2"):
        t.gather_into(np.array([a], np.int64), np.zeros((1, 2), np.int32))
    assert t.remove(a) == [5, 6, 7] and t.row_lengths == t.lengths.tolist() and t.num_blocks(b) == 1


def test_start_cost_does_not_grow_with_the_pool():
    """A manager over a 16-million-block pool (what free memory would size for a tiny model on a big
    GPU) is built and used in O(1) host memory and time: nothing per block is made up front."""
    import time
    import tracemalloc

    tracemalloc.start()
    t0 = time.perf_counter()
    mgr = KVCacheManager(16_000_000, 16, max_model_len=4096)
    a = seq("a", range(100))
    mgr.admit(a)
    run_prefill(mgr, a)
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 2_000_000, (elapsed, peak)
    assert mgr.num_used_blocks == 7 and mgr.allocator.num_free_blocks == 16_000_000 - 7
    assert mgr.block_table(a) == list(range(7))  # fresh blocks in id order
    mgr.free(a)
    assert mgr.allocator.num_available_blocks == 16_000_000 and mgr.num_used_blocks == 0
