"""Loading a Hugging Face Qwen checkpoint split over a tensor-parallel mesh, shard by shard.

Each parameter is created with ``jax.make_array_from_callback``: for every device the callback slices
that device's rows or columns out of the memory-mapped safetensors (only those pages are read),
combines them exactly as the one-device converter does (``convert.name_table``: concatenate q/k/v or
gate/up, transpose to ``[in, out]``) and the block goes to that device alone. No whole weight matrix
is ever built, on the host or on a device. Under ``jax.distributed`` each process builds only the
blocks of its own devices.

Which slice a shard reads, per Hugging Face tensor (``[out, in]`` as stored):
  q_proj weight/bias   rows of the shard's query heads          -> qkv_proj / qkv_bias columns
  k_proj, v_proj       rows of the shard's KV heads (replicated when tp > Hkv: ``kv_heads_of_shard``)
  o_proj               columns of the shard's query heads      -> o_proj rows
  gate_proj, up_proj   rows ``[s I/tp, (s+1) I/tp)``            -> gate_up_proj columns
  down_proj            columns of the same range               -> down_proj rows
  embed_tokens, lm_head  rows ``[s V/tp, (s+1) V/tp)``          -> embedding rows / LM-head columns
  mlp.experts.<e>.*    whole, for the shard's experts only      -> experts_gate_up / experts_down (stacked)
  mlp.gate (router)    whole on every shard
The per-shard result is ``[q_s | k_s | v_s]`` and ``[gate_s | up_s]``: the fused layout the per-shard
model expects (see ``jaxpaged.models.sharding``).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from .config import QwenConfig, canonical_dtype
from .convert import abstract_model, name_table, read_hf_tensors
from .quantization import SCALE, Fp8Config, quantizer


def _source_slice(name: str, cfg: QwenConfig, tp: int, shard: int) -> tuple[int, slice] | None:
    """``(axis, slice)`` of HF tensor ``name`` that shard ``shard`` reads, or ``None`` (whole tensor)."""
    from jaxpaged.models.sharding import kv_heads_of_shard

    if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):  # experts whole (chosen by rule), router whole
        return None
    d = cfg.head_dim
    q_per = cfg.num_attention_heads // tp * d
    i_per = cfg.intermediate_size // tp
    v_per = cfg.vocab_size // tp
    q_rows = slice(shard * q_per, (shard + 1) * q_per)
    kv = kv_heads_of_shard(cfg, tp, shard)
    kv_rows = slice(kv.start * d, kv.stop * d)
    i_rows = slice(shard * i_per, (shard + 1) * i_per)
    if ".q_proj." in name:
        return 0, q_rows
    if ".k_proj." in name or ".v_proj." in name:
        return 0, kv_rows
    if ".o_proj." in name:
        return 1, q_rows
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, i_rows
    if ".down_proj." in name:
        return 1, i_rows
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, slice(shard * v_per, (shard + 1) * v_per)
    return None


def shard_block(rule, tensors: dict[str, np.ndarray], cfg: QwenConfig, tp: int, shard: int,
                dtype: str, quant: Fp8Config | None = None) -> np.ndarray:
    """Shard ``shard``'s block of the parameter ``rule`` describes (shape-checked sources). Block scales
    are read expanded to their weight's rows (``[out, in / g]``) and sliced as the weight is, their
    input columns in groups of ``g``. Stacked experts (``rule.experts``): the sources of the shard's
    ``E / tp`` experts."""
    parts = []
    picked = range(len(rule.sources))
    if rule.experts and tp > 1:
        per = len(rule.sources) // tp  # sources per shard: its experts' (rule.experts each), in expert order
        picked = range(shard * per, (shard + 1) * per)
    for i in picked:
        name = rule.sources[i][0]
        t = rule.read(tensors, i)
        cut = _source_slice(name, cfg, tp, shard) if tp > 1 else None
        if cut is not None:
            axis, sl = cut
            if rule.block is not None and axis == 1:
                g = rule.scaled[i][1] // t.shape[1]
                sl = slice(sl.start // g, sl.stop // g)  # (load_sharded_state checked that g divides them)
            t = t[sl] if axis == 0 else t[:, sl]
        parts.append(np.asarray(t).astype(rule.read_dtype(dtype, quant)))
    return np.ascontiguousarray(rule.combine(parts))


def load_sharded_state(path: str | Path, cfg: QwenConfig, mesh: Mesh, dtype: str, quant: Fp8Config | None = None):
    """``(graphdef, state)`` for ``mesh``: the per-shard model's graph and global arrays split as
    ``jaxpaged.models.sharding.PARAM_SPECS`` says, every block read from the safetensors for its device.
    ``quant``: fp8 weights; per output channel, each projection quantized once split, its scale split
    alike; with block scales (an fp8 checkpoint), the scales split with their weights' columns, or rows
    where the rows are split (each shard's rows a whole number of the scale's row groups)."""
    from jaxpaged.models.sharding import TP_AXIS, global_shape, param_spec, scale_placement, shard_config, shard_index

    dtype = canonical_dtype(dtype)
    tp = mesh.shape[TP_AXIS]
    if quant is not None and quant.weight_block_size is not None:
        for what, k in (("o_proj's input (q heads x head_dim)", cfg.q_size),
                        ("intermediate_size", cfg.intermediate_size)):
            g = math.gcd(quant.weight_block_size[1], k)
            if (k // tp) % g:
                raise ValueError(f"tensor_parallel_size={tp} splits {what} ({k}) into {k // tp} rows a device, "
                                 f"not a multiple of the fp8 checkpoint's {g}-row scale blocks (weight_block_size "
                                 f"{list(quant.weight_block_size)}): use a tensor_parallel_size that keeps them whole")
    local_cfg = shard_config(cfg, tp)
    graphdef, state = abstract_model(local_cfg, dtype, quant)
    pure = nnx.to_pure_dict(state)
    tensors = read_hf_tensors(path)
    place = scale_placement(mesh)
    for rule in name_table(cfg, quant):
        node = pure
        for key in rule.path[:-1]:
            node = node[key]
        local_shape = tuple(node[rule.path[-1]].shape)
        spec = param_spec(rule.path)
        shape = global_shape(local_shape, spec, tp)

        def block(index, rule=rule, spec=spec, local_shape=local_shape):
            out = shard_block(rule, tensors, cfg, tp, shard_index(index, spec, local_shape), dtype, quant)
            assert out.shape == local_shape, (rule.path, out.shape, local_shape)
            return out

        value = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), block)
        if rule.linear and quant is not None:
            name = rule.path[-1]
            node[name], node[name + SCALE] = quantizer(place(rule.path, value))(value)
        else:
            node[rule.path[-1]] = value
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state
