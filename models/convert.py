"""Hugging Face Qwen checkpoint folder -> Flax NNX state, through an explicit name table with shape checks.

Hugging Face stores linear weights ``[out, in]``; jaxpaged stores ``[in, out]`` and fuses q/k/v and
gate/up into one matrix each, so every entry of the table names the Hugging Face tensors it reads,
their expected shapes, and how they combine.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from .config import CheckpointError, QwenConfig, canonical_dtype
from .quantization import BLOCK_SCALE, SCALE, Fp8Config, expand_block_scale, quantizer
from .qwen import Qwen
from .safetensors_io import read_safetensors

_NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
              "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One of our parameters: the HF tensors it is built from, their shapes, and the combination.

    ``storage``: the dtype the sources are read in (None: the model's). ``linear``: a projection's weight,
    quantized per output channel after the combination when the model's weights are fp8 but the
    checkpoint's are not (read in float32 first, so only that one rounding happens). ``block``: the
    sources are the ``weight_scale_inv`` of weights of shapes ``scaled`` in blocks of that size, read
    (``read``) expanded to their weights' rows, ``[out, in / g]`` (``expand_block_scale``).
    ``experts``: the parameter stacks one block per expert along its first axis, built from this many
    sources per expert in expert order (a device that holds some of the experts reads only theirs)."""

    path: tuple[str | int, ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]
    combine: Callable[[list[np.ndarray]], np.ndarray]
    storage: str | None = None
    linear: bool = False
    block: tuple[int, int] | None = None
    scaled: tuple[tuple[int, int], ...] = ()
    experts: int = 0

    def read(self, tensors: dict[str, np.ndarray], i: int) -> np.ndarray:
        """Source ``i``, shape-checked (and expanded, for block scales), not yet cast. An fp8 weight must be
        stored in fp8: casting another dtype to it would drop its scale."""
        name, shape = self.sources[i]
        t = checked_tensor(tensors, name, shape)
        if self.storage == "float8_e4m3fn" and t.dtype != _NP_DTYPES["float8_e4m3fn"]:
            raise CheckpointError(f"tensor {name!r} is {t.dtype}, but config.json's quantization_config says the "
                                  "linear weights are fp8 (float8_e4m3fn)")
        if self.block is None:
            return t
        return expand_block_scale(np.asarray(t), *self.scaled[i], self.block)

    def read_dtype(self, dtype: str, quant: Fp8Config | None) -> np.dtype:
        """The numpy dtype this rule's sources are cast to for a model of ``dtype``."""
        if self.linear and quant is not None:
            return _NP_DTYPES["float32"]
        return _NP_DTYPES[self.storage or dtype]


def _transpose(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0].T


def _concat_rows_then_transpose(ts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(ts, axis=0).T


def _concat(ts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(ts, axis=0)


def _same(ts: list[np.ndarray]) -> np.ndarray:
    return ts[0]


def _stack_gate_up(ts: list[np.ndarray]) -> np.ndarray:
    """``[gate_0, up_0, gate_1, up_1, ...]`` (each ``[I, H]``) -> ``[E, H, 2 I]``: per expert ``[gate | up]``."""
    return np.stack([np.concatenate(ts[e:e + 2], axis=0).T for e in range(0, len(ts), 2)])


def _stack_transposed(ts: list[np.ndarray]) -> np.ndarray:
    """``[down_0, down_1, ...]`` (each ``[H, I]``) -> ``[E, I, H]``."""
    return np.stack([t.T for t in ts])


def moe_rules(cfg: QwenConfig, n: int, quant: Fp8Config | None = None) -> list[WeightRule]:
    """Layer ``n``'s mixture of experts, from Hugging Face's per-expert tensors (as published:
    ``mlp.gate.weight [E, H]``, ``mlp.experts.<e>.{gate,up,down}_proj.weight``, and in an fp8 checkpoint
    each expert projection's ``weight_scale_inv``; the router is never quantized)."""
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    p = f"model.layers.{n}.mlp."
    gate_up = tuple(src for x in range(e) for src in ((p + f"experts.{x}.gate_proj.weight", (i, h)),
                                                       (p + f"experts.{x}.up_proj.weight", (i, h))))
    down = tuple((p + f"experts.{x}.down_proj.weight", (h, i)) for x in range(e))
    return [WeightRule(("layers", n, "mlp", "gate"), ((p + "gate.weight", (e, h)),), _transpose),
            *linear_rules(("layers", n, "mlp", "experts_gate_up"), gate_up, _stack_gate_up, quant, experts=2),
            *linear_rules(("layers", n, "mlp", "experts_down"), down, _stack_transposed, quant, experts=1)]


def linear_rules(path: tuple[str | int, ...], sources: tuple[tuple[str, tuple[int, int]], ...],
                 combine: Callable[[list[np.ndarray]], np.ndarray], quant: Fp8Config | None,
                 experts: int = 0) -> list[WeightRule]:
    """A projection's rules (``experts``: stacked experts, that many sources each): its weight, and from
    an fp8 checkpoint (block scales) its e4m3 weight as stored and the ``_block_scale`` built from each
    source's ``weight_scale_inv``, expanded to its rows and then combined as the weights are."""
    if quant is None or quant.weight_block_size is None:
        return [WeightRule(path, sources, combine, linear=True, experts=experts)]
    bo, bi = quant.weight_block_size
    scales = tuple((name.removesuffix("weight") + "weight_scale_inv", (-(-out // bo), -(-inp // bi)))
                   for name, (out, inp) in sources)
    return [WeightRule(path, sources, combine, storage="float8_e4m3fn", experts=experts),
            WeightRule(path[:-1] + (path[-1] + BLOCK_SCALE,), scales, combine, storage="float32", block=(bo, bi),
                       scaled=tuple(shape for _, shape in sources), experts=experts)]


def name_table(cfg: QwenConfig, quant: Fp8Config | None = None) -> list[WeightRule]:
    """Every parameter of ``Qwen(cfg, quantization=quant)`` with the Hugging Face tensors (and shapes) it
    comes from (``linear_rules`` for the four projections, ``moe_rules`` for a MoE layer's experts)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.q_size, cfg.kv_size
    rules = [WeightRule(("embed_tokens",), (("model.embed_tokens.weight", (cfg.vocab_size, h)),), _same),
             WeightRule(("norm", "weight"), (("model.norm.weight", (h,)),), _same)]
    if not cfg.tie_word_embeddings:
        rules.append(WeightRule(("lm_head",), (("lm_head.weight", (cfg.vocab_size, h)),), _transpose))
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        rules += [
            WeightRule(("layers", n, "input_layernorm", "weight"), ((p + "input_layernorm.weight", (h,)),), _same),
            WeightRule(("layers", n, "post_attention_layernorm", "weight"),
                       ((p + "post_attention_layernorm.weight", (h,)),), _same),
            *linear_rules(("layers", n, "attn", "qkv_proj"),
                          ((a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h)),
                           (a + "v_proj.weight", (kv, h))), _concat_rows_then_transpose, quant),
            *linear_rules(("layers", n, "attn", "o_proj"), ((a + "o_proj.weight", (h, q)),), _transpose, quant),
        ]
        if cfg.is_moe_layer(n):
            rules += moe_rules(cfg, n, quant)
        else:
            rules += [
                *linear_rules(("layers", n, "mlp", "gate_up_proj"),
                              ((p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h))),
                              _concat_rows_then_transpose, quant),
                *linear_rules(("layers", n, "mlp", "down_proj"), ((p + "mlp.down_proj.weight", (h, i)),),
                              _transpose, quant)]
        if cfg.attention_bias:
            rules.append(WeightRule(("layers", n, "attn", "qkv_bias"),
                                    ((a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)), (a + "v_proj.bias", (kv,))),
                                    _concat))
        if cfg.qk_norm:
            rules += [WeightRule(("layers", n, "attn", "q_norm", "weight"), ((a + "q_norm.weight", (d,)),), _same),
                      WeightRule(("layers", n, "attn", "k_norm", "weight"), ((a + "k_norm.weight", (d,)),), _same)]
    return rules


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: those named by the index file, or every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' of tensor -> file): "
                                  f"{type(err).__name__}: {err}") from None
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names weight files that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(path)!r} has no *.safetensors weight files")
    return files


def read_hf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint folder, memory-mapped, keyed by Hugging Face name."""
    tensors: dict[str, np.ndarray] = {}
    for f in safetensors_files(Path(path)):
        tensors.update(read_safetensors(f))
    return tensors


def warn_non_finite(name: str, array: np.ndarray) -> None:
    """Warns (once per tensor) if a weight holds NaN or infinity: outputs would be garbage."""
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        bad = int(np.size(array) - np.isfinite(array).sum())
        warnings.warn(f"checkpoint tensor {name!r} has {bad} NaN/inf values: outputs will be garbage",
                      RuntimeWarning, stacklevel=3)


def abstract_model(cfg: QwenConfig, dtype: str, quant: Fp8Config | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and shape-only state of ``Qwen(cfg, dtype, quantization=quant)``, without
    allocating weights."""
    model = nnx.eval_shape(lambda: Qwen(cfg, dtype, rngs=nnx.Rngs(0), quantization=quant))
    return nnx.split(model)


def checked_tensor(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``tensors[name]``, or a ``CheckpointError`` naming it if it is missing or not ``shape``."""
    if name not in tensors:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
    if tuple(tensors[name].shape) != shape:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape} "
                              "from config.json")
    return tensors[name]


def convert_tensors(cfg: QwenConfig, tensors: dict[str, np.ndarray], dtype: str,
                    quant: Fp8Config | None = None) -> nnx.State:
    """Builds our state from HF tensors, checking every name and shape; arrays land on the default device.
    ``quant``: fp8 linear weights, as the checkpoint stores them (block scales) or quantized here, one
    projection at a time (per output channel), so a whole unquantized model is never on the device."""
    dtype = canonical_dtype(dtype)
    _, state = abstract_model(cfg, dtype, quant)
    pure = nnx.to_pure_dict(state)
    for rule in name_table(cfg, quant):
        parts = []
        for i, (name, _) in enumerate(rule.sources):
            part = np.asarray(rule.read(tensors, i)).astype(rule.read_dtype(dtype, quant))
            warn_non_finite(name, part)
            parts.append(part)
        node = pure
        for key in rule.path[:-1]:
            node = node[key]
        expected = node[rule.path[-1]].shape
        value = rule.combine(parts)
        assert value.shape == expected, (rule.path, value.shape, expected)
        if rule.linear and quant is not None:
            node[rule.path[-1]], node[rule.path[-1] + SCALE] = quantizer(None)(jnp.asarray(value))
        else:
            node[rule.path[-1]] = jnp.asarray(value)
    nnx.replace_by_pure_dict(state, pure)
    return state


def load_hf_checkpoint(path: str | Path, dtype: str | None = None,
                       quant: Fp8Config | None = None) -> tuple[QwenConfig, nnx.GraphDef, nnx.State]:
    """Reads a Hugging Face Qwen folder (sharded safetensors too): ``(config, graphdef, state)`` in ``dtype`` (default: the checkpoint's)."""
    cfg = QwenConfig.from_pretrained(path)
    dtype = canonical_dtype(dtype or cfg.dtype)
    state = convert_tensors(cfg, read_hf_tensors(path), dtype, quant)
    graphdef, _ = abstract_model(cfg, dtype, quant)
    return cfg, graphdef, state
