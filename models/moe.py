"""Qwen3-MoE's sparse MLP: a router picks ``k`` of ``E`` experts per token, the experts' GEMMs run grouped.

Routing is Hugging Face's (``Qwen3MoeTopKRouter``): router logits in the model dtype, a softmax over all
experts in float32, the ``k`` largest probabilities, renormalised to sum to one if ``norm_topk_prob``,
then cast to the model dtype. The experts are SiLU-gated MLPs like the dense one, stacked:
``experts_gate_up [E, H, 2 I]`` (``[gate | up]`` per expert) and ``experts_down [E, I, H]``.

The step, with fixed shapes (``T`` tokens of the bucket, ``k`` experts each; no shape depends on the
routing, no loop over experts):
  1. the ``T k`` (token, expert) pairs sorted by expert (a stable argsort), ``group_sizes`` from a
     bincount of length ``E``;
  2. the tokens' rows gathered in that order, ``[T k, H]``, and the two expert GEMMs run as grouped GEMMs
     over them (``ops.grouped_matmul``: ``jax.lax.ragged_dot``, or the fixed-tile kernel for
     ``batch_invariant``; ``kernels/grouped_matmul.py``);
  3. each pair's output scaled by its router weight, put back in (token, slot) order (a permutation:
     no sums) and each token's ``k`` slots added in slot order.
Every token's arithmetic is its own, in an order that does not depend on the batch: the softmax sums
in a fixed pairwise tree, the slots add in a fixed order, the products are rounded before they are
added (an optimisation barrier: no fused multiply-add that one step shape would form and another not).

Expert parallelism (``models/sharding.py``): a device holds ``E / shards`` experts (``experts_*`` split
along the expert axis) and the whole router. Every device routes every token (the tokens are
replicated across the tensor-parallel devices already); pairs of other devices' experts sort after its
own and fall outside its groups (the grouped GEMM gives zero rows there), and the devices' partial sums
meet in the same all-reduce as a row-parallel ``down_proj``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .config import QwenConfig
from .quantization import Fp8Config, Fp8Weight, init_linear, linear_weight


def pairwise_sum(x: jax.Array) -> jax.Array:
    """``x [T, N]`` -> ``[T, 1]``: each row summed in a fixed pairwise tree (zeros pad ``N`` to a power of
    two), by elementwise adds only, so a row's sum never depends on the other rows or on their number."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, ((0, 0), (0, width - n)))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[:, :half] + x[:, half:]
    return x


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """Router ``logits f32[T, E]`` -> ``(weights f32[T, k], experts i32[T, k])``: softmax over all experts,
    the ``k`` most probable (largest first), renormalised over those ``k`` if ``norm_topk_prob``."""
    logits = logits.astype(jnp.float32)
    e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = e / pairwise_sum(e)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        total = weights[:, :1]
        for j in range(1, top_k):  # the k weights summed in slot order
            total = total + weights[:, j:j + 1]
        weights = weights / total
    return weights, experts.astype(jnp.int32)


def sort_by_expert(experts: jax.Array, first: jax.Array | int, num_local: int) -> tuple[jax.Array, jax.Array]:
    """``experts i32[T, k]`` (global ids) -> ``(order i32[T k], group_sizes i32[num_local])``: the flat
    (token, slot) pairs in expert order for the experts ``first .. first + num_local - 1`` this device
    holds, pairs of other experts last (outside every group)."""
    local = experts.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    return order, group_sizes


def sparse_moe(x: jax.Array, router: jax.Array, experts_gate_up: jax.Array | Fp8Weight,
               experts_down: jax.Array | Fp8Weight, *, top_k: int, norm_topk_prob: bool, ops: Any) -> jax.Array:
    """``x [T, H]`` -> this device's experts' share of the MoE output ``[T, H]`` (the whole output on one
    device; summed over devices by ``ops.all_reduce`` under expert parallelism). ``router [H, E]``,
    ``experts_gate_up [E_local, H, 2 I]``, ``experts_down [E_local, I, H]`` (arrays, or fp8 experts with
    their scales); ``ops``: the model's ``ModelOps`` (``matmul``, ``grouped_matmul``, ``expert_shard``)."""
    t, h = x.shape
    num_local = experts_gate_up.shape[0]
    weights, experts = route(ops.matmul(x, router).astype(jnp.float32), top_k, norm_topk_prob)
    order, group_sizes = sort_by_expert(experts, ops.expert_shard() * num_local, num_local)
    tokens = order // top_k  # [T k]: the token of each sorted pair
    gate, up = jnp.split(ops.grouped_matmul(x[tokens], experts_gate_up, group_sizes), 2, axis=-1)
    y = ops.grouped_matmul(jax.nn.silu(gate) * up, experts_down, group_sizes)  # [T k, H]
    y = jax.lax.optimization_barrier(y * weights.astype(x.dtype).reshape(-1)[order][:, None])
    slots = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(t, top_k, h)
    out = slots[:, 0]
    for j in range(1, top_k):
        out = out + slots[:, j]
    return out


class SparseMoeBlock(nnx.Module):
    """The MoE MLP of one layer: ``gate [H, E]`` (the router, Hugging Face's name), ``experts_gate_up
    [E_local, H, 2 I]``, ``experts_down [E_local, I, H]``; with ``quant`` the experts in fp8, their scales
    beside them (``models/quantization.py``), the router in ``dtype``."""

    def __init__(self, cfg: QwenConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: Fp8Config | None = None):
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_local_experts
        init_linear(self, "gate", rngs, (h, cfg.num_experts), dtype, None)
        init_linear(self, "experts_gate_up", rngs, (e, h, 2 * i), dtype, quant)
        init_linear(self, "experts_down", rngs, (e, i, h), dtype, quant)

    def __call__(self, x: jax.Array, ops: Any) -> jax.Array:
        out = sparse_moe(x, self.gate[...], linear_weight(self, "experts_gate_up", x.dtype),
                         linear_weight(self, "experts_down", x.dtype), top_k=self.top_k,
                         norm_topk_prob=self.norm_topk_prob, ops=ops)
        if ops.matmul_parts is not None:  # handed to the next norm as a finished product (one part)
            return out[None]
        return ops.all_reduce(out)
