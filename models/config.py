"""QwenConfig: the architecture numbers of a Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE checkpoint, read from config.json.

Qwen2 and Qwen2.5 share ``model_type == "qwen2"`` (q/k/v projections with bias, ``head_dim`` derived
from the hidden size); Qwen3 is ``"qwen3"`` (no q/k/v bias by default, per-head RMSNorm on q and k,
an explicit ``head_dim``); Qwen3-MoE is ``"qwen3_moe"`` (Qwen3's attention; the MLP of most layers a
mixture of experts: ``num_experts``, ``num_experts_per_tok`` of them per token, each of
``moe_intermediate_size``; the layers in ``mlp_only_layers`` or not on ``decoder_sparse_step`` keep a dense
MLP of ``intermediate_size``). Anything else is refused with an error that says what was found.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


class CheckpointError(ValueError):
    """A checkpoint folder or its contents cannot be used; the message says what and where."""


_REQUIRED_INT = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_INT = ("num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
_UNSUPPORTED = ("model_type {!r} is not supported: jaxpaged runs Qwen2, Qwen2.5 (model_type 'qwen2'), Qwen3 "
                "('qwen3') and Qwen3-MoE ('qwen3_moe')")


def canonical_dtype(dtype: Any) -> str:
    """Maps user spellings (``"bf16"``, ``jnp.bfloat16``, ...) to ``bfloat16`` / ``float16`` / ``float32``."""
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    name = name.replace("torch.", "").replace("jnp.", "").lower()
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: use one of bfloat16, float16, float32")
    return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """Architecture of one Qwen decoder (names follow Hugging Face's config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = True  # q/k/v bias (Qwen2 always; Qwen3 only if attention_bias is set)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    eos_token_id: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # the checkpoint's storage dtype
    # Qwen3-MoE (all zero / empty for the dense families): Hugging Face's names and meanings.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to one
    decoder_sparse_step: int = 1  # layer i is a MoE layer when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # The experts are split over this many devices (expert parallelism: ``sharding.shard_config``); one
    # shard's model holds ``num_experts / expert_shards`` of them and routes over all ``num_experts``.
    expert_shards: int = 1

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(_UNSUPPORTED.format(self.model_type))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.model_type == "qwen3_moe":
            self._check_moe()

    def _check_moe(self) -> None:
        """A Qwen3-MoE config's expert fields, each bounded (the field named when it is not)."""
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                     "expert_shards"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise CheckpointError(f"config field num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                                  f"num_experts ({self.num_experts})")
        if self.num_experts % self.expert_shards:
            raise CheckpointError(f"num_experts ({self.num_experts}) is not a multiple of the {self.expert_shards} "
                                  "devices the experts are split over")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise CheckpointError(f"config field mlp_only_layers lists layers {bad} outside "
                                  f"0..{self.num_hidden_layers - 1}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` has the mixture of experts (Hugging Face's rule) or a dense MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_local_experts(self) -> int:
        """The experts one device holds (all of them without expert parallelism)."""
        return self.num_experts // self.expert_shards

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "QwenConfig":
        """Builds the config from a parsed config.json, refusing what jaxpaged cannot run.

        Missing or mistyped fields are a ``CheckpointError`` naming ``source`` and the field."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        for key in _REQUIRED_INT:
            if key not in raw:
                raise CheckpointError(f"{source}: required field {key!r} is missing")
        for key in _REQUIRED_INT + _OPTIONAL_INT:
            if key in raw and raw[key] is not None and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
                raise CheckpointError(f"{source}: field {key!r} must be an integer, got {raw[key]!r}")
        for key in ("rms_norm_eps", "rope_theta"):
            if key in raw and (not isinstance(raw[key], (int, float)) or isinstance(raw[key], bool)):
                raise CheckpointError(f"{source}: field {key!r} must be a number, got {raw[key]!r}")
        eos = raw.get("eos_token_id")
        if eos is not None and not (isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(e, int) for e in eos))):
            raise CheckpointError(f"{source}: field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
        try:
            return cls._from_dict(raw)
        except CheckpointError as err:
            raise CheckpointError(f"{source}: {err}") from None

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> "QwenConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(_UNSUPPORTED.format(model_type))
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"field 'rope_scaling' must be an object or null, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise CheckpointError(
                f"rope scaling {rope_type!r} is not supported (only plain RoPE); config has {rope}")
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        if raw.get("use_sliding_window", False):
            raise CheckpointError("use_sliding_window=true is not supported (sliding-window attention)")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        try:
            dtype = canonical_dtype(dtype)
        except ValueError:
            raise CheckpointError(f"field 'torch_dtype' / 'dtype' is {dtype!r}: use bfloat16, float16 or float32") from None
        if model_type == "qwen2":
            attention_bias, qk_norm = True, False
        else:
            attention_bias, qk_norm = bool(raw.get("attention_bias", False)), True
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            eos_token_id=eos_ids,
            dtype=dtype,
            **(_moe_fields(raw) if model_type == "qwen3_moe" else {}),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "QwenConfig":
        """Reads ``config.json`` from a Hugging Face checkpoint folder."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist or is not a folder")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{str(path)!r} has no config.json: not a Hugging Face checkpoint folder")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{cfg_file} is not valid JSON: {err}") from err
        return cls.from_dict(raw, str(cfg_file))


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config.json's expert fields (``num_experts``, or ``num_local_experts`` as transformers 5
    writes it), type-checked; their bounds are checked by ``QwenConfig``."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", raw.get("num_experts_per_tok")),
                       ("moe_intermediate_size", raw.get("moe_intermediate_size"))):
        if value is None:
            raise CheckpointError(f"required field {key!r} is missing (model_type 'qwen3_moe')")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise CheckpointError(f"field 'norm_topk_prob' must be true or false, got {norm!r}")
    only = raw.get("mlp_only_layers") or []
    if not (isinstance(only, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in only)):
        raise CheckpointError(f"field 'mlp_only_layers' must be a list of layer indices, got {only!r:.100}")
    return dict(num_experts=experts, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=norm,
                decoder_sparse_step=1 if raw.get("decoder_sparse_step") is None else raw["decoder_sparse_step"],
                mlp_only_layers=tuple(sorted(set(only))))
