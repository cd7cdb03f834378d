"""Flax NNX Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE decoder whose attention reads and writes the paged KV pool.

One forward call processes a ragged batch of new tokens (prefill chunks and decodes mixed), given as
flat ``token_ids i32[T]`` and ``positions i32[T]``. Each layer writes its new K/V into its layer of the
pool (one ``[L, num_blocks, block_size, 2, Hkv, D]`` array, ``kernels/kv_write.py``) at ``slot_mapping``
and attends through ``attention_fn`` (the Pallas kernel or the jnp reference, same signature), so the
same model code runs every backend. The matmuls, RMSNorms and RoPE go through
``ops`` (:class:`ModelOps`), passed in the same way: the default is XLA (``x @ w``, IEEE fp32 for
float32 weights); the batch-invariant mode passes fixed-tile Pallas kernels
(``models.ops.get_model_ops``).

Weights are stored ``[in, out]``; q/k/v and gate/up are fused into one matmul each (the converter
concatenates Hugging Face's separate tensors). Differences between the families:
  * Qwen2 / Qwen2.5: bias on q/k/v, ``head_dim = hidden / heads``.
  * Qwen3: per-head RMSNorm on q and k before RoPE, explicit ``head_dim``, no q/k/v bias.
  * Qwen3-MoE: Qwen3's attention; the MLP of the layers ``cfg.is_moe_layer`` names is a mixture of
    experts (``models/moe.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ..kernels.grouped_matmul import grouped_matmul
from ..kernels.matmul import dot_precision
from ..kernels.metadata import AttentionMetadata
from .config import QwenConfig
from .moe import SparseMoeBlock
from .quantization import Fp8Config, Fp8Weight, accepting_fp8_grouped, fp8_matmul, init_linear, linear_weight

KVPool = jax.Array  # [L, num_blocks, block_size, 2, Hkv, D]: keys at [..., 0, :, :], values at [..., 1, :, :]
AttentionFn = Callable[..., jax.Array]  # (q, kv_pool, layer, cu_q_lens, kv_lens, block_tables) -> out
WriteKVFn = Callable[..., jax.Array]  # (kv_pool, layer, k, v, slot_mapping) -> kv_pool


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Hugging Face's Qwen RMSNorm: normalise in fp32, cast back, then scale by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def xla_matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None) -> jax.Array:
    """``x [M, K] @ w`` (``w [K, N]``, or ``[N, K]`` with ``transpose_w``) by XLA. bf16: exactly
    ``x @ w`` (fp32 accumulation); float32: ``precision=HIGHEST`` (IEEE, not the GPU's TF32 default);
    an fp8 weight (:class:`Fp8Weight`): :func:`fp8_matmul` around this."""
    if isinstance(w, Fp8Weight):
        return fp8_matmul(x, w, matmul=xla_matmul, transpose_w=transpose_w, out_dtype=out_dtype)
    w = w.T if transpose_w else w
    precision = dot_precision(x.dtype, w.dtype)
    if out_dtype is None:
        return jnp.matmul(x, w, precision=precision)
    return jnp.matmul(x, w, preferred_element_type=out_dtype, precision=precision)


def xla_matmul_unfused_input(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None) -> jax.Array:
    """:func:`xla_matmul` with an optimisation barrier on ``x``: XLA cannot fuse the op that produces
    ``x`` (an RMSNorm, SiLU * up) into the GEMM kernel as a prologue, which makes XLA's Triton GEMMs
    slower at decode sizes (docs/DECISIONS.md), while the producer runs as its own small kernel either
    way. Same values: the barrier changes only how the program is split into kernels."""
    return xla_matmul(jax.lax.optimization_barrier(x), w, transpose_w=transpose_w, out_dtype=out_dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """RoPE's ``cos, sin [T, D]`` at ``positions i32[T]`` (rotate-half layout: the ``D/2`` frequencies
    twice), computed in fp32 and rounded to ``dtype``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float, separate_products: bool = False) -> jax.Array:
    """RoPE, rotate-half convention. ``x [T, H, D]``, ``positions i32[T]``; cos/sin built in fp32.

    ``separate_products``: round ``x * cos`` and ``rotated * sin`` before adding them (an optimisation
    barrier keeps the compiler from fusing one product and the add into an FMA, which XLA was seen to
    do for some step shapes and not others: a float32 token's K then depended on the batch)."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    if separate_products:
        a, b = jax.lax.optimization_barrier((x * cos, rotated * sin))
        return a + b
    return x * cos + rotated * sin


def embed_rows(table: jax.Array, token_ids: jax.Array) -> jax.Array:
    """``table [V, H]``, ``token_ids i32[T]`` -> ``[T, H]`` (the embedding lookup)."""
    return table[token_ids]


def no_collective(x: jax.Array) -> jax.Array:
    """One device: a row-parallel matmul's output is already complete, logits already whole."""
    return x


def only_expert_shard() -> int:
    """One device (no expert parallelism): it holds every expert, from expert 0."""
    return 0


@dataclasses.dataclass(frozen=True)
class ModelOps:
    """The row-wise maths of the model, chosen by the caller like ``attention_fn``.

    matmul: ``(x [M, K], w, *, transpose_w=False, out_dtype=None) -> [M, N]``.
    rms_norm: ``(x [..., H], weight [H], eps) -> [..., H]`` (Hugging Face's Qwen RMSNorm).
    rotary: ``(x [T, H, D], positions i32[T], theta) -> [T, H, D]`` (RoPE).

    The three points where tensor parallelism communicates (``jaxpaged.models.sharding.tp_model_ops``; on
    one device they are the plain lookup and identities, so the traced program is unchanged):
    embed: ``(table [V, H], token_ids i32[T]) -> [T, H]`` (vocabulary-parallel: masked lookup + psum).
    all_reduce: ``[T, H] -> [T, H]`` after o_proj and down_proj (row-parallel partial sums: psum).
    gather_vocab: ``logits [N, V_shard] -> [N, V]`` (all-gather of the vocabulary-parallel LM head).
    expert_shard: ``() -> i32[]``, which slice of the experts this device holds (expert parallelism: the
    ``tp`` axis index; a MoE layer's output then goes through ``all_reduce`` too).

    grouped_matmul: ``(x [M, K], w [G, K, N], group_sizes i32[G]) -> [M, N]`` (a MoE layer's expert GEMMs,
    rows sorted by expert: ``kernels/grouped_matmul.py``; ``w`` may be fp8 experts, an ``Fp8Weight``).

    qkv_epilogue: ``None`` (the steps above, then ``write_kv_fn``), or one function for the whole
    stretch from the qkv matmul to the KV write: ``(x [T, H], w_qkv, bias | None, q_norm | None,
    k_norm | None, positions, kv_pool, layer, slot_mapping, *, eps, theta) -> (q [T, Hq, D], kv_pool)``
    (``models.ops.fused_qkv``: the GEMV's partials, bias, q/k norm, RoPE and the KV write in
    one kernel). When set, that stretch does not call ``matmul``, ``rms_norm``, ``rotary`` or the
    model's ``write_kv_fn``: the function owns all of it.

    The residual stream with unsummed products (``models.ops.get_model_ops`` on a GPU, one
    device; all three set or none): ``matmul_parts: (x [M, K], w [K, N]) -> [P, M, N]`` (a product as
    ``P`` split-K partial sums in fp32, or ``P = 1`` finished product in the model dtype) for o_proj and
    gate_up; ``silu_mul_matmul_parts: (gate_up [P, M, 2I], w_down [I, H]) -> [P, M, H]`` (the MLP's
    activation and down projection); ``add_rms_norm: (parts [P, T, H], residual [T, H], weight [H], eps)
    -> (normed, residual + product)``. The layer then hands its last product to the next layer's input
    norm instead of adding it itself (the add is the same; it runs inside the norm's kernel).
    """

    matmul: Callable[..., jax.Array] = xla_matmul
    rms_norm: Callable[..., jax.Array] = rms_norm
    rotary: Callable[..., jax.Array] = rotary
    embed: Callable[..., jax.Array] = embed_rows
    all_reduce: Callable[..., jax.Array] = no_collective
    gather_vocab: Callable[..., jax.Array] = no_collective
    expert_shard: Callable[[], jax.Array | int] = only_expert_shard
    grouped_matmul: Callable[..., jax.Array] = accepting_fp8_grouped(grouped_matmul)
    qkv_epilogue: Callable[..., tuple[jax.Array, jax.Array]] | None = None
    matmul_parts: Callable[..., jax.Array] | None = None
    silu_mul_matmul_parts: Callable[..., jax.Array] | None = None
    add_rms_norm: Callable[..., tuple[jax.Array, jax.Array]] | None = None

    def __post_init__(self):
        hooks = (self.matmul_parts, self.silu_mul_matmul_parts, self.add_rms_norm)
        if any(h is None for h in hooks) and any(h is not None for h in hooks):
            raise ValueError("matmul_parts, silu_mul_matmul_parts and add_rms_norm go together (all or none)")
        if hooks[0] is not None and self.all_reduce is not no_collective:
            raise ValueError("the residual hooks skip all_reduce: not with tensor parallelism")


DEFAULT_OPS = ModelOps()


def qkv_epilogue_ops(qkv: jax.Array, bias, q_norm, k_norm, positions: jax.Array, kv_pool: KVPool, layer: int,
                     slot_mapping: jax.Array, *, eps: float, theta: float, ops: ModelOps,
                     write_kv_fn: WriteKVFn) -> tuple[jax.Array, KVPool]:
    """The stretch after the qkv projection with ``ops``' RMSNorm and RoPE and ``write_kv_fn``: bias,
    split into heads, q/k norm (Qwen3), RoPE, K/V written at ``layer``. ``qkv [T, (Hq + 2 Hkv) * D]``
    -> ``(q [T, Hq, D], kv_pool)``; head counts from the shapes (``Hkv, D`` from the pool), so a
    tensor-parallel shard passes its own. The reference for ``kernels/qkv_epilogue.py``."""
    t = qkv.shape[0]
    hkv, d = kv_pool.shape[4], kv_pool.shape[5]
    hq = qkv.shape[1] // d - 2 * hkv
    if bias is not None:
        qkv = qkv + bias
    q = qkv[:, : hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    if q_norm is not None:
        q, k = ops.rms_norm(q, q_norm, eps), ops.rms_norm(k, k_norm, eps)
    q, k = ops.rotary(q, positions, theta), ops.rotary(k, positions, theta)
    return q, write_kv_fn(kv_pool, layer, k, v, slot_mapping)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, ops: ModelOps = DEFAULT_OPS) -> jax.Array:
        return ops.rms_norm(x, self.weight[...], self.eps)

    def add_norm(self, parts: jax.Array | None, x: jax.Array, ops: ModelOps) -> tuple[jax.Array, jax.Array]:
        """``x + sum(parts)`` normalised, and that sum (``ops.add_rms_norm``); ``parts`` None: ``x`` normalised."""
        if parts is None:
            return self(x, ops), x
        return ops.add_rms_norm(parts, x, self.weight[...], self.eps)


class Attention(nnx.Module):
    """GQA self-attention over the paged pool: fused qkv, optional q/k norm, RoPE, o-proj."""

    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: Fp8Config | None = None):
        self.cfg = cfg
        init_linear(self, "qkv_proj", rngs, (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), dtype, quant)
        self.qkv_bias = (nnx.Param(jnp.zeros((cfg.q_size + 2 * cfg.kv_size,), dtype))
                         if cfg.attention_bias else None)
        init_linear(self, "o_proj", rngs, (cfg.q_size, cfg.hidden_size), dtype, quant)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def __call__(self, x: jax.Array, positions: jax.Array, kv_pool: KVPool, layer: int,
                 meta: AttentionMetadata, attention_fn: AttentionFn, write_kv_fn: WriteKVFn,
                 ops: ModelOps = DEFAULT_OPS):
        cfg = self.cfg
        if ops.qkv_epilogue is not None:
            q, kv_pool = ops.qkv_epilogue(
                x, linear_weight(self, "qkv_proj", x.dtype), None if self.qkv_bias is None else self.qkv_bias[...],
                None if self.q_norm is None else self.q_norm.weight[...],
                None if self.k_norm is None else self.k_norm.weight[...],
                positions, kv_pool, layer, meta.slot_mapping, eps=cfg.rms_norm_eps, theta=cfg.rope_theta)
            return self._attend(q, x.dtype, kv_pool, layer, meta, attention_fn, ops)
        q, kv_pool = qkv_epilogue_ops(
            ops.matmul(x, linear_weight(self, "qkv_proj", x.dtype)),
            None if self.qkv_bias is None else self.qkv_bias[...],
            None if self.q_norm is None else self.q_norm.weight[...],
            None if self.k_norm is None else self.k_norm.weight[...],
            positions, kv_pool, layer, meta.slot_mapping, eps=cfg.rms_norm_eps, theta=cfg.rope_theta, ops=ops,
            write_kv_fn=write_kv_fn)
        return self._attend(q, x.dtype, kv_pool, layer, meta, attention_fn, ops)

    def _attend(self, q, dtype, kv_pool, layer, meta, attention_fn, ops):
        """Attention over the pool (this token's K/V already written), then o_proj (+ all-reduce)."""
        t = q.shape[0]
        out = attention_fn(q, kv_pool, layer, meta.cu_q_lens, meta.kv_lens, meta.block_tables)
        out = out.reshape(t, -1).astype(dtype)
        w = linear_weight(self, "o_proj", dtype)
        if ops.matmul_parts is not None:  # o_proj's partials, added to the residual by the next norm
            return ops.matmul_parts(out, w), kv_pool
        return ops.all_reduce(ops.matmul(out, w)), kv_pool


class MLP(nnx.Module):
    """SiLU-gated MLP with gate and up fused: ``[H, 2I]`` then ``[I, H]``."""

    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: Fp8Config | None = None):
        init_linear(self, "gate_up_proj", rngs, (cfg.hidden_size, 2 * cfg.intermediate_size), dtype, quant)
        init_linear(self, "down_proj", rngs, (cfg.intermediate_size, cfg.hidden_size), dtype, quant)

    def __call__(self, x: jax.Array, ops: ModelOps = DEFAULT_OPS) -> jax.Array:
        gate_up, down = linear_weight(self, "gate_up_proj", x.dtype), linear_weight(self, "down_proj", x.dtype)
        if ops.matmul_parts is not None:  # down_proj's partials, added to the residual by the next norm
            return ops.silu_mul_matmul_parts(ops.matmul_parts(x, gate_up), down)
        gate, up = jnp.split(ops.matmul(x, gate_up), 2, axis=-1)
        return ops.all_reduce(ops.matmul(jax.nn.silu(gate) * up, down))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: Fp8Config | None = None,
                 moe: bool = False):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SparseMoeBlock(cfg, dtype, rngs, quant) if moe else MLP(cfg, dtype, rngs, quant)

    def __call__(self, x, positions, kv_pool, layer, meta, attention_fn, write_kv_fn,
                 ops: ModelOps = DEFAULT_OPS, pending: jax.Array | None = None):
        """``x [T, H]``: the residual stream; ``pending``: the previous layer's MLP output as partials
        not yet added to it (``ops.add_rms_norm`` set), else None. Returns ``(x, pending, kv_pool)``."""
        if ops.add_rms_norm is None:
            h, kv_pool = self.attn(self.input_layernorm(x, ops), positions, kv_pool, layer, meta, attention_fn,
                                   write_kv_fn, ops)
            x = x + h
            x = x + self.mlp(self.post_attention_layernorm(x, ops), ops)
            return x, None, kv_pool
        h, x = self.input_layernorm.add_norm(pending, x, ops)
        parts, kv_pool = self.attn(h, positions, kv_pool, layer, meta, attention_fn, write_kv_fn, ops)
        h, x = self.post_attention_layernorm.add_norm(parts, x, ops)
        return x, self.mlp(h, ops), kv_pool


@functools.partial(jax.jit, static_argnames=("graphdef", "attention_fn", "write_kv_fn", "ops"))
def decoder_layer(graphdef: nnx.GraphDef, state: nnx.State, x, positions, kv_pool: KVPool, layer: jax.Array, meta,
                  pending, *, attention_fn: AttentionFn, write_kv_fn: WriteKVFn, ops: ModelOps):
    """One :class:`DecoderLayer` (``graphdef``, ``state``) at pool layer ``layer`` (an ``i32[]`` operand):
    ``(x, pending, kv_pool)`` as the layer returns them.

    Why a jitted function with the layer as an operand: every layer of a step has the same structure
    and shapes, so the step traces and lowers one layer (its Pallas kernels included) and calls it
    ``L`` times; XLA inlines the calls, so the compiled step is the same. Tracing and lowering the
    layers one by one took most of a cold start."""
    return nnx.merge(graphdef, state)(x, positions, kv_pool, layer, meta, attention_fn, write_kv_fn, ops, pending)


class Qwen(nnx.Module):
    """The decoder: embed -> layers -> final norm; ``compute_logits`` applies the (tied) LM head.

    ``quantization``: the linear layers' and a MoE layer's experts' weights in fp8
    (``models/quantization.py``); embeddings, LM head, norms, biases and routers stay in ``dtype``, the
    dtype of the activations."""

    def __init__(self, cfg: QwenConfig, dtype: str | jnp.dtype = "float32", *, rngs: nnx.Rngs,
                 quantization: Fp8Config | None = None):
        dtype = jnp.dtype(dtype)
        self.cfg = cfg
        self.embed_tokens = _init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs, quantization, cfg.is_moe_layer(i))
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _init(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, kv_pool: KVPool,
                 meta: AttentionMetadata, *, attention_fn: AttentionFn,
                 write_kv_fn: WriteKVFn, ops: ModelOps = DEFAULT_OPS) -> tuple[jax.Array, KVPool]:
        """``token_ids, positions i32[T]`` -> final hidden states ``[T, H]`` and the updated pool."""
        x = ops.embed(self.embed_tokens[...], token_ids)
        pending = None
        for i, layer in enumerate(self.layers):
            graphdef, state = nnx.split(layer)
            x, pending, kv_pool = decoder_layer(graphdef, state, x, positions, kv_pool, jnp.int32(i), meta, pending,
                                                attention_fn=attention_fn, write_kv_fn=write_kv_fn, ops=ops)
        return self.norm.add_norm(pending, x, ops)[0], kv_pool

    def compute_logits(self, hidden: jax.Array, ops: ModelOps = DEFAULT_OPS) -> jax.Array:
        """``hidden [N, H]`` -> fp32 logits ``[N, vocab]`` (fp32 accumulation)."""
        if self.lm_head is None:  # tied: read the embedding [V, H] as it is
            logits = ops.matmul(hidden, self.embed_tokens[...], transpose_w=True, out_dtype=jnp.float32)
        else:
            logits = ops.matmul(hidden, self.lm_head[...], out_dtype=jnp.float32)
        return ops.gather_vocab(logits)

