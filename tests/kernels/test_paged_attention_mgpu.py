"""The Mosaic GPU ragged paged attention (Mosaic GPU's CPU interpreter) against the reference.

Every case draws fresh random inputs, places blocks in random physical order and fills every unused
pool slot (spare blocks and the tails of partial blocks) with NaN, and puts the layer read between two
all-NaN layers, so a read past ``kv_lens`` or of the wrong layer shows up. The interpreter also fills
uninitialised shared memory with NaN, raises on out-of-bounds reads and checks barrier phases: the
arithmetic and the TMA/barrier protocol. ``test_lowers_for_hopper`` runs the Pallas -> Mosaic GPU lowering
for sm_90a on the CPU; compiling and running on a GPU: ``benchmarks/check_attention_mgpu.py``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu
from jaxpaged.kernels.mosaic.layout import tile_layout
from jaxpaged.kernels.mosaic.prefill import launch_order, pair_layout, program_items, side_rows
from jaxpaged.kernels.kv_write import pool_from_caches
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference
from test_paged_attention import run_case as triton_run_case
from test_reference import random_batch



def run_case(seed, q_lens, kv_lens, bs, hq, hkv, d, dtype, interpret=True, **kw):
    """``test_paged_attention.run_case`` with the Mosaic GPU kernel."""
    return triton_run_case(seed, q_lens, kv_lens, bs, hq, hkv, d, dtype, kernel=paged_attention_mgpu,
                           interpret=interpret, **kw)


# Decode (q_len 1): context lengths 1, bs-1, bs, bs+1 and a long one (several KV tiles: each slot
# refilled, its barrier's phase flipping), over GQA/MQA/MHA, head dims 64/128, block sizes 8-64, both
# dtypes, and the tuning arguments (KV tile size, slots in flight, split-K). By default a decode
# launch this small is split (``choose_splits``: 32 splits here, most of them empty for the short
# contexts); ``num_splits=1`` is the unsplit kernel. ``uniform_decode``: the decode kernel with keys on
# wgmma's M (``mosaic/decode.py``) over bf16 pools, the query tiles otherwise.
DECODE = [
    # (bs, hq, hkv, d, dtype, kernel kwargs)
    (16, 4, 2, 64, jnp.float32, {}),  # GQA G=2, 4 blocks per KV tile, split by default
    (8, 4, 1, 128, jnp.bfloat16, dict(num_slots=3, num_splits=1, uniform_decode=True)),  # MQA, 8 blocks a KV tile
    (64, 2, 2, 64, jnp.bfloat16, dict(uniform_decode=True)),  # MHA, one block per KV tile, split
    (32, 8, 2, 128, jnp.float32, dict(block_kv=128, num_slots=1, num_splits=2)),  # G=4, D=128
    (16, 4, 2, 64, jnp.bfloat16, dict(num_splits=1)),  # case 0 unsplit
    (16, 14, 2, 128, jnp.bfloat16, dict(uniform_decode=True, num_splits=2)),  # G=7 (Qwen2.5's): R = 8 columns
]

SLOW_DECODE, SLOW_MIXED = {2, 4}, {2, 4}  # a quick subset (``-m "not slow"``) still covers every feature


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_DECODE else c
                                  for c in range(len(DECODE))])
def test_decode_ragged_context_lengths(case):
    bs, hq, hkv, d, dtype, kw = DECODE[case]
    kv_lens = [1, bs - 1, bs, bs + 1, (4 if case == 0 else 2) * 64 + 3]  # 5 (3) KV tiles of 64: slots reused
    run_case(10 + case, [1] * len(kv_lens), kv_lens, bs, hq, hkv, d, dtype, **kw)


# Prefill and mixed ragged batches: several query tiles per sequence, the causal diagonal across KV
# tiles, prefix hits, empty sequences, G not a power of two; the prefill tiles (block_q = 64 // G
# tokens, 32 at most) and, forced, decode-sized ones.
MIXED = [
    # (q_lens, kv_lens, bs, hq, hkv, d, dtype, kernel kwargs)
    ([1, 20, 0, 5], [9, 100, 4, 5], 16, 16, 2, 64, jnp.float32, {}),  # G=8: block_q=8, 20 tokens = 3 tiles
    ([70, 1, 3], [70, 130, 67], 64, 2, 2, 64, jnp.bfloat16, {}),  # G=1: block_q=32, causal within 70 tokens
    ([2, 1, 17], [2, 100, 30], 16, 6, 2, 64, jnp.float32, {}),  # G=3: block_q=21, 63 rows used
    ([2, 1, 17], [2, 100, 30], 16, 6, 2, 64, jnp.float32, dict(decode=True)),  # the same tiles, split-K
    ([1, 20, 0, 5], [9, 100, 4, 5], 16, 16, 2, 64, jnp.float32, dict(block_q=5)),  # 40-row tiles
    ([1, 3], [40, 200], 16, 4, 2, 64, jnp.float32, dict(num_splits=2)),  # split-K: padding tokens share a tile
    # A prompt chunk after a cached prefix in a step padded as a many-slot engine pads it (about as many
    # sequences as tokens): T <= 2 S takes the decode configuration (split-K), and the chunk's 30
    # tokens are still one tile, each token's keys ending at its own position.
    ([30] + [0] * 16, [230] + [0] * 16, 16, 4, 2, 64, jnp.float32, {}),
]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_MIXED else c
                                  for c in range(len(MIXED))])
def test_prefill_and_mixed_batches(case):
    *shapes, kw = MIXED[case]
    run_case(20 + case, *shapes, **kw)


# The warp-specialised prefill kernel (what a launch of more than SMALL_LAUNCH_TOKENS that is not
# decode-shaped runs by default; ``decode=False`` asks for it at any size): tile pairs whose
# second warpgroup owns no token, one token or a full tile; the pair's last key in the middle of a
# KV tile (stale values zeroed by the owning warpgroup while the other waits) or at its end; prefix
# hits; a first warpgroup whose keys end a tile early; KV tiles of 64 and 128 keys over 1-3 slots.
# The interpreter launches two programs, each taking several items in turn (the GPU: one an SM).
PREFILL = [
    # (q_lens, kv_lens, bs, hq, hkv, d, dtype, kernel kwargs)
    ([70, 33, 64], [70, 100, 64], 16, 4, 2, 64, jnp.bfloat16, dict(decode=False)),  # G=2: pairs of 64 tokens
    ([150, 1, 40], [150, 9, 300], 16, 4, 2, 64, jnp.float32, dict(block_kv=128, num_slots=3, decode=False)),
    ([129, 7], [200, 7], 32, 2, 2, 128, jnp.bfloat16, dict(num_slots=1, decode=False)),  # G=1: pairs of 128 tokens
    ([20, 3], [84, 3], 8, 6, 2, 64, jnp.float32, dict(block_kv=64, decode=False)),  # G=3: 21 tokens a warpgroup
    # After a 96-token prefix, the first warpgroup's keys end a KV tile before the second's: it keeps
    # taking its turns on the tensor cores (``schedule`` barrier) for that tile without reading it.
    ([64, 50], [160, 96], 16, 4, 2, 64, jnp.bfloat16, dict(block_kv=64, decode=False)),
    # Three slots of 128 keys leave no room for a second Q buffer: the next item's Q is copied when
    # the item before it has stored its output (``prefill_q_buffers``).
    ([20, 3, 70], [150, 3, 70], 16, 4, 2, 64, jnp.float32, dict(block_kv=128, num_slots=3, decode=False)),
    # G=7 (Qwen2.5's); 192 tokens, a multiple of 8, read in place without a copy: the last pair's second
    # warpgroup reads the last 64 rows of q (its first 56 rows another tile's, not stored); sequences
    # starting and ending between multiples of 8, their shared groups of rows through the side output.
    ([100, 13, 71, 3], [130, 13, 71, 40], 16, 7, 1, 64, jnp.float32, dict(decode=False)),
    # Decode rows of a mixed step (sequences of one new token), which the decode tiles compute, a KV head's
    # G heads in one tile: one inside a group of 8 rows it shares with the sequences either side, one
    # last before the padding; G=7 over two KV heads. The pairs' stores must leave their rows alone.
    ([13, 1, 50, 1], [13, 90, 60, 200], 16, 14, 2, 64, jnp.bfloat16, dict(decode=False)),
]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in (1, 2) else c
                                  for c in range(len(PREFILL))])
def test_prefill_kernel(case):
    *shapes, kw = PREFILL[case]
    run_case(40 + case, *shapes, **kw)


def test_prefill_launches_need_interpreter_threads(monkeypatch):
    """In interpret mode a prefill launch runs the warp-specialised kernel only where the interpreter
    has a thread for each of its warpgroups and the caller (else the one-warpgroup kernel: same
    result); this suite's interpreter has them (conftest), so the cases above run that kernel."""
    from jaxpaged.kernels.mosaic import attention as mgpu
    from jaxpaged.kernels.mosaic import prefill as ws

    assert mgpu.interpreter_threads() >= ws.NUM_COMPUTE + 2
    calls = []
    monkeypatch.setattr(mgpu, "paged_prefill_mgpu", lambda q, *a, **k: calls.append(q.shape) or jnp.zeros_like(q))
    q = jnp.ones((23, 4, 64), jnp.float32)
    pool = jnp.zeros((1, 4, 8, 2, 2, 64), jnp.float32)
    args = (q, pool, 0, jnp.array([0, 20, 23], jnp.int32), jnp.array([20, 3], jnp.int32), jnp.zeros((2, 3), jnp.int32))
    for threads, expected in ((4, [q.shape]), (2, [])):
        monkeypatch.setattr(mgpu, "interpreter_threads", lambda threads=threads: threads)
        calls.clear()
        out = paged_attention_mgpu(*args, interpret=True, decode=False)
        assert calls == expected and out.shape == q.shape


@pytest.mark.parametrize("num_tokens,fp8", [(128, False), (129, False), (128, True), (129, True)])
def test_short_launches_run_the_tiles_with_split_k(monkeypatch, num_tokens, fp8):
    """A launch of more than two tokens a sequence runs the prefill kernel only past SMALL_LAUNCH_TOKENS
    tokens (over bf16 and fp8 pools); a shorter one (a short prompt alone, after a cached prefix) runs
    the query tiles with the decode launches' split-K."""
    from jaxpaged.kernels.mosaic import attention as mgpu

    assert mgpu.SMALL_LAUNCH_TOKENS == 128
    calls = []
    monkeypatch.setattr(mgpu, "paged_prefill_mgpu", lambda q, *a, **k: calls.append(q.shape) or jnp.zeros_like(q))
    monkeypatch.setattr(mgpu, "paged_attention_tiles", lambda *a, **k: calls.append(k["num_splits"]) or a[0])
    dtype = jnp.float8_e4m3fn if fp8 else jnp.float32
    bs = 64 if fp8 else 16
    q = jnp.ones((num_tokens, 4, 64), jnp.bfloat16 if fp8 else jnp.float32)
    pool = jnp.zeros((1, 80, bs + fp8, 2, 2, 64), dtype)  # (an fp8 block: 64 slots + its scale row)
    args = (q, pool, 0, jnp.array([0, 30, 30, 30, 30], jnp.int32), jnp.array([4000, 0, 0, 0], jnp.int32),
            jnp.zeros((4, 80), jnp.int32))
    mgpu.paged_attention_mgpu(*args, interpret=True)
    prefill = num_tokens > 128
    assert calls == ([q.shape] if prefill else [mgpu.choose_splits(num_tokens, 4, 2, 64, 80 * bs, decode=True)])
    assert prefill or calls[0] > 1  # 8 programs unsplit: the cached prefix is split


def test_only_padding_and_empty_sequences():
    run_case(1, [0, 0], [5, 0], 8, 4, 2, 64, jnp.float32)


@pytest.mark.parametrize("num_items,num_programs", [(1, 1), (5, 5), (7, 3), (12, 3), (2048, 132), (1000, 132)])
def test_program_items(num_items, num_programs):
    """The persistent prefill launch's programs take every item exactly once, in waves of ``P``
    ranks, snaking (a program's ranks alternate between the front and the back of their waves)."""
    taken = []
    for prog in range(num_programs):
        count, rank = program_items(num_items, num_programs, prog)
        ranks = [int(rank(j)) for j in range(int(count))]
        assert all(r // num_programs == j for j, r in enumerate(ranks))  # one a wave, in wave order
        assert all(r % num_programs == (prog if j % 2 == 0 else num_programs - 1 - prog) for j, r in enumerate(ranks))
        taken += ranks
    assert sorted(taken) == list(range(num_items))


def test_prefill_launch_order():
    """The prefill kernel's programs start with the tiles that read the most keys; ties keep tile order,
    unowned tiles last (always in the interpreter; on a GPU for launches of more programs than SMs).
    Tiles of 4 tokens (the layout's test): tiles 0, 1, 2 and 4 read 5, 4, 6 and 12 keys; 3, 5, 6 are unowned."""
    meta, _ = tile_layout(jnp.array([0, 1, 7, 7, 9], jnp.int32), jnp.array([5, 6, 3, 12], jnp.int32), 11, 4)
    lpt, tile_order = [4, 2, 0, 1, 3, 5, 6], list(range(7))
    for kv_heads, interpret, want in ((2, True, lpt), (2, None, tile_order), (1024, None, lpt)):
        np.testing.assert_array_equal(np.asarray(launch_order(meta, kv_heads, interpret)), want)


def test_pair_layout_and_side_rows():
    """Pairs of 128 tokens from each sequence's first token rounded down to a multiple of 8; the padding
    tokens a sequence without keys; the side output's groups of 8 rows: each row of a group shared by two
    sequences comes back to its own token, and no other."""
    cu = jnp.array([0, 150, 153, 300], jnp.int32)
    kv = jnp.array([150, 10, 400], jnp.int32)
    meta = np.asarray(pair_layout(cu, kv, 304))
    assert meta.shape == (3 + 4, 6)
    owned = meta[meta[:, 0] >= 0]
    np.testing.assert_array_equal(owned[:, 0], [0, 0, 1, 2, 2, 3])
    np.testing.assert_array_equal(owned[:, 3], [0, 128, 144, 152, 280, 296])  # tok0
    np.testing.assert_array_equal(owned[:, 1], [0, 128, 1, 252, 380, -4])  # the position of tok0
    np.testing.assert_array_equal(owned[:, 2], [128, 150, 10, 380, 400, 0])  # kv_end (none for the padding)
    np.testing.assert_array_equal(owned[:, 4:], [[0, 150], [0, 150], [150, 153], [153, 300], [153, 300], [300, 304]])
    rows = np.asarray(side_rows(cu, 304))
    assert rows.shape == (2 * 4, 8)
    want = np.full((8, 8), 304)
    want[1, :6] = np.arange(144, 150)  # sequence 0's last group [144, 152), which sequence 1 starts in
    want[2, 6:] = [150, 151]
    want[3, 0] = 152  # sequence 1 ends in the next group, which sequence 2 starts in
    want[4, 1:] = np.arange(153, 160)
    want[5, :4] = np.arange(296, 300)
    want[6, 4:] = np.arange(300, 304)
    np.testing.assert_array_equal(rows, want)
    # A sequence of one new token owns no pair and no side rows (its row comes from the decode tiles),
    # though the group it sits in is shared with the sequences on either side; the padding keeps its own.
    cu, kv = jnp.array([0, 13, 14, 30], jnp.int32), jnp.array([13, 50, 16], jnp.int32)
    meta = np.asarray(pair_layout(cu, kv, 32))
    np.testing.assert_array_equal(meta[meta[:, 0] >= 0][:, [0, 3]], [[0, 0], [2, 8], [3, 24]])
    want = np.full((2 * 4, 8), 32)
    want[1, :5] = np.arange(8, 13)
    want[4, 6:] = [14, 15]
    want[5, :6] = np.arange(24, 30)
    want[6, 6:] = [30, 31]
    np.testing.assert_array_equal(np.asarray(side_rows(cu, 32)), want)
    # Over fp8 pools and at G < 4 the prefill kernel keeps such a sequence: its pair, its row through the side output.
    meta = np.asarray(pair_layout(cu, kv, 32, one_token_apart=False))
    np.testing.assert_array_equal(meta[meta[:, 0] >= 0][:, [0, 3]], [[0, 0], [1, 8], [2, 8], [3, 24]])
    want[2, 5] = 13
    np.testing.assert_array_equal(np.asarray(side_rows(cu, 32, one_token_apart=False)), want)


@pytest.mark.parametrize("q_lens,kv_lens,kw", [
    ([1], [37], dict(num_splits=1)), ([1, 1, 1], [37, 80, 1], {}),
    ([1, 37, 1, 1], [9, 137, 70, 2], dict(decode=True)), ([1, 37, 1, 1], [9, 137, 70, 2], dict(num_splits=1)),
])
def test_tiles_of_several_tokens_read_and_write_in_place(q_lens, kv_lens, kw):
    """No padding tokens and 4 query heads (G 2): tiles of up to 32 tokens, in decode-shaped launches
    too. The 37-token sequence's second tile (5 tokens) copies only its own tokens, ending at the last
    row of ``q``; its other rows are never written (NaN: the interpreter's uninitialised memory) nor
    stored, and each token's outputs are written in place: unsplit, and split, partials and log-sum-exps."""
    rng = np.random.default_rng(len(q_lens) + len(kw))
    q, k, v, cu, kl, tables = random_batch(rng, q_lens, kv_lens, 16, 4, 2, 64, pad_tokens=0)
    layer = pool_from_caches(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
    args = (jnp.asarray(q, jnp.float32), layer, 0, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables))
    np.testing.assert_allclose(np.asarray(paged_attention_mgpu(*args, interpret=True, **kw)),
                               np.asarray(paged_attention_reference(*args)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_no_shared_memory_races():
    """The interpreter's happens-before race detector over the copy/barrier/wgmma protocol."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = plgpu.InterpretGPUParams(detect_races=True)
    run_case(3, [1, 1, 9], [1, 200, 70], 16, 4, 2, 64, jnp.float32, interpret=params, decode=True)
    assert not gpu_interpret.get_races().races_found
    run_case(4, [40, 1, 9], [100, 200, 70], 16, 4, 2, 64, jnp.float32, interpret=params, decode=False)  # prefill kernel
    assert not gpu_interpret.get_races().races_found



def test_a_persistent_split_launch_reuses_its_barriers_and_memory_item_after_item(monkeypatch):
    """One program a KV head takes every item of a split launch in turn: tiles of 4 tokens, then 1, then
    3, ranges shorter than the 3 slots, each item's output leaving through the slots' memory before the
    next item's copies land there; the race detector sees no race, outputs match the reference."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
    from jax.experimental.pallas import mosaic_gpu as plgpu

    import jaxpaged.kernels.mosaic.tiles as tiles

    monkeypatch.setattr(tiles, "INTERPRET_PROGRAMS", 1)
    params = plgpu.InterpretGPUParams(detect_races=True)
    run_case(1, [9, 1, 3, 1, 6], [100, 5, 200, 64, 6], 16, 4, 2, 64, jnp.float32, interpret=params, block_q=4,
             num_splits=4, num_slots=3, decode=True)
    assert not gpu_interpret.get_races().races_found

@pytest.mark.parametrize("bs,hq,hkv,d,kw", [
    (16, 16, 8, 128, {}), (32, 4, 2, 64, dict(block_kv=128, num_slots=3)), (16, 16, 8, 128, dict(num_splits=8)),
    (16, 16, 8, 128, dict(block_q=4)),  # a prefill launch on the one-warpgroup kernel
    (16, 8, 8, 64, dict(decode=True)),  # G = 1: tiles of 32 tokens, 32 barriers (Mosaic GPU's most a group)
    (16, 16, 8, 128, dict(uniform_decode=True)),  # the decode kernel, keys on M (unsplit: 4 tokens of 8 heads)
    (16, 14, 2, 128, dict(uniform_decode=True, num_splits=8)),  # G = 7, split
    pytest.param(64, 6, 2, 64, {}, marks=pytest.mark.slow), pytest.param(8, 8, 1, 128, {}, marks=pytest.mark.slow),
])
def test_lowers_for_hopper(bs, hq, hkv, d, kw):
    """The whole Pallas -> Mosaic GPU lowering for sm_90a (what jax assumes with no GPU attached): the
    kernel's layouts, TMA slices and wgmma shapes are accepted, and a launch runs the kernel it should
    (the decode kernel where told ``uniform_decode``, the query tiles else). PTX compilation and
    running it need the GPU (benchmarks/check_attention_mgpu.py)."""
    if jax.default_backend() != "cpu":
        pytest.skip("cross-lowering check for machines without a GPU")
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    decode = bool(kw.get("num_splits") or kw.get("uniform_decode"))
    q = jax.ShapeDtypeStruct((4 if decode else 40, hq, d), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((3, 64, bs, 2, hkv, d), jnp.bfloat16)
    fn = jax.jit(lambda *a: paged_attention_mgpu(a[0], a[1], 2, *a[2:], **kw))
    text = fn.trace(q, pool, i32(5), i32(4), i32(4, 20)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text
    assert kernel_names(text) == ["paged_decode" if kw.get("uniform_decode") else "paged_attention_tiles"]


def kernel_names(lowered_text: str) -> list[str]:
    """The Mosaic GPU kernels of a lowered jit, by the names a profile shows them under (each
    ``<name>_mosaic_gpu_kernel``), in launch order (the serialised module's ``<name>_mosaic_gpu``
    symbols; ``stable_mosaic_gpu`` is its dialect's version attribute)."""
    return re.findall(r"\\00(?!stable_)(\w+)_mosaic_gpu\\00", lowered_text)


@pytest.mark.parametrize("hq,hkv,launches", [(4, 2, 1), (14, 2, 2)])
def test_decode_tiles_launch_only_at_large_groups(hq, hkv, launches):
    """A prefill launch runs the decode tiles for its sequences of one new token (a second Mosaic GPU
    kernel) only where the GQA group is at least DECODE_TILES_MIN_GROUP; below it the prefill kernel
    computes those rows itself (the cases above check both give the reference's outputs)."""
    from jaxpaged.kernels.mosaic.prefill import DECODE_TILES_MIN_GROUP

    assert (hq // hkv >= DECODE_TILES_MIN_GROUP) == (launches == 2)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    q = jax.ShapeDtypeStruct((256, hq, 64), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((2, 64, 16, 2, hkv, 64), jnp.bfloat16)
    fn = jax.jit(lambda *a: paged_attention_mgpu(a[0], a[1], 1, *a[2:]))
    text = fn.trace(q, pool, i32(5), i32(4), i32(4, 20)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@mosaic_gpu_v2(") == launches
    assert kernel_names(text) == ["paged_prefill", "one_token_rows"][:launches]


def test_invalid_inputs_raise():
    q = jnp.ones((4, 8, 64), jnp.float32)
    pool = jnp.ones((2, 10, 16, 2, 4, 64), jnp.float32)  # [L, N, bs, 2, Hkv, D]
    cu, kl, bt = jnp.array([0, 4], jnp.int32), jnp.array([4], jnp.int32), jnp.zeros((1, 2), jnp.int32)
    call = lambda *a, interpret=True: paged_attention_mgpu(*a, interpret=interpret)
    with pytest.raises(ValueError, match="interpret mode only"):
        call(q, pool, 0, cu, kl, bt, interpret=False)  # float32 on the GPU
    with pytest.raises(ValueError, match="fp8"):
        call(q, pool.astype(jnp.float8_e4m3fn), 0, cu, kl, bt)
    with pytest.raises(ValueError, match="dtype"):
        call(q.astype(jnp.bfloat16), pool, 0, cu, kl, bt)
    with pytest.raises(ValueError, match="bfloat16, float32 or fp8"):
        call(q.astype(jnp.float16), pool.astype(jnp.float16), 0, cu, kl, bt)
    with pytest.raises(ValueError, match="multiple"):
        call(jnp.ones((4, 6, 64)), pool, 0, cu, kl, bt)
    with pytest.raises(ValueError, match="head_dim"):
        call(jnp.ones((4, 8, 32)), pool[..., :32], 0, cu, kl, bt)
    with pytest.raises(ValueError, match="G = "):
        call(jnp.ones((4, 128, 64)), pool[:, :, :, :, :1], 0, cu, kl, bt)
    with pytest.raises(ValueError, match="block_size"):
        call(q, pool[:, :, :4], 0, cu, kl, bt)
    with pytest.raises(ValueError, match="int32"):
        call(q, pool, 0, cu.astype(jnp.float32), kl, bt)
    with pytest.raises(ValueError, match="S\\+1"):
        call(q, pool, 0, jnp.array([0, 2, 4], jnp.int32), kl, bt)
    with pytest.raises(ValueError, match="layer"):
        call(q, pool, 2, cu, kl, bt)
    with pytest.raises(ValueError, match="block_kv"):
        paged_attention_mgpu(q, pool, 0, cu, kl, bt, interpret=True, block_kv=96)
    with pytest.raises(ValueError, match="block_q"):
        paged_attention_mgpu(q, pool, 0, cu, kl, bt, interpret=True, block_q=33)  # 33 tokens x G=2 > 64 rows
    with pytest.raises(ValueError, match="num_slots"):
        paged_attention_mgpu(q, pool, 0, cu, kl, bt, interpret=True, num_slots=0)
    for bad in (3, 64, 0):
        with pytest.raises(ValueError, match="num_splits"):
            paged_attention_mgpu(q, pool, 0, cu, kl, bt, interpret=True, num_splits=bad)
    with pytest.raises(ValueError, match="shared memory"):  # 4 slots of 256 x 128 bf16 keys and values
        paged_attention_mgpu(jnp.ones((4, 8, 128), jnp.bfloat16), jnp.ones((1, 4, 16, 2, 4, 128), jnp.bfloat16),
                             0, cu, kl, bt, block_kv=256, num_slots=4)
