"""An experiment: decode over **bf16** pools with keys on wgmma's M (``S^T = K Q^T``, ``O^T += V^T
P^T``), the fp8 decode kernel's design (``kernels/paged_attention_mgpu_decode.py``) without its
conversions and scales, against the one-warpgroup kernel's query tiles, whose decode tile of one token
computes 64 query rows for ``G`` useful ones (2 at Qwen3-0.6B's shapes) in both products and the
softmax between them. At short contexts a program is its fixed path (one or two KV tiles), so a
``[64, R]`` score tile (``R``: ``G`` rounded up to 8) instead of ``[64, 64]``, and fewer registers a
thread (more programs a multiprocessor), may shorten it.

One program: token ``t`` and KV head ``h`` (unsplit). A KV tile is ``block_kv`` keys (64: a multiple of
the block size), copied block by block into a K slot and a V slot (the one-warpgroup kernel's copies).
Per tile: ``S^T [block_kv, R] = K Q^T`` (keys from shared memory as wgmma's A operand; the queries'
``R`` rows its N operand, copied once into unswizzled rows and stored from registers into a swizzled
tile, as the fp8 kernel does: copied straight into the swizzled tile, Mosaic GPU's layout inference
found no layouts for the kernel); keys at or past ``kv_end`` are ``-inf``
and their values zeroed in shared memory (stale slots may hold NaN); the online softmax runs down the
columns with a running sum per key row, summed once after the last tile; ``P^T`` in bf16 into a
shared-memory tile; ``O^T [D, R] += V^T P^T`` (the V slot transposed as wgmma's A operand). The output
leaves as the fp8 kernel's: ``O^T`` transposed into a swizzled tile, read back row-major into
unswizzled rows, the token's ``G`` rows copied out in place.

Not wired into the engine: ``keys_on_m_ab.py`` times it against the kernel the engine runs. On a CPU,
``python3 benchmarks/results/mosaic/keys_on_m/decode_bf16.py`` checks it against the reference in
Mosaic GPU's interpreter and lowers it for sm_90a.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels.kv_write import block_size_of
from jaxpaged.kernels.paged_attention_mgpu_decode import query_rows
from jaxpaged.kernels.paged_attention_mgpu import BLOCK_M, LOG2E, _MASKED, _interpret_params, _transforms, token_layout


def _tile(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=_transforms(dtype, shape[-1]))


def _decode_kernel(layer_ref, meta_ref, tables_ref, q_ref, kv_ref, o_ref, *, q_bar, k_bar, v_bar, q_union,
                   k_union, v_smem, pt_smem, scale_log2: float, group: int, rows: int, block_kv: int,
                   num_slots: int):
    """Refs: ``q_ref [T Hq (+ pad), D]``, ``kv_ref [L, N, bs, 2, Hkv, D]``, ``o_ref [T Hq, D]``, all bf16.
    Columns ``c`` of a program's output are query rows ``first + c`` of ``q`` (``first`` moved back near
    the end of ``q`` so that ``R`` rows fit; its ``G`` rows start at column ``row0 - first``)."""
    q_plain, q_tile = q_union  # one piece of memory: the queries as copied, then as wgmma reads them
    k_smem, o_tile = k_union  # the keys' slots, then (after the last tile) the output
    wgmma = plgpu.Layout.WGMMA
    head_dim = k_smem.shape[-1]
    block_size = kv_ref.shape[2]
    blocks_per_tile = block_kv // block_size
    width = tables_ref.shape[1]
    h = lax.axis_index("kv_head")
    tile = lax.axis_index("tile")
    seq = meta_ref[tile, 0]
    kv_end = meta_ref[tile, 2]
    hi = lax.div(kv_end + (block_kv - 1), block_kv)
    row0 = (tile * kv_ref.shape[4] + h) * group
    first = jnp.minimum(row0, q_ref.shape[0] - rows)

    @pl.when(seq >= 0)
    def _owned():
        layer = layer_ref[0]

        def fetch(t, slot):
            for b in range(blocks_per_tile):
                phys = tables_ref[seq, jnp.minimum(t * blocks_per_tile + b, width - 1)]  # past the table: masked
                part = pl.ds(b * block_size, block_size)
                plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, 0, h, :], k_smem.at[slot, part], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(kv_ref.at[layer, phys, :, 1, h, :], v_smem.at[slot, part], v_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(first, rows)], q_plain.at[pl.ds(0, rows)], q_bar)
        fetch(0, 0)
        for i in range(1, num_slots):
            pl.when(i < hi)(functools.partial(fetch, i, i))
        plgpu.barrier_wait(q_bar)
        q_rows = plgpu.load(q_plain, layout=wgmma)  # rows past R: stale, never used
        plgpu.commit_smem()  # (every warp has read q_plain before q_tile overwrites it)
        q_tile[...] = q_rows
        plgpu.commit_smem()
        q_op = q_tile.at[pl.ds(0, rows)].transpose((1, 0))  # [D, R]: wgmma's N operand
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=wgmma)
        shape = (block_kv, rows)

        def step(t, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(t, num_slots)
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, k_smem.at[slot], q_op)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32)) * scale_log2  # S^T: a row per key
            plgpu.barrier_wait(v_bar.at[slot])
            if masked:
                s = jnp.where(t * block_kv + iota(shape, 0) < kv_end, s, -jnp.inf)
                v_key = t * block_kv + iota((block_kv, head_dim), 0)
                v_smem[slot] = jnp.where(v_key < kv_end, v_smem[slot], jnp.zeros((), v_smem.dtype))
            m_new = jnp.maximum(m_i, s.max(axis=0))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [1]))
            l_new = l_i * lax.broadcast_in_dim(alpha, shape, [1]) + p  # summed over the keys after the last tile
            pt_smem.transpose((1, 0))[...] = p.astype(pt_smem.dtype)  # P^T [block_kv, R] into the [R, block_kv] tile
            plgpu.commit_smem()  # P^T (and the zeroed values) visible to wgmma

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, v_smem.at[slot].transpose((1, 0)), pt_smem.transpose((1, 0)))
                return acc_ref[...]

            o = pl.run_scoped(pv, plgpu.ACC((head_dim, rows), jnp.float32))

            @pl.when(t + num_slots < hi)
            def _():
                fetch(t + num_slots, slot)

            return acc * lax.broadcast_in_dim(alpha, acc.shape, [1]) + o, m_new, l_new

        carry = (plgpu.layout_cast(jnp.zeros((head_dim, rows), jnp.float32), wgmma),
                 plgpu.layout_cast(jnp.full((rows,), _MASKED, jnp.float32), wgmma.reduce(0)),
                 plgpu.layout_cast(jnp.zeros(shape, jnp.float32), wgmma))
        n_full = jnp.clip(lax.div(meta_ref[tile, 1] + 1, block_kv), 0, hi)
        carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
        acc, _, l_i = lax.fori_loop(n_full, hi, functools.partial(step, masked=True), carry)
        l_i = l_i.sum(axis=0)
        out = acc / lax.broadcast_in_dim(jnp.where(l_i > 0, l_i, 1.0), acc.shape, [1])
        o_tile.at[pl.ds(0, rows)].transpose((1, 0))[...] = out.astype(o_tile.dtype)
        plgpu.commit_smem()
        q_plain[...] = plgpu.load(o_tile, layout=wgmma)  # (rows past R: stale, never copied)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_plain.at[pl.ds(row0 - first, group)], o_ref.at[pl.ds(row0, group)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(seq < 0)  # a padding token: zeros
    def _padding_token():
        q_plain[...] = plgpu.layout_cast(jnp.zeros(q_plain.shape, q_plain.dtype), wgmma)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_plain.at[pl.ds(0, group)], o_ref.at[pl.ds(row0, group)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def paged_decode_bf16_mgpu(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, interpret=False,
                           block_kv: int = 64, num_slots: int = 2):
    """Decode attention, a program a (token, KV head), keys on M; arguments as
    :func:`jaxpaged.kernels.paged_attention_mgpu.paged_attention_mgpu` (bf16, ``block_kv`` a multiple of
    the block size and of 64). Returns ``[T, Hq, D]``, padding tokens zero."""
    return _decode(q, kv_pool, jnp.asarray(layer, jnp.int32), cu_q_lens, kv_lens, block_tables,
                   interpret=_interpret_params(interpret), block_kv=block_kv, num_slots=num_slots)


@functools.partial(jax.jit, static_argnames=("interpret", "block_kv", "num_slots"))
def _decode(q, kv_pool, layer, cu_q_lens, kv_lens, block_tables, *, interpret, block_kv, num_slots):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    assert q.dtype == kv_pool.dtype == jnp.bfloat16 and block_kv % max(64, block_size_of(kv_pool)) == 0
    group, rows, q_in = query_rows(q, num_kv_heads)
    meta = token_layout(cu_q_lens, kv_lens, num_tokens)
    dt = q.dtype
    scratch = dict(
        q_bar=plgpu.Barrier(num_arrivals=1),
        k_bar=plgpu.Barrier(num_arrivals=block_kv // block_size_of(kv_pool), num_barriers=num_slots),
        v_bar=plgpu.Barrier(num_arrivals=block_kv // block_size_of(kv_pool), num_barriers=num_slots),
        q_union=plgpu.RefUnion(plgpu.SMEM((BLOCK_M, head_dim), dt), _tile((BLOCK_M, head_dim), dt)),
        k_union=plgpu.RefUnion(_tile((num_slots, block_kv, head_dim), dt), _tile((BLOCK_M, head_dim), dt)),
        v_smem=_tile((num_slots, block_kv, head_dim), dt),
        pt_smem=_tile((rows, block_kv), dt),
    )
    kernel = plgpu.kernel(
        functools.partial(_decode_kernel, scale_log2=head_dim**-0.5 * LOG2E, group=group, rows=rows,
                          block_kv=block_kv, num_slots=num_slots),
        out_type=jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), dt),
        scratch_types=scratch,
        grid=(num_kv_heads, num_tokens),
        grid_names=("kv_head", "tile"),
        interpret=interpret,
        kernel_name="paged_decode_bf16",
    )
    out = kernel(jnp.reshape(layer, (1,)), meta, block_tables, q_in, kv_pool)
    return out.reshape(num_tokens, num_q_heads, head_dim)


if __name__ == "__main__":  # on a CPU: the interpreter against the reference, then the sm_90a lowering
    import sys

    sys.path[:0] = ["tests", "tests/kernels"]
    from test_paged_attention import run_case  # (stale slots and the neighbouring layers NaN; asserts)

    for q_lens, kv_lens, bs, hq, hkv, d in [([1, 1, 1, 1], [1, 63, 64, 200], 16, 16, 8, 128),
                                            ([1, 1, 1], [5, 130, 300], 16, 28, 4, 128),
                                            ([1, 1], [64, 129], 64, 8, 8, 64),
                                            ([1, 1, 1], [1, 17, 100], 8, 4, 4, 64)]:
        for slots in (2, 1):
            run_case(0, q_lens, kv_lens, bs, hq, hkv, d, jnp.bfloat16, kernel=paged_decode_bf16_mgpu, num_slots=slots)
            print("matches the reference:", q_lens, kv_lens, f"bs{bs} hq{hq} hkv{hkv} d{d} slots {slots}", flush=True)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    fn = jax.jit(lambda *a: paged_decode_bf16_mgpu(a[0], a[1], 2, *a[2:]))
    text = fn.trace(jax.ShapeDtypeStruct((4, 16, 128), jnp.bfloat16),
                    jax.ShapeDtypeStruct((3, 64, 16, 2, 8, 128), jnp.bfloat16),
                    i32(5), i32(4), i32(4, 20)).lower(lowering_platforms=("cuda",)).as_text()
    print("lowers for sm_90a:", "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text)
