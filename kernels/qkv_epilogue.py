"""The attention block's epilogue of the qkv projection as one kernel (Pallas, Triton lowering): sum the
projection's split-K partials, add the bias, RMSNorm q and k per head, rotate both (RoPE), write k and
v into the pool, return q.

Why: XLA runs this stretch of every layer as four to five small kernels (the q norm, the k norm, the
q rotation, the k rotation fused into the KV scatter, and the GEMV's partial sums); at decode batch
sizes each is launch-bound (``tools/profile_step.py`` shows them). Here program ``(token block, head)``
does it all for one q head or one KV head of a few tokens (:func:`token_block`: one token and one
warp up to 32 tokens, so a decode step of a few tokens still spreads over the SMs; 8 tokens and 4
warps above, so a batch-256 step is 768 programs instead of 6,144; over an fp8 pool one token a
program at every size).

Same math as the model's XLA path (``models/qwen.qkv_epilogue_ops`` with ``rms_norm``, ``rotary``,
``write_kv``): the
projection rounded to the model dtype, bias added in it, the norm in fp32 (``weight * (x *
rsqrt(mean(x^2) + eps)).astype(dtype)``), ``cos``/``sin`` given (computed by the caller in fp32 and
rounded, as in ``rotary``), then ``x*cos + rotated*sin``. For 16-bit dtypes each product is rounded
before the add (``rotary(separate_products=True)``; bitwise equal to it in the interpret-mode tests);
in float32 the compiler may contract the second product and the add into one FMA, so values can
differ from XLA's in the last bit, as XLA's own fusions of ``rotary`` do between step shapes. The pool
is updated in place (``input_output_aliases``): a token with slot ``-1`` (padding), or a slot past the
pool, writes nothing. ``head_dim`` must be a power of two (a Triton tile); ``models.ops.fused_qkv``
takes the XLA path otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .fp8 import is_fp8, quantize, scale_rows, v_slab_index
from .kv_write import check_pool, check_triton_addressable


def token_block(num_tokens: int, fp8: bool = False) -> tuple[int, int]:
    """``(tokens per program, warps)`` for a step of ``num_tokens`` writing a pool of 16-bit or (``fp8``)
    8-bit values: one token and one warp per program up to 32 tokens (a decode step of a few tokens
    still spreads over the SMs), 8 tokens and 4 warps above, except over an fp8 pool. Why: at a
    batch-256 step over a bf16 pool one program per (token, head) is 6,144 one-warp programs, slower
    than 8 tokens a program; over an fp8 pool, whose values are written one byte a 32-byte sector
    (kernels/fp8.py: V transposed), one token a program is the faster (docs/DECISIONS.md)."""
    return (1, 1) if num_tokens <= 32 or fp8 else (8, 4)


def _kernel(layer_ref, parts_ref, bias_ref, qw_ref, kw_ref, cos_ref, sin_ref, slot_ref, pool_in_ref, q_out_ref,
            pool_ref, *, num_q_heads: int, num_kv_heads: int, eps: float, has_bias: bool, has_norm: bool,
            block_tokens: int):
    """Program ``(i, j)``: tokens ``[i * block_tokens, (i + 1) * block_tokens)`` (those past the step
    masked); head ``j`` of q (``j < Hq``: normed, rotated, stored to ``q_out``) or KV head ``j - Hq``
    (k normed and rotated, v as it is, both written to the pool). Rows are independent: every value
    is computed per token as with one token per program. ``layer_ref i32[1]``: the pool layer written."""
    del pool_in_ref  # the same buffer as pool_ref (aliased)
    layer = layer_ref[0]
    num_parts, num_tokens = parts_ref.shape[0], parts_ref.shape[1]
    head_dim = cos_ref.shape[1]
    fp8 = is_fp8(pool_ref.dtype)
    block_size = pool_ref.shape[2] - scale_rows(pool_ref.dtype)
    dtype = q_out_ref.dtype
    toks = pl.program_id(0) * block_tokens + lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)  # [B, 1]
    tok_ok = toks < num_tokens
    j = pl.program_id(1)
    is_q = j < num_q_heads
    kv_head = j - num_q_heads
    dims = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
    half = head_dim // 2
    rot_dims = (dims + half) % head_dim  # rotate-half partner of each column
    sign = jnp.where(dims < half, -1.0, 1.0).astype(jnp.float32)
    row_ok = tok_ok & (dims >= 0)  # [B, D]
    cos = plgpu.load(cos_ref.at[toks, dims], mask=row_ok, other=0).astype(jnp.float32)  # rounded to the model dtype
    sin = plgpu.load(sin_ref.at[toks, dims], mask=row_ok, other=0).astype(jnp.float32)

    def load_head(first_col, cols, mask):
        """Columns ``first_col + cols`` of the block's tokens: partials summed in order, rounded to the
        model dtype, bias added (rounded again); returned as fp32 values ``[B, D]``."""
        col = first_col + cols
        acc = plgpu.load(parts_ref.at[0, toks, col], mask=mask, other=0).astype(jnp.float32)
        for p in range(1, num_parts):
            acc = acc + plgpu.load(parts_ref.at[p, toks, col], mask=mask, other=0).astype(jnp.float32)
        x = acc.astype(dtype)
        if has_bias:
            b = plgpu.load(bias_ref.at[col], mask=(cols >= 0), other=0).astype(jnp.float32)
            x = (x.astype(jnp.float32) + b).astype(dtype)
        return x.astype(jnp.float32)

    # q head j or k head (j - Hq): both start at column j * D of the projection.
    first = j * head_dim
    x = load_head(first, dims, row_ok)
    xr = load_head(first, rot_dims, row_ok)
    if has_norm:
        inv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / head_dim + eps)  # [B, 1], same for x and xr
        w = jnp.where(is_q, plgpu.load(qw_ref.at[dims]), plgpu.load(kw_ref.at[dims])).astype(jnp.float32)
        wr = jnp.where(is_q, plgpu.load(qw_ref.at[rot_dims]), plgpu.load(kw_ref.at[rot_dims])).astype(jnp.float32)
        x = (w * (x * inv).astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
        xr = (wr * (xr * inv).astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    a = (x * cos).astype(dtype).astype(jnp.float32)
    b = (sign * xr * sin).astype(dtype).astype(jnp.float32)
    out = (a + b).astype(dtype)

    head = jnp.minimum(j, num_q_heads - 1) + jnp.zeros_like(dims)
    plgpu.store(q_out_ref.at[toks, head, dims], out, mask=is_q & row_ok)

    slot = plgpu.load(slot_ref.at[toks], mask=tok_ok, other=-1)  # [B, 1]
    num_slots = pool_ref.shape[1] * block_size
    write = (~is_q) & (slot >= 0) & (slot < num_slots) & row_ok  # as write_kv's mode="drop"
    # Rows that write nothing point past the pool: interpret mode emulates a masked store as "write the
    # old value back", which must not land on a slot another row of this program writes.
    blk = jnp.where(write, jnp.maximum(slot, 0) // block_size, pool_ref.shape[1])
    off = jnp.maximum(slot, 0) % block_size
    kvh = jnp.maximum(kv_head, 0) + jnp.zeros_like(dims)
    v = load_head((num_q_heads + num_kv_heads) * head_dim + jnp.maximum(kv_head, 0) * head_dim, dims,
                  mask=(~is_q) & row_ok)
    if not fp8:
        plgpu.store(pool_ref.at[layer, blk, off, 0, kvh, dims], out.astype(pool_ref.dtype), mask=write)
        plgpu.store(pool_ref.at[layer, blk, off, 1, kvh, dims], v.astype(pool_ref.dtype), mask=write)
        return
    # fp8: each token's K and V quantised with their own scales, stored in the block's scale row (the
    # token indices again as 1-D vectors: Triton's lowering has no slicing of [B, 1] ones), the values
    # in their transposed places.
    toks1 = pl.program_id(0) * block_tokens + lax.broadcasted_iota(jnp.int32, (block_tokens,), 0)
    slot1 = plgpu.load(slot_ref.at[toks1], mask=toks1 < num_tokens, other=-1)
    write1 = (~is_q) & (slot1 >= 0) & (slot1 < num_slots) & (toks1 < num_tokens)
    blk1 = jnp.where(write1, jnp.maximum(slot1, 0) // block_size, pool_ref.shape[1])
    off1 = jnp.maximum(slot1, 0) % block_size
    row, col = v_slab_index(dims, off, block_size, head_dim)  # values sit transposed (kernels/fp8.py)
    for kv, x in ((0, out), (1, v)):
        values, scale = quantize(x, pool_ref.dtype)  # [B, D], [B]
        if kv == 0:
            plgpu.store(pool_ref.at[layer, blk, off, 0, kvh, dims], values, mask=write)
        else:
            plgpu.store(pool_ref.at[layer, blk + 0 * dims, row + 0 * off, 1, kvh, col], values, mask=write)
        plgpu.store(pool_ref.at[layer, blk1, block_size, kv, jnp.maximum(kv_head, 0), off1],
                    scale.astype(pool_ref.dtype), mask=write1)


def qkv_epilogue(parts: jax.Array, bias: jax.Array | None, q_norm: jax.Array | None, k_norm: jax.Array | None,
                 cos: jax.Array, sin: jax.Array, kv_pool: jax.Array, layer: int, slot_mapping: jax.Array, *,
                 eps: float, dtype, block_tokens: int | None = None,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``parts [P, T, (Hq + 2 Hkv) * D]`` (the qkv projection as ``P`` partial sums, fp32 or the model
    dtype; ``P = 1`` for a finished product), ``bias [N]`` or None, ``q_norm, k_norm [D]`` or None
    (Qwen3's per-head norms, both or neither), ``cos, sin [T, D]`` (the rotation at each token's
    position, in ``dtype``), ``kv_pool [L, N, bs, 2, Hkv, D]``, ``slot_mapping i32[T]`` ->
    ``(q [T, Hq, D] in dtype, kv_pool with k and v written at layer ``layer``)``. The head counts
    come from the shapes (``Hkv`` from the pool), so a tensor-parallel shard passes its own.
    ``block_tokens``: tokens per program (default :func:`token_block`; any value gives the same result).
    The layer reaches the kernel as an operand (as in ``paged_attention``): one lowering serves every layer."""
    check_pool(kv_pool, layer)
    check_triton_addressable(kv_pool)
    return _qkv_epilogue(parts, bias, q_norm, k_norm, cos, sin, kv_pool, jnp.asarray(layer, jnp.int32), slot_mapping,
                         eps=eps, dtype=dtype, block_tokens=block_tokens, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "block_tokens", "interpret"))
def _qkv_epilogue(parts, bias, q_norm, k_norm, cos, sin, kv_pool, layer, slot_mapping, *, eps, dtype, block_tokens,
                  interpret):
    """:func:`qkv_epilogue` after the pool check; ``layer`` an ``i32[]`` operand."""
    num_parts, num_tokens, width = parts.shape
    num_kv_heads, head_dim = kv_pool.shape[4], kv_pool.shape[5]
    num_q_heads = width // head_dim - 2 * num_kv_heads
    if num_q_heads < num_kv_heads or width % head_dim:
        raise ValueError(f"qkv width {width} does not fit Hkv={num_kv_heads} heads of D={head_dim} "
                         f"(pool {kv_pool.shape})")
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{num_tokens}, {head_dim}], got {cos.shape} and {sin.shape}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two (a Triton tile)")
    for name, vec, size in (("bias", bias, width), ("q_norm", q_norm, head_dim), ("k_norm", k_norm, head_dim)):
        if vec is not None and vec.shape != (size,):
            raise ValueError(f"{name} must be [{size}], got {vec.shape}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {slot_mapping.shape}")
    dtype = jnp.dtype(dtype)
    has_bias, has_norm = bias is not None, q_norm is not None
    dummy = jnp.zeros((head_dim,), dtype)
    block, num_warps = token_block(num_tokens, is_fp8(kv_pool.dtype))
    if block_tokens is not None:
        if block_tokens < 1 or block_tokens & (block_tokens - 1):
            raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
        block, num_warps = block_tokens, 1 if block_tokens == 1 else 4
    kernel = functools.partial(_kernel, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               eps=float(eps), has_bias=has_bias, has_norm=has_norm, block_tokens=block)
    q, pool = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block), num_q_heads + num_kv_heads),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
                   jax.ShapeDtypeStruct(kv_pool.shape, kv_pool.dtype)),
        input_output_aliases={8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="qkv_epilogue" if block == 1 else f"qkv_epilogue_t{block}",
    )(jnp.reshape(layer, (1,)), parts, bias if has_bias else dummy, q_norm if has_norm else dummy, k_norm if has_norm else dummy,
      cos.astype(dtype), sin.astype(dtype), slot_mapping.astype(jnp.int32), kv_pool)
    return q, pool
