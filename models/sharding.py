"""Tensor parallelism: a ``Mesh`` with one ``tp`` axis, what each parameter and the KV pool are split
along, and the step run per shard under ``shard_map``.

Megatron-style (as vLLM, sglang-jax): every device holds ``1/tp`` of the attention heads and of the MLP
columns, and of the vocabulary (embedding rows, LM-head columns). Each device runs the same per-shard
model (``shard_config``: heads, KV heads, intermediate size and vocabulary divided by ``tp``) on its
own slices, and the shards meet at three points (``tp_model_ops``):

  * embedding: masked lookup of the ids in this shard's vocabulary range, then ``psum`` ``[T, H]``;
  * after ``o_proj`` and ``down_proj`` (row-parallel: each shard's partial product): ``psum`` ``[T, H]``;
  * logits at the sampled rows: ``all_gather`` ``[S, V/tp] -> [S, V]``; every shard then samples the
    same tokens from the same logits (replicated output, no further collective).

The fused ``qkv_proj [H, q + 2 kv]`` and ``gate_up_proj [H, 2 I]`` keep their fused form but their
columns are laid out per shard: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` and ``[gate_0 up_0 | gate_1 up_1
| ...]`` (``models/sharded_load.py`` builds them that way from the safetensors), so splitting the out
dimension in ``tp`` equal pieces gives each device exactly its heads' fused block, and the model code
(which splits its local ``qkv`` as ``[q | k | v]``) runs unchanged on every shard.

Expert parallelism (Qwen3-MoE) on the same axis: each device holds ``E / tp`` whole experts
(``experts_gate_up`` / ``experts_down`` split along the expert axis) and the whole router; it routes every
token, runs the pairs of its own experts (``models/moe.py``) and its partial sum joins the all-reduce, as
a row-parallel ``down_proj``'s does. The tokens are already on every device, so no all-to-all is needed.

KV heads: with ``tp <= num_key_value_heads`` each shard owns ``Hkv / tp`` of them; with more shards
than KV heads each KV head is replicated on ``tp / Hkv`` consecutive shards (the ones whose query
heads read it), so every shard holds exactly one. The pool is ``[L, num_blocks, block_size, 2, tp *
Hkv_shard, D]`` split on the head axis (axis 4): one block table and one slot mapping address every shard's
slice of the same blocks, so the host side (scheduler, block tables) is unchanged.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import QwenConfig
from .quantization import BLOCK_SCALE, SCALE, Fp8Config, quantize_linears
from .qwen import ModelOps

TP_AXIS = "tp"
POOL_SPEC = P(None, None, None, None, TP_AXIS, None)  # the KV pool [L, N, bs, 2, Hkv, D] (kv_pool.py): by KV head

# Parameter name (the last key of its path in the NNX state) -> how it is split. Anything else
# (RMSNorm weights, q/k norms) is replicated.
PARAM_SPECS = {
    "embed_tokens": P(TP_AXIS, None),  # [V, H]: vocabulary rows
    "lm_head": P(None, TP_AXIS),  # [H, V]: vocabulary columns
    "qkv_proj": P(None, TP_AXIS),  # [H, tp * (q + 2 kv)_shard]: per-shard fused columns
    "qkv_bias": P(TP_AXIS),
    "o_proj": P(TP_AXIS, None),  # [q, H]: rows of this shard's heads; output psum'd
    "gate_up_proj": P(None, TP_AXIS),  # [H, tp * 2 I_shard]: per-shard [gate | up]
    "down_proj": P(TP_AXIS, None),  # [I, H]: rows; output psum'd
    "experts_gate_up": P(TP_AXIS, None, None),  # [E, H, 2 I]: whole experts per device (expert parallelism)
    "experts_down": P(TP_AXIS, None, None),  # [E, I, H]; output psum'd
    # fp8 weights' per-output-channel scales (models/quantization.py): split with the output columns, whole
    # where the rows are split (each shard's partial product scaled alike, then summed)
    "qkv_proj" + SCALE: P(TP_AXIS),
    "o_proj" + SCALE: P(),
    "gate_up_proj" + SCALE: P(TP_AXIS),
    "down_proj" + SCALE: P(),
    "experts_gate_up" + SCALE: P(TP_AXIS, None),  # [E, N]: with their experts
    "experts_down" + SCALE: P(TP_AXIS, None),
    # an fp8 checkpoint's block scales [K / g, N]: split as their weights are
    "qkv_proj" + BLOCK_SCALE: P(None, TP_AXIS),
    "o_proj" + BLOCK_SCALE: P(TP_AXIS, None),
    "gate_up_proj" + BLOCK_SCALE: P(None, TP_AXIS),
    "down_proj" + BLOCK_SCALE: P(TP_AXIS, None),
    "experts_gate_up" + BLOCK_SCALE: P(TP_AXIS, None, None),  # [E, K / g, N]: with their experts
    "experts_down" + BLOCK_SCALE: P(TP_AXIS, None, None),
}


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh ``("tp",)`` over the first ``tensor_parallel_size`` devices (of every process, so
    under ``jax.distributed`` it spans hosts)."""
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} devices are "
                         f"visible ({jax.default_backend()}); on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size}")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP_AXIS,))


def check_divisible(cfg: QwenConfig, tp: int) -> None:
    """Raises ``ValueError`` naming the field when ``cfg`` cannot be split ``tp`` ways."""
    hkv = cfg.num_key_value_heads
    problems = [f"{name} ({getattr(cfg, name)})" for name in
                ("num_attention_heads", "intermediate_size", "vocab_size") if getattr(cfg, name) % tp]
    if hkv % tp and tp % hkv:
        problems.append(f"num_key_value_heads ({hkv}: neither a multiple nor a divisor of tp)")
    if cfg.num_experts % tp:
        problems.append(f"num_experts ({cfg.num_experts})")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp} does not divide {', '.join(problems)}")


def shard_config(cfg: QwenConfig, tp: int) -> QwenConfig:
    """The model one shard runs: ``Hq/tp`` query heads, ``max(Hkv/tp, 1)`` KV heads, ``I/tp``, ``V/tp``, and
    ``E/tp`` of the experts (``expert_shards``; the router still sees all ``E``)."""
    check_divisible(cfg, tp)
    if tp == 1:
        return cfg
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                               num_key_value_heads=max(cfg.num_key_value_heads // tp, 1),
                               intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp,
                               expert_shards=tp if cfg.num_experts else 1)


def kv_heads_of_shard(cfg: QwenConfig, tp: int, shard: int) -> range:
    """The global KV heads shard ``shard`` holds (one replicated head when ``tp > Hkv``)."""
    hkv = cfg.num_key_value_heads
    if hkv >= tp:
        per = hkv // tp
        return range(shard * per, (shard + 1) * per)
    head = shard // (tp // hkv)
    return range(head, head + 1)


def param_spec(path: tuple) -> P:
    """The ``PartitionSpec`` of the parameter at ``path`` (keys of the NNX state)."""
    names = [getattr(key, "key", getattr(key, "name", key)) for key in path]
    names = [n for n in names if isinstance(n, str) and n != "value"]  # "value": an NNX Variable's field
    return PARAM_SPECS.get(names[-1], P()) if names else P()


def state_specs(treedef) -> list[P]:
    """One ``PartitionSpec`` per leaf of a state with structure ``treedef`` (in leaf order)."""
    placeholder = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(placeholder)[0]]
    return [param_spec(path) for path in paths]


def global_shape(local_shape: tuple[int, ...], spec: P, tp: int) -> tuple[int, ...]:
    """The global shape of a parameter whose shards are ``local_shape``, split as ``spec``."""
    return tuple(n * tp if i < len(spec) and spec[i] == TP_AXIS else n for i, n in enumerate(local_shape))


def shard_index(index: tuple[slice, ...], spec: P, local_shape: tuple[int, ...]) -> int:
    """Which shard the global slice ``index`` (from ``make_array_from_callback``) is."""
    for dim, axis in enumerate(spec):
        if axis == TP_AXIS:
            return (index[dim].start or 0) // local_shape[dim]
    return 0


# ---- the communication points (inside shard_map) ---------------------------------------------------
def vocab_parallel_embed(table: jax.Array, token_ids: jax.Array) -> jax.Array:
    """``table [V/tp, H]`` (this shard's vocabulary rows), ``token_ids i32[T]`` (global) -> ``[T, H]``:
    rows of ids outside this shard's range are zero, and the psum adds the one shard that has each."""
    rows = table.shape[0]
    local = token_ids - jax.lax.axis_index(TP_AXIS) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.where(mine[:, None], table[jnp.clip(local, 0, rows - 1)], jnp.zeros((), table.dtype))
    return jax.lax.psum(x, TP_AXIS)


def tp_all_reduce(x: jax.Array) -> jax.Array:
    """Sum of the shards' partial ``o_proj`` / ``down_proj`` products ``[T, H]``."""
    return jax.lax.psum(x, TP_AXIS)


def gather_vocab(logits: jax.Array) -> jax.Array:
    """``logits [N, V/tp]`` per shard -> ``[N, V]`` on every shard (vocabulary order)."""
    return jax.lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)


def tp_shard_index() -> jax.Array:
    """This device's index on the ``tp`` axis: which slice of the experts it holds."""
    return jax.lax.axis_index(TP_AXIS)


def tp_model_ops(ops: ModelOps) -> ModelOps:
    """``ops`` with the tensor-parallel embedding, all-reduce and logits gather, and the experts' shard index.
    Products stay summed per shard before their all-reduce (no ``matmul_parts`` / ``add_rms_norm``
    residual fusion)."""
    return dataclasses.replace(ops, embed=vocab_parallel_embed, all_reduce=tp_all_reduce, gather_vocab=gather_vocab,
                               expert_shard=tp_shard_index, matmul_parts=None, silu_mul_matmul_parts=None,
                               add_rms_norm=None)


def shard_step(step: Callable, mesh: Mesh, treedef) -> Callable:
    """Wraps ``step(leaves, kv_pool, packed, prev_tokens, spare_tokens, layout)`` (``ModelRunner``'s
    jitted body) in ``shard_map``: weight leaves split by ``PARAM_SPECS``, the pool by KV head, the packed
    inputs and previous tokens replicated; the sampled tokens come back replicated (into the donated,
    replicated ``spare_tokens`` buffer, which the shards never read), the pool split."""
    leaf_specs = state_specs(treedef)

    def tp_step(leaves, kv_pool, packed, prev_tokens, spare_tokens, layout):
        del spare_tokens
        body = jax.shard_map(lambda lv, kv, pk, prev: step(lv, kv, pk, prev, None, layout), mesh=mesh,
                             in_specs=(leaf_specs, POOL_SPEC, P(), P()), out_specs=(P(), POOL_SPEC),
                             check_vma=False)  # tokens: every shard samples the same gathered logits
        return body(leaves, kv_pool, packed, prev_tokens)

    return tp_step


def step_shardings(mesh: Mesh, treedef) -> dict:
    """``jit`` keyword arguments fixing the step's argument and result shardings, so a first call
    with fresh (uncommitted) inputs and later calls fed the previous step's replicated tokens share
    one executable: weights as ``PARAM_SPECS``, pool by KV head, inputs and tokens replicated."""
    replicated = NamedSharding(mesh, P())
    leaves = [NamedSharding(mesh, spec) for spec in state_specs(treedef)]
    pool = NamedSharding(mesh, POOL_SPEC)
    return dict(in_shardings=(leaves, pool, replicated, replicated, replicated), out_shardings=(replicated, pool))


# ---- arrays ------------------------------------------------------------------------------------------
def random_leaves(shapes: Sequence[tuple[int, ...]], shardings: Sequence[Any], ones: Sequence[bool], dtype: str,
                  seed: int = 0) -> list[jax.Array]:
    """Random weights (normal * 0.02, or ones where ``ones``), each made directly with its sharding by one
    compiled initialiser per (shape, sharding, ones), which layers share (compiled in parallel); leaf ``i`` draws from the
    ``i``-th key of ``seed``, so the values do not depend on how a leaf is split. Why not the model's
    eager initialisers: one small compilation per draw (seconds for a whole model), and one program for
    the whole model compiled for as long."""
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    kinds = list(dict.fromkeys(zip(map(tuple, shapes), shardings, ones)))

    def compile_maker(kind):
        shape, sharding, one = kind
        if one:
            fn = jax.jit(lambda k: jnp.ones(shape, dtype), out_shardings=sharding)
        else:
            fn = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype),
                         out_shardings=sharding)
        return fn.lower(keys[0]).compile()

    with concurrent.futures.ThreadPoolExecutor(min(len(kinds), os.cpu_count() or 1) or 1) as pool:
        makers = dict(zip(kinds, pool.map(compile_maker, kinds)))  # (compiled in parallel)
    return [makers[(tuple(shape), sharding, one)](keys[i])
            for i, (shape, sharding, one) in enumerate(zip(shapes, shardings, ones))]


def scale_placement(mesh: Mesh) -> Callable[[tuple, Any], tuple[NamedSharding, NamedSharding]]:
    """``quantize_linears``' ``place``: a linear weight keeps its split, its scale is split as ``PARAM_SPECS``."""
    def place(path: tuple, _w) -> tuple[NamedSharding, NamedSharding]:
        return (NamedSharding(mesh, param_spec(path)),
                NamedSharding(mesh, param_spec(path[:-1] + (path[-1] + SCALE,))))
    return place


def random_state(cfg: QwenConfig, dtype: str, seed: int = 0, mesh: Mesh | None = None,
                 quant: Fp8Config | None = None):
    """``(graphdef, state)`` of random weights (normal * 0.02, RMSNorm weights one; ``random_leaves``).
    ``mesh``: created directly split over its ``tp`` axis (random bits are generated per shard, no device
    ever holds a whole matrix), ``cfg`` then being the per-shard config and ``graphdef`` the per-shard
    model, as ``load_params(..., tensor_parallel_size)``; ``None``: committed to the first device.
    ``quant``: the linear weights then quantized per output channel (a bf16 checkpoint loaded as fp8)."""
    from .convert import abstract_model

    if quant is not None:
        if quant.weight_block_size is not None:
            raise ValueError("random weights are quantized per output channel (weight_block_size None)")
        _, state = random_state(cfg, dtype, seed, mesh)
        pure = quantize_linears(nnx.to_pure_dict(state), None if mesh is None else scale_placement(mesh))
        del state
        graphdef, state = abstract_model(cfg, dtype, quant)
        nnx.replace_by_pure_dict(state, pure)
        return graphdef, state

    graphdef, abstract = abstract_model(cfg, dtype)
    paths, treedef = jax.tree.flatten_with_path(abstract)
    leaves = [leaf for _, leaf in paths]
    ones = ["norm" in jax.tree_util.keystr(path) for path, _ in paths]  # the RMSNorm weights
    if mesh is None:
        shapes = [tuple(leaf.shape) for leaf in leaves]
        shardings = [jax.sharding.SingleDeviceSharding(jax.local_devices()[0])] * len(leaves)
    else:
        tp = mesh.shape[TP_AXIS]
        specs = state_specs(treedef)
        shapes = [global_shape(tuple(leaf.shape), spec, tp) for leaf, spec in zip(leaves, specs)]
        shardings = [NamedSharding(mesh, spec) for spec in specs]
    return graphdef, jax.tree.unflatten(treedef, random_leaves(shapes, shardings, ones, dtype, seed))


def per_device_bytes(tree: Any) -> dict[str, int]:
    """Bytes each device holds of the arrays in ``tree`` (its addressable shards), by device."""
    used: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device)
            used[key] = used.get(key, 0) + shard.data.nbytes
    return used


# ---- what the engine asks --------------------------------------------------------------------------
def params_tp(params) -> int:
    """The tensor-parallel size ``params`` (a ``ModelParams``) were loaded for (1: one device)."""
    return 1 if params.mesh is None else params.mesh.shape[TP_AXIS]
