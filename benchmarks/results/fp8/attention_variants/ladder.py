"""Where the fp8 decode-attention gap goes: the engine's kernel (320 us on the H200) vs the stripped-down
variant loop over the same pool layout (221 us), and a ladder of kernels in between.

Decode, batch S x context CTX, 16 query / 8 KV heads, head_dim 128, one layer, an fp8 (e4m3) pool of
block size 64 written by the engine's own ``write_kv`` (values transposed per (block, head) slab, a
scale row per block). Every kernel reads that one pool. Rows:

  E0   the engine: ``paged_attention(q, pool, 0, cu, kv_lens, tables)`` exactly as the engine calls it
  E1   a replica of the engine's fp8 decode path with every engine feature on (``Knobs()``); must time as E0
  E-x  E1 with ONE feature x taken out (x in the table below)
  C1.. cumulative: E1 with features taken out one after another, ending at the variant replica
  V1   the variant replica (every feature off, the variant's load order)
  V0   ``benchmarks/results/fp8/attention_variants/variants.py``'s own ``blk`` kernel at block size 64 (the 221 us)
  V+x  V1 with ONE engine feature x put back
  X*   extras: the engine / the variant over a pool larger than 4 GiB (Pallas then indexes with 64-bit
       offsets, as it does over a production pool that holds every layer), num_stages 4, kv_len = CTX - 1
       (every sequence's last tile through the masked path), and untimed correctness rows of every
       masked path with kv_lens in [1, CTX]; these rows' pools hold NaN in every slot past kv_len

Features (``Knobs``; engine value first):
  layer_op    layer read from an i32[1] operand | a Python int (0), folded into the addresses
  search      a tile's sequence found by the cu_q_lens search (a 512-lane vector load + 3 reductions,
              then dependent kv_lens load) | closed form for a uniform decode batch (cu = arange)
  ragged_grid grid (Hkv, cdiv(T, block_q) + S + 1 [, splits]): 289 tiles, 33 idle | (Hkv, S)
  kv_dyn      kv_len read from kv_lens -> dynamic loop bounds | static CTX (with the dense grid: constant
              trip count, as the variant's fori_loop(0, CTX // 64))
  split_math  third grid axis, t0 = program_id(2) * cdiv(n, 1), t1 = min(t0 + per, n) | t0 = 0, t1 = n
  two_loops   an unmasked loop [t0, mid) and a masked loop [mid, t1) (0 trips here, but compiled and
              software-pipelined) | one unmasked loop
  clamp       table column min(t * 64 // 64, W - 1) | t
  load_order  engine: K, V^T, K scales, V scales, then the dots | variant: K, V^T, dot, scales
  row_masks   q rows masked by (row < block_q * G) & (token < seq_end), l > 0 guard | rows < G, acc / l
Not differences but candidate fixes of the masked path (rows E-tail_* / E-all_masked_min):
  tail        "loop": the engine's masked fori_loop | "cond": <= 2 straight-line masked steps under lax.cond
              (no second pipelined loop) | "all": one loop, every tile masked
  tail_loads  "masked": the engine's per-slot load masks (V^T's mask runs along its contiguous axis: byte
              loads) | "full": whole tile read (it lies in one allocated pool block), then zeroed |
              "min": whole tile, only V^T and the V scales zeroed (stale K reaches only s, which the
              causal mask selects away; stale V would give 0 * NaN)

Timing as variants.py (``bench_attention.timed``): 8 chained calls in one jit (each output is the next
call's queries), compiled and run once, then the median over 30 groups of 4 calls, divided by 8.
Every kernel is checked against the jnp reference (fp32 dequantisation, ``paged_attention_reference``):
relative Frobenius error printed next to its time; the tolerance is 5e-3 (bf16 rounding of P and of
the output; the fp8 values and power-of-two scales are the same in kernel and reference).

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \
        PYTHONUNBUFFERED=1 python3 benchmarks/results/fp8/attention_variants/ladder.py 2>&1 | tee $OUT/ladder.log
    LADDER_SET=f16 python3 ...ladder.py   # the f16-conversion rows (knob ``cvt``) and a bf16-pool anchor (B16)
    LADDER_SET=occ python3 ...ladder.py   # occupancy: the masked tiles in a while loop (``tail="while"``,
                                          # and the engine kernel so changed, "pa_while"), stages, warps
    python benchmarks/results/fp8/attention_variants/ladder.py --tiny      # CPU: tiny shapes, interpret mode, correctness only
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "../../../.."))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.path.join(REPO, "benchmarks/results/fp8/attention_variants"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from jaxpaged.kernels.fp8 import v_slab_index  # noqa: E402
from jaxpaged.kernels.shapes import next_pow2  # noqa: E402
from jaxpaged.kernels.kv_write import pool_shape, write_kv  # noqa: E402
from jaxpaged.kernels.paged_attention import (  # noqa: E402
    LOG2E, _MASKED, choose_config, online_softmax, paged_attention)
from jaxpaged.kernels.paged_attention_reference import paged_attention_reference  # noqa: E402


def _while_tail_kernel_module():
    """The engine's kernel module with its masked tiles in a while loop (an scf.while: never
    software-pipelined, no stage buffers): its source with the second ``fori_loop`` replaced."""
    import importlib.util
    import types

    import jaxpaged.kernels.paged_attention as engine_kernel

    src = open(engine_kernel.__file__).read()
    old = "    acc, m_i, l_i = lax.fori_loop(mid, t1, functools.partial(step, masked=True), carry)\n"
    new = ("    def w_cond(c):\n        return (c[0] < t1) & (c[0] >= mid)  # (two tests: not pattern-matched into an scf.for)\n"
           "    def w_body(c):\n        return (c[0] + 1, *step(c[0], c[1:], masked=True))\n"
           "    _, acc, m_i, l_i = lax.while_loop(w_cond, w_body, (mid, *carry))\n")
    assert src.count(old) == 1, "the engine kernel's masked loop moved: update this replacement"
    module = types.ModuleType("pa_while")
    sys.modules["pa_while"] = module  # (its dataclasses look their module up there)
    exec(compile(src.replace(old, new), "pa_while", "exec"), module.__dict__)
    return module


pa_while = _while_tail_kernel_module()

FP8 = jnp.float8_e4m3fn
BS = 64  # the fp8 pool's block size = the kernel's KV tile
TOL = 5e-3


@dataclasses.dataclass(frozen=True)
class Shapes:
    s: int
    ctx: int
    hq: int
    hkv: int
    d: int
    interpret: bool

    @property
    def group(self):
        return self.hq // self.hkv

    @property
    def width(self):
        return self.ctx // BS


@dataclasses.dataclass(frozen=True)
class Knobs:
    """The engine's features (defaults = the engine); see the module docstring."""
    layer_op: bool = True
    search: bool = True
    ragged_grid: bool = True
    kv_dyn: bool = True
    split_math: bool = True
    two_loops: bool = True
    clamp: bool = True
    load_order: str = "engine"  # "engine" | "variant"
    tail: str = "loop"  # masked tiles: "loop" (the engine's second fori_loop) | "cond" (<= 2 guarded straight-line
    # steps) | "all" (one loop, every tile through the masked step)
    tail_loads: str = "masked"  # the masked tile's loads: "masked" (engine: per-slot masks) | "full" (whole tile, then
    # zeroed) | "min" (whole tile, only V^T and V scales zeroed; stale K only reaches s, which the causal mask selects away)
    row_masks: bool = True
    num_warps: int = 4
    num_stages: int = 3
    cvt: str = "bf16"  # fp8 tiles converted to "bf16" (q's dtype) | "f16" (one cvt.f16x2.e4m3x2 on sm_90; q cast
    # to f16; V scales normalised by the tile's largest before P is rounded, the largest applied to P @ V)


VARIANT = Knobs(layer_op=False, search=False, ragged_grid=False, kv_dyn=False, split_math=False,
                two_loops=False, clamp=False, load_order="variant", row_masks=False)


def ladder_kernel(*refs, kn: Knobs, sh: Shapes, block_m: int, block_k: int, layer_static: int):
    refs = list(refs)
    layer_ref = refs.pop(0) if kn.layer_op else None
    cu_ref = refs.pop(0) if kn.search else None
    kvl_ref = refs.pop(0) if kn.kv_dyn else None
    tables_ref, q_ref, kv_ref, o_ref = refs
    num_tokens, _, head_dim = q_ref.shape
    group, num_seqs, width = sh.group, sh.s, tables_ref.shape[1]
    block_q = block_m // group
    scale_log2 = head_dim ** -0.5 * LOG2E
    h = pl.program_id(0)
    tile = pl.program_id(1)
    layer = layer_ref[0] if kn.layer_op else layer_static
    static_bounds = not kn.ragged_grid and not kn.kv_dyn

    # -- which sequence / query rows this program owns
    if kn.ragged_grid and kn.search:  # the engine's search (paged_attention.py)
        idx = lax.broadcasted_iota(jnp.int32, (next_pow2(num_seqs + 1),), 0)
        cu = plgpu.load(cu_ref.at[idx], mask=idx <= num_seqs, other=0)
        owns = (idx <= num_seqs) & (cu // block_q + idx <= tile)
        seq = jnp.sum(owns.astype(jnp.int32)) - 1
        is_pad = seq == num_seqs
        seq_c = jnp.minimum(seq, num_seqs - 1)
        seq_start = jnp.sum(jnp.where(idx == seq, cu, 0))
        seq_end = jnp.where(is_pad, num_tokens, jnp.sum(jnp.where(idx == seq + 1, cu, 0)))
    elif kn.ragged_grid:  # closed form for cu = arange(S + 1): sequence i owns tile i // block_q + i
        k, r = tile // (block_q + 1), tile % (block_q + 1)
        seq = k * block_q + r
        idle = (r == block_q) | (seq >= num_seqs)
        seq_c = jnp.minimum(seq, num_seqs - 1)
        seq_start = seq_c
        seq_end = jnp.where(idle, seq_c, seq_c + 1)
        is_pad = idle
    else:  # dense grid: program i is sequence i
        seq = seq_c = seq_start = tile
        seq_end = tile + 1
        is_pad = idle = None  # no padding / idle programs
    if kn.kv_dyn:
        kv_len = kvl_ref[seq_c]
        if kn.ragged_grid:
            kv_len = jnp.where(is_pad, 0, kv_len)
    else:
        kv_len = sh.ctx
    if kn.ragged_grid and kn.search:
        q_start = seq_start + (tile - (seq_start // block_q + seq)) * block_q
        idle = is_pad | (q_start >= seq_end)  # the padding sequence, or a tile past its sequence's tokens
    else:
        q_start = seq_start
    first_pos = kv_len - (seq_end - seq_start) + (q_start - seq_start)

    rows = lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    dims = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    head_ix = (h * group + rows % group)[:, None]
    if kn.row_masks:  # the engine's
        row_tok = q_start + rows // group
        row_ok = (rows < block_q * group) & (row_tok < seq_end)
        tok_ix = row_tok[:, None]
    else:  # the variant's
        row_ok = rows < group
        if idle is not None:
            row_ok = row_ok & ~idle
        tok_ix = jnp.where(row_ok, seq_c, num_tokens)[:, None]
    pos_ok = row_ok if is_pad is None else row_ok & ~is_pad
    row_pos = jnp.where(pos_ok, first_pos + rows // group, -1) if kn.two_loops else None
    q = plgpu.load(q_ref.at[tok_ix, head_ix, dims], mask=row_ok[:, None], other=0)
    cdt = jnp.float16 if kn.cvt == "f16" else q.dtype
    q = q.astype(cdt)

    # -- the KV tiles this program reads
    if static_bounds:
        num_kv_tiles = n_full = sh.ctx // block_k
        kv_end = sh.ctx
    else:
        if kn.row_masks:
            last_tok = jnp.minimum(q_start + block_q, seq_end) - 1
        else:
            last_tok = jnp.where(idle, q_start - 1, q_start) if kn.ragged_grid else q_start
        kv_end = jnp.where(last_tok >= q_start, jnp.minimum(kv_len, first_pos + last_tok - q_start + 1), 0)
        kv_end = jnp.maximum(kv_end, 0)
        num_kv_tiles = pl.cdiv(kv_end, block_k)
        n_full = jnp.maximum(first_pos + 1, 0) // block_k
    if kn.split_math:
        split = pl.program_id(2)
        per_split = pl.cdiv(num_kv_tiles, 1)
        t0 = split * per_split
        t1 = jnp.minimum(t0 + per_split, num_kv_tiles)
    else:
        t0, t1 = 0, num_kv_tiles
    cols = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    dcol = lax.broadcasted_iota(jnp.int32, (head_dim, 1), 0)

    def pv(p, vs, vt):
        if kn.cvt == "f16":  # P x V-scale in f16 relative to the tile's largest scale (powers of two: exact)
            vmax = jnp.max(vs)
            vmax = jnp.where(vmax > 0, vmax, 1.0)
            return lax.dot_general((p * (vs / vmax)[None, :]).astype(cdt), vt, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32) * vmax
        return lax.dot_general((p * vs[None, :]).astype(cdt), vt, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def step(t, carry, masked):
        pos = t * block_k + cols
        col = jnp.minimum(t * block_k // BS, width - 1) if kn.clamp else t
        phys = tables_ref[seq_c, col]
        off = cols
        row, vcol = v_slab_index(dcol, off[None, :], BS, head_dim)  # [D, 1], [D, tile]
        k_at = kv_ref.at[layer, phys, off[:, None], 0, h, dims]
        vt_at = kv_ref.at[layer, phys, row, 1, h, vcol]
        ks_at = kv_ref.at[layer, phys, BS, 0, h, off]
        vs_at = kv_ref.at[layer, phys, BS, 1, h, off]
        if masked and kn.tail_loads == "full":  # the whole tile read (one pool block: in bounds), its tail zeroed
            ok = pos < kv_end
            k = jnp.where(ok[:, None], plgpu.load(k_at).astype(cdt), 0)
            vt = jnp.where(ok[None, :], plgpu.load(vt_at).astype(cdt), 0)
            ks = jnp.where(ok, plgpu.load(ks_at).astype(jnp.float32), 0.0)
            vs = jnp.where(ok, plgpu.load(vs_at).astype(jnp.float32), 0.0)
        elif masked and kn.tail_loads == "min":  # whole tile; only V^T and the V scales zeroed (K: the causal mask on s)
            ok = pos < kv_end
            k = plgpu.load(k_at).astype(cdt)
            vt = jnp.where(ok[None, :], plgpu.load(vt_at).astype(cdt), 0)
            ks = plgpu.load(ks_at).astype(jnp.float32)
            vs = jnp.where(ok, plgpu.load(vs_at).astype(jnp.float32), 0.0)
        elif masked:  # the engine's masked tile (paged_attention.py step_fp8)
            ok = pos < kv_end
            k = jnp.where(ok[:, None], plgpu.load(k_at, mask=ok[:, None]).astype(cdt), 0)
            vt = jnp.where(ok[None, :], plgpu.load(vt_at, mask=ok[None, :]).astype(cdt), 0)
            ks = jnp.where(ok, plgpu.load(ks_at, mask=ok).astype(jnp.float32), 0.0)
            vs = jnp.where(ok, plgpu.load(vs_at, mask=ok).astype(jnp.float32), 0.0)
        elif kn.load_order == "engine":
            k, vt = plgpu.load(k_at).astype(cdt), plgpu.load(vt_at).astype(cdt)
            ks, vs = plgpu.load(ks_at).astype(jnp.float32), plgpu.load(vs_at).astype(jnp.float32)
        else:  # the variant's order: K, V^T, the score dot, then the scales
            k = plgpu.load(k_at).astype(cdt)
            vt = plgpu.load(vt_at).astype(cdt)
            s_raw = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            ks = plgpu.load(ks_at).astype(jnp.float32)
            vs = plgpu.load(vs_at).astype(jnp.float32)
            s = s_raw * (scale_log2 * ks)[None, :]
            return online_softmax(carry, s, pos, None, lambda p: pv(p, vs, vt))
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * (scale_log2 * ks)[None, :]
        return online_softmax(carry, s, pos, row_pos if masked else None, lambda p: pv(p, vs, vt))

    carry = (jnp.zeros((block_m, head_dim), jnp.float32), jnp.full((block_m,), _MASKED, jnp.float32),
             jnp.zeros((block_m,), jnp.float32))
    if kn.two_loops and kn.tail == "all":  # one loop, every tile through the masked step (as mask_all)
        acc, m_i, l_i = lax.fori_loop(t0, t1, functools.partial(step, masked=True), carry)
    elif kn.two_loops:
        mid = jnp.clip(n_full, t0, t1)
        carry = lax.fori_loop(t0, mid, functools.partial(step, masked=False), carry)
        if kn.tail == "loop":
            acc, m_i, l_i = lax.fori_loop(mid, t1, functools.partial(step, masked=True), carry)
        elif kn.tail == "while":  # a while loop (scf.while: never software-pipelined, no stage buffers)
            def w_cond(c):
                return (c[0] < t1) & (c[0] >= mid)  # (two tests: not pattern-matched into an scf.for)

            def w_body(c):
                return (c[0] + 1, *step(c[0], c[1:], masked=True))
            _, acc, m_i, l_i = lax.while_loop(w_cond, w_body, (mid, *carry))
        else:  # a decode tile's masked tiles: at most cdiv(block_q - 1, block_k) + 1 (its last tokens' diagonal)
            for j in range(pl.cdiv(block_q - 1, block_k) + 1):
                t = mid + j
                carry = lax.cond(t < t1, lambda c, t=t: step(t, c, masked=True), lambda c: c, carry)
            acc, m_i, l_i = carry
    else:
        acc, m_i, l_i = lax.fori_loop(t0, t1, functools.partial(step, masked=False), carry)
    if kn.row_masks:
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    else:
        out = acc / l_i[:, None]
    plgpu.store(o_ref.at[tok_ix, head_ix, dims], out.astype(o_ref.dtype), mask=row_ok[:, None])


def ladder_call(q, pool, layer, cu, kv_lens, tables, *, kn: Knobs, sh: Shapes):
    """One ladder kernel. ``layer``: an i32[] array (``layer_op``) or a Python int."""
    num_tokens = q.shape[0]
    block_m = max(16, sh.group)
    block_k = BS
    block_q = block_m // sh.group
    tiles = pl.cdiv(num_tokens, block_q) + sh.s + 1 if kn.ragged_grid else sh.s
    grid = (sh.hkv, tiles, 1) if kn.split_math else (sh.hkv, tiles)
    operands = []
    if kn.layer_op:
        operands.append(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)))
    if kn.search:
        operands.append(cu)
    if kn.kv_dyn:
        operands.append(kv_lens)
    operands += [tables, q, pool]
    kernel = functools.partial(ladder_kernel, kn=kn, sh=sh, block_m=block_m, block_k=block_k,
                               layer_static=0 if kn.layer_op else int(layer))
    return pl.pallas_call(
        kernel, grid=grid, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=kn.num_warps, num_stages=kn.num_stages),
        interpret=sh.interpret, name="ladder")(*operands)


def variants_module(sh: Shapes):
    """variants.py, its globals set to these shapes (its kernel reads them at trace time)."""
    os.environ.setdefault("BS", str(BS))
    import variants as V
    V.S, V.CTX, V.HQ, V.HKV, V.D, V.BS, V.G, V.SMOKE = sh.s, sh.ctx, sh.hq, sh.hkv, sh.d, BS, sh.group, sh.interpret
    return V


def rungs(sh: Shapes, cu, kl):
    """[(name, what, fn(q, pool, tables) -> out)] in table order."""
    E = Knobs()
    L = lambda kn: (lambda q, p, t: ladder_call(q, p, 0 if not kn.layer_op else jnp.int32(0), cu, kl, t, kn=kn, sh=sh))  # noqa: E731
    V = variants_module(sh)
    out = [
        ("E0", "engine: paged_attention as the engine calls it", lambda q, p, t: paged_attention(q, p, 0, cu, kl, t, interpret=sh.interpret)),
        ("V0", "variants.py blk kernel (the 221-us loop)", functools.partial(V.attn, variant="blk", block_k=BS, stages=3, warps=4)),
        ("E1", "engine replica, every feature on", L(E)),
        ("V1", "variant replica, every feature off", L(VARIANT)),
    ]
    minus = [("two_loops", dict(two_loops=False)), ("layer_op", dict(layer_op=False)),
             ("search", dict(search=False)), ("kv_dyn", dict(kv_dyn=False)),
             ("split_math", dict(split_math=False)), ("clamp", dict(clamp=False)),
             ("load_order", dict(load_order="variant")), ("row_masks", dict(row_masks=False))]
    for name, ch in minus:
        out.append((f"E-{name}", f"engine replica without {name}", L(dataclasses.replace(E, **ch))))
    out.append(("E-tail_cond", "engine replica, masked tiles as <= 2 lax.cond steps instead of a loop",
                L(dataclasses.replace(E, tail="cond"))))
    out.append(("E-tail_full", "engine replica, the masked loop's tiles read whole (no load masks), tail zeroed",
                L(dataclasses.replace(E, tail_loads="full"))))
    out.append(("E-tail_cond_full", "engine replica, masked tiles as <= 2 lax.cond steps, read whole",
                L(dataclasses.replace(E, tail="cond", tail_loads="full"))))
    out.append(("E-tail_min", "engine replica, the masked loop reads whole tiles, zeroes V^T / V scales only",
                L(dataclasses.replace(E, tail_loads="min"))))
    out.append(("E-all_masked_min", "engine replica, ONE loop, every tile masked, whole-tile reads, V^T / V scales zeroed",
                L(dataclasses.replace(E, tail="all", tail_loads="min"))))
    # cumulative: engine -> variant, the likeliest costs first
    steps = [("two_loops", dict(two_loops=False)), ("layer_op", dict(layer_op=False)),
             ("search", dict(search=False)), ("ragged_grid", dict(ragged_grid=False)),
             ("kv_dyn", dict(kv_dyn=False)), ("split_math", dict(split_math=False)),
             ("clamp+row_masks", dict(clamp=False, row_masks=False))]
    kn = E
    for i, (name, ch) in enumerate(steps, 1):
        kn = dataclasses.replace(kn, **ch)
        out.append((f"C{i}", f"cumulative: also without {name}", L(kn)))
    # (C7 + load_order="variant" is V1)
    # (two_loops needs dynamic bounds to keep its 0-trip masked loop: it is added on top of kv_dyn)
    plus = [("layer_op", dict(layer_op=True)), ("kv_dyn", dict(kv_dyn=True)),
            ("kv_dyn+two_loops", dict(kv_dyn=True, two_loops=True)),
            ("ragged+search", dict(ragged_grid=True, search=True, kv_dyn=True)),
            ("ragged+search+two_loops", dict(ragged_grid=True, search=True, kv_dyn=True, two_loops=True))]
    for name, ch in plus:
        out.append((f"V+{name}", f"variant replica plus {name}", L(dataclasses.replace(VARIANT, **ch))))
    if os.environ.get("LADDER_SET") == "occ":  # occupancy: the tail outside the pipeliner, stages, warps
        F = lambda **ch: L(dataclasses.replace(E, cvt="f16", **ch))  # noqa: E731
        FV = lambda **ch: L(dataclasses.replace(VARIANT, cvt="f16", **ch))  # noqa: E731
        return [out[0], out[2],
                ("F-V1", "variant replica, tiles converted to f16", FV()),
                ("F-E-tail_min", "engine replica, f16, masked loop reads whole tiles, zeroes V only", F(tail_loads="min")),
                ("F-E-while_min", "F-E-tail_min, the masked tiles in a while loop (not pipelined)", F(tail="while", tail_loads="min")),
                ("F-E-tail_min-st4", "F-E-tail_min, num_stages=4", F(tail_loads="min", num_stages=4)),
                ("F-E-while_min-st4", "F-E-while_min, num_stages=4", F(tail="while", tail_loads="min", num_stages=4)),
                ("F-E-tail_min-w2", "F-E-tail_min, num_warps=2", F(tail_loads="min", num_warps=2)),
                ("F-E-while_min-w2", "F-E-while_min, num_warps=2", F(tail="while", tail_loads="min", num_warps=2)),
                ("F-E-while_min-st2", "F-E-while_min, num_stages=2", F(tail="while", tail_loads="min", num_stages=2)),
                ("F-V1-st4", "F-V1, num_stages=4", FV(num_stages=4)),
                ("F-V1-w2", "F-V1, num_warps=2", FV(num_warps=2)),
                ("E-while_min", "bf16 tiles, masked tiles in a while loop", L(dataclasses.replace(E, tail="while", tail_loads="min"))),
                ("E0w", "the engine's kernel, its masked tiles in a while loop (pa_while)",
                 lambda q, p, t: pa_while.paged_attention(q, p, 0, cu, kl, t, interpret=sh.interpret))]
    if os.environ.get("LADDER_SET") == "f16":
        F = lambda **ch: L(dataclasses.replace(E, cvt="f16", **ch))  # noqa: E731
        return out[:4] + [
            ("F-V1", "variant replica, tiles converted to f16", L(dataclasses.replace(VARIANT, cvt="f16"))),
            ("F-E1", "engine replica, f16", F()),
            ("E-tail_full", "engine replica, masked loop reads whole tiles (bf16)", L(dataclasses.replace(E, tail_loads="full"))),
            ("F-E-tail_full", "engine replica, f16, masked loop reads whole tiles", F(tail_loads="full")),
            ("F-E-tail_min", "engine replica, f16, masked loop reads whole tiles, zeroes V only", F(tail_loads="min")),
            ("F-E-tail_cond_full", "engine replica, f16, masked tiles as cond steps, read whole", F(tail="cond", tail_loads="full")),
            ("F-E-all_masked_min", "engine replica, f16, ONE loop, every tile masked (whole reads, V zeroed)", F(tail="all", tail_loads="min")),
            ("F-E-tail_full-st4", "F-E-tail_full, num_stages=4", F(tail_loads="full", num_stages=4)),
            ("F-E-tail_full-w8", "F-E-tail_full, num_warps=8", F(tail_loads="full", num_warps=8)),
        ]
    out.append(("X-stages4", "engine replica, num_stages=4", L(dataclasses.replace(E, num_stages=4))))
    out.append(("X-C1-stages4", "engine replica without two_loops, num_stages=4",
                L(dataclasses.replace(E, two_loops=False, num_stages=4))))
    return out


def build_case(sh: Shapes, seed=0):
    """A decode batch over an fp8 pool written by the engine's write_kv (as variants.py / check_fp8_kv.py)."""
    rng = np.random.default_rng(seed)
    bpseq = sh.ctx // BS
    nb = sh.s * bpseq + 3
    tables = rng.permutation(nb)[: sh.s * bpseq].reshape(sh.s, bpseq).astype(np.int32)
    slots = (tables[:, :, None] * BS + np.arange(BS)).reshape(-1).astype(np.int32)
    k = jnp.asarray(rng.standard_normal((slots.size, sh.hkv, sh.d)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((slots.size, sh.hkv, sh.d)), jnp.bfloat16)
    pool = jnp.zeros(pool_shape(1, nb, BS, sh.hkv, sh.d, FP8), FP8)
    pool = jax.jit(write_kv, static_argnums=1)(pool, 0, k, v, jnp.asarray(slots))
    q = jnp.asarray(rng.standard_normal((sh.s, sh.hq, sh.d)), jnp.bfloat16)
    cu = jnp.arange(sh.s + 1, dtype=jnp.int32)
    kl = jnp.full(sh.s, sh.ctx, jnp.int32)
    return q, pool, jnp.asarray(tables), cu, kl


def poison(pool, tables, kv_lens, sh: Shapes):
    """The pool with every slot at or past its sequence's kv_len set to NaN (K, V and both scales), as a
    reused block can hold: a kernel that lets a stale slot into its arithmetic gives NaN."""
    p = np.array(pool)
    tb, kl = np.asarray(tables), np.asarray(kv_lens)
    pos = np.arange(sh.ctx)
    seq, slot = np.nonzero(pos[None, :] >= kl[:, None])
    blk, off = tb[seq, slot // BS], slot % BS
    nan = np.array(np.nan, p.dtype)
    p[0, blk, off, 0] = nan
    per = sh.d // BS
    for d in range(sh.d):
        p[0, blk, d // per, 1, :, (d % per) * BS + off] = nan
    p[0, blk, BS, :, :, off] = nan
    return jnp.asarray(p)


def bf16_case(sh: Shapes):
    """build_case's K/V (same seed) in a bf16 pool of block size 16, the engine's default: (pool, tables)."""
    rng = np.random.default_rng(0)
    bpseq = sh.ctx // BS
    nb = sh.s * bpseq + 3
    rng.permutation(nb)
    n = sh.s * sh.ctx
    k = jnp.asarray(rng.standard_normal((n, sh.hkv, sh.d)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((n, sh.hkv, sh.d)), jnp.bfloat16)
    bs = 16
    nb16 = sh.s * sh.ctx // bs + 3
    t16 = np.random.default_rng(2).permutation(nb16)[: sh.s * sh.ctx // bs].reshape(sh.s, -1).astype(np.int32)
    slots = (t16[:, :, None] * bs + np.arange(bs)).reshape(-1).astype(np.int32)
    pool = jnp.zeros(pool_shape(1, nb16, bs, sh.hkv, sh.d, jnp.bfloat16), jnp.bfloat16)
    pool = jax.jit(write_kv, static_argnums=1)(pool, 0, k, v, jnp.asarray(slots))
    return pool, jnp.asarray(t16)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, interpret mode (CPU), correctness")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated rung names")
    args = ap.parse_args()
    tiny = args.tiny
    if tiny:
        sh = Shapes(s=4, ctx=128, hq=4, hkv=2, d=64, interpret=True)
    else:
        sh = Shapes(s=256, ctx=1024, hq=16, hkv=8, d=128, interpret=False)
    from bench_attention import timed
    print(f"jax {jax.__version__} backend {jax.default_backend()} devices {jax.devices()}")
    print(f"shapes {sh}; engine config {choose_config(sh.s, sh.s, sh.hq, sh.hkv, BS, sh.ctx, fp8=True)}")
    q, pool, tables, cu, kl = build_case(sh)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(jax.jit(paged_attention_reference, static_argnums=2)(q, pool, 0, cu, kl, tables), np.float32)
    nbytes = sh.s * sh.ctx * 2 * sh.hkv * sh.d * (BS + 1) / BS  # fp8 K and V plus the scale rows
    table = rungs(sh, cu, kl)
    # extras: a pool past 4 GiB (64-bit offsets in the Pallas lowering), the layer read = the last one
    big_layers = 2 if tiny else 9
    table.append(("X-E0-big", f"engine over a {big_layers}-layer pool (>4 GiB on the GPU: 64-bit offsets), last layer", None))
    table.append(("X-V0-big", f"variants.py blk over the same {big_layers}-layer pool (layer 0)", None))
    # correctness of the masked path (never entered at kv_len = CTX): ragged kv_lens, E1's masked loop
    # correctness only (not timed): the masked paths with kv_lens in [1, CTX] (at kv_len = CTX they are never entered)
    kvlens_rows = {"F-E-tail_full": Knobs(cvt="f16", tail_loads="full"), "F-E-tail_min": Knobs(cvt="f16", tail_loads="min"),
                   "F-E-all_masked_min": Knobs(cvt="f16", tail="all", tail_loads="min"), "E1": Knobs(), "E-tail_cond": Knobs(tail="cond"), "E-tail_full": Knobs(tail_loads="full"),
                   "E-tail_cond_full": Knobs(tail="cond", tail_loads="full"), "E-tail_min": Knobs(tail_loads="min"),
                   "E-all_masked_min": Knobs(tail="all", tail_loads="min")}
    for r in kvlens_rows:
        table.append((f"X-{r}-kvlens", f"{r} with kv_lens in [1, CTX]: its masked path (correctness only)", None))
    table.append(("X-E0-ctx-1", "engine with kv_len = CTX - 1 (the last tile through the masked loop)", None))
    if os.environ.get("LADDER_SET") == "occ":
        kvlens_rows = {"F-E-while_min": Knobs(cvt="f16", tail="while", tail_loads="min"),
                       "F-E-while_min-w2": Knobs(cvt="f16", tail="while", tail_loads="min", num_warps=2)}
        table = [r for r in table if not r[0].startswith("X-")] + [("X-E0-ctx-1", "engine with kv_len = CTX - 1", None)]
        table += [(f"X-{r}-kvlens", f"{r} with kv_lens in [1, CTX] (correctness only)", None) for r in kvlens_rows]
    ctx1_rows = {"X-Ecnd-ctx-1": Knobs(tail="cond"), "X-Ftf-ctx-1": Knobs(cvt="f16", tail_loads="full"),
                 "X-Ftm-ctx-1": Knobs(cvt="f16", tail_loads="min"), "X-Fall-ctx-1": Knobs(cvt="f16", tail="all", tail_loads="min"),
                 "X-Fcf-ctx-1": Knobs(cvt="f16", tail="cond", tail_loads="full")}
    for r, k in ctx1_rows.items():
        table.append((r, f"{k} with kv_len = CTX - 1 (every sequence's last tile masked)", None))
    if os.environ.get("LADDER_SET") == "occ":
        table.append(("B16", "the engine's kernel over a bf16 pool of block size 16 (the same K/V)", None))
        table.append(("B16w", "pa_while over that bf16 pool", None))
        table.append(("X-E0w-ctx-1", "pa_while with kv_len = CTX - 1", None))
        table.append(("X-E0w-kvlens", "pa_while with kv_lens in [1, CTX] over a NaN-poisoned pool (correctness only)", None))
        ctx1_rows = {"X-Ftm-ctx-1": Knobs(cvt="f16", tail_loads="min"),
                     "X-Fwm-ctx-1": Knobs(cvt="f16", tail="while", tail_loads="min"),
                     "X-Fwm-w2-ctx-1": Knobs(cvt="f16", tail="while", tail_loads="min", num_warps=2)}
        table = [r for r in table if not (r[0].startswith("X-") and r[0].endswith("ctx-1")) or r[0] in ("X-E0-ctx-1", "X-E0w-ctx-1")]
        table += [(r, f"{k} with kv_len = CTX - 1 (every sequence's last tile masked)", None) for r, k in ctx1_rows.items()]
    if os.environ.get("LADDER_SET") == "f16":
        table = [r for r in table if not r[0].startswith("X-") or r[0].endswith("ctx-1")
                 or r[0][2:-7] in kvlens_rows and r[0][2:4] == "F-"]
        table.append(("B16", "the engine's kernel over a bf16 pool of block size 16 (the same K/V)", None))
    table.append(("E0-again", "engine again (drift check)", table[0][2]))
    table.append(("V0-again", "variant again (drift check)", table[1][2]))
    only = set(filter(None, args.only.split(",")))
    results, poisoned = [], {}
    e1_fn = dict((n, f) for n, _, f in table)["E1"]
    e0_out = np.asarray(jax.jit(e1_fn)(q, pool, tables), np.float32)  # |d E1| column
    big = None
    pool_arg = ref_used = None
    for name, what, fn in table:
        if only and name not in only:
            continue
        try:
            pool_arg, ref_used, tables_arg = pool, ref, tables
            if name in ("B16", "B16w"):
                pool_arg, tables_arg = bf16_case(sh)
                pa = paged_attention if name == "B16" else pa_while.paged_attention
                fn = lambda q, p, t, pa=pa: pa(q, p, 0, cu, kl, t, interpret=sh.interpret)  # noqa: E731
                with jax.default_matmul_precision("highest"):
                    ref_used = np.asarray(jax.jit(paged_attention_reference, static_argnums=2)(
                        q, pool_arg, 0, cu, kl, tables_arg), np.float32)
                nb_save = nbytes
                nbytes = sh.s * sh.ctx * 2 * sh.hkv * sh.d * 2
            if name.endswith("-kvlens") or name.endswith("ctx-1"):
                kind = "kvlens" if name.endswith("kvlens") else "ctx-1"
                if kind not in poisoned:  # (kv_lens, its NaN-poisoned pool, its reference)
                    if kind == "kvlens":
                        kl2 = jnp.asarray(np.random.default_rng(1).integers(1, sh.ctx + 1, sh.s).astype(np.int32))
                    else:
                        kl2 = jnp.full(sh.s, sh.ctx - 1, jnp.int32)
                    p2 = poison(pool, tables, kl2, sh)
                    with jax.default_matmul_precision("highest"):
                        r2 = np.asarray(jax.jit(paged_attention_reference, static_argnums=2)(q, p2, 0, cu, kl2, tables), np.float32)
                    poisoned[kind] = (kl2, p2, r2)
                kl2, pool_arg, ref_used = poisoned[kind]
                if name.startswith("X-E0"):
                    pa = pa_while.paged_attention if name.startswith("X-E0w") else paged_attention
                    fn = lambda q, p, t, kl2=kl2, pa=pa: pa(q, p, 0, cu, kl2, t, interpret=sh.interpret)  # noqa: E731
                else:
                    kn2 = kvlens_rows[name[2:-7]] if name.endswith("-kvlens") else ctx1_rows[name]
                    fn = lambda q, p, t, kl2=kl2, kn2=kn2: ladder_call(q, p, jnp.int32(0), cu, kl2, t, kn=kn2, sh=sh)  # noqa: E731
            if name in ("X-E0-big", "X-V0-big"):
                if big is None:
                    big = jax.jit(lambda p: jnp.concatenate([p] * big_layers, axis=0))(pool)
                    print(f"big pool {big.shape} {big.size * big.dtype.itemsize / 2**30:.2f} GiB")
                pool_arg = big
                if name == "X-E0-big":
                    fn = lambda q, p, t: paged_attention(q, p, big_layers - 1, cu, kl, t, interpret=sh.interpret)  # noqa: E731
                else:
                    fn = functools.partial(variants_module(sh).attn, variant="blk", block_k=BS, stages=3, warps=4)
            t0 = time.perf_counter()
            got = np.asarray(jax.jit(fn)(q, pool_arg, tables_arg), np.float32)
            first_s = time.perf_counter() - t0
            err = rel_err(got, ref_used)
            d_e1 = float(np.max(np.abs(got - e0_out))) if e0_out is not None and "kvlens" not in name and "ctx-1" not in name else float("nan")
            chain_len = 1 if tiny else 8

            def chain(q, p, t, fn=fn):
                for _ in range(chain_len):
                    q = fn(q, p, t)
                return q
            chain.__name__ = f"chain_{name}"
            if name.endswith("-kvlens"):
                c, us = float("nan"), float("nan")
            else:
                c, t = timed(chain, (q, pool_arg, tables_arg), 1 if tiny else args.reps)
                us = t / chain_len * 1e6
            row = dict(rung=name, what=what, us=us, tbps=nbytes / (us * 1e-6) / 1e12, rel_err=err,
                       max_abs_vs_E1=d_e1, ok=bool(err < TOL), compile_s=c, first_call_s=first_s)
        except Exception as e:  # noqa: BLE001
            row = dict(rung=name, what=what, us=float("nan"), tbps=float("nan"), rel_err=float("nan"),
                       max_abs_vs_E1=float("nan"), ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
        if name in ("B16", "B16w"):
            nbytes = nb_save
        results.append(row)
        print(json.dumps(row), flush=True)
    if big is not None:
        del big
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "ladder.json"), "w") as f:
            json.dump(results, f, indent=1)
    base = {r["rung"]: r["us"] for r in results}
    e1, v1 = base.get("E1", float("nan")), base.get("V1", float("nan"))
    print()
    print(f"{'rung':16s} {'us':>8s} {'TB/s':>6s} {'vs E1':>7s} {'rel_err':>9s} {'|d E1|':>8s}  what" +
          ("   (timings meaningless: interpret mode)" if tiny else ""))
    for r in results:
        print(f"{r['rung']:16s} {r['us']:8.1f} {r['tbps']:6.2f} {r['us'] - e1:+7.1f} {r['rel_err']:9.2e} "
              f"{r['max_abs_vs_E1']:8.1e}  {r['what']}{'' if r['ok'] else '   <-- FAILED ' + r.get('error', f'err >= {TOL}')}")
    bad = [r["rung"] for r in results if not r["ok"]]
    print(f"\n{len(results) - len(bad)} passed, {len(bad)} failed" + (f": {bad}" if bad else "") +
          f" (tolerance: relative error < {TOL} vs the fp32-dequantised jnp reference); E1 - V1 = {e1 - v1:+.1f} us")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
