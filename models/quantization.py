"""fp8 weights (``quantization="fp8"``, vLLM's name): how the linear layers' weights are stored and multiplied.

Two ways in, one container on the device:
  * a bf16/f32 checkpoint quantized at load: e4m3 weights with one scale per output channel,
    ``scale = amax / 448`` over the channel's column (``quantize_per_channel``);
  * an fp8 checkpoint in Qwen's published format (``quantization_config`` with ``quant_method: fp8``,
    ``weight_block_size: [128, 128]``): e4m3 weights and ``weight_scale_inv [ceil(out/128),
    ceil(in/128)]`` per linear layer, loaded as they are, the block scales honoured
    (``expand_block_scale``).

The four projections (``LINEAR_NAMES``) keep their ``[in, out]`` fp8 weight under their own name and
their scale beside it: ``<name>_scale f32[N]`` (per output channel) or ``<name>_block_scale f32[K / g,
N]`` (one per ``g`` rows of each column, ``g = gcd(block_in, K)``: the checkpoint's blocks expanded along
the output, so fused q/k/v or gate/up and column splits are concatenations and slices of columns, as
the weights are). Different names for the two layouts: tensor parallelism splits them differently
(``models/sharding.py``) and a compiled step is specific to them. A Qwen3-MoE layer's stacked experts
(``EXPERT_NAMES``, ``[E, in, out]``) are stored alike, one scale array per expert stacked in front
(``f32[E, N]`` or ``f32[E, K / g, N]``), and multiplied by :func:`fp8_grouped_matmul`. Embeddings, the
LM head, norms, biases and a MoE layer's router stay in the model's dtype (as vLLM).

The model hands its ops an :class:`Fp8Weight` (``linear_weight``) where it would hand a matrix; the ops
multiply it by :func:`fp8_matmul` around whichever array matmul they use. That is the point where an fp8
tensor-core GEMM or an fp8-reading GEMV takes over on a GPU, without the model changing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.config import QUANTIZATIONS

from .config import CheckpointError

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EXPERT_NAMES = ("experts_gate_up", "experts_down")  # [E, in, out]: a MoE layer's stacked experts
SCALE, BLOCK_SCALE = "_scale", "_block_scale"  # suffixes of a linear weight's scale parameter


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """How a model's linear weights are stored: e4m3 with one scale per output channel
    (``weight_block_size=None``: quantized at load), or per ``(out, in)`` block of the checkpoint."""

    weight_block_size: tuple[int, int] | None = None

    @property
    def scale_suffix(self) -> str:
        return SCALE if self.weight_block_size is None else BLOCK_SCALE

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale parameter's shape for a weight ``[K, N]`` (or stacked experts' ``[E, K, N]``)."""
        *lead, k, n = shape
        if self.weight_block_size is None:
            return (*lead, n)
        return (*lead, k // math.gcd(self.weight_block_size[1], k), n)


def from_quantization_config(raw: Any, source: str = "config.json") -> Fp8Config | None:
    """The :class:`Fp8Config` of a checkpoint's ``quantization_config`` (None: not quantized). Only Qwen's
    block-wise e4m3 format is read; any other method or layout is a ``CheckpointError`` that says so."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: quantization_config must be an object, got {raw!r:.100}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{source}: quantization method {method!r} is not supported (only 'fp8': Qwen's "
                              "FP8 checkpoints, or quantization='fp8' on a bf16 checkpoint)")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{source}: fp8 format {raw.get('fmt')!r} is not supported (only e4m3)")
    block = raw.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{source}: fp8 checkpoints need block-wise weight scales (weight_block_size "
                              f"[out, in], e.g. [128, 128]); got {block!r}")
    return Fp8Config(weight_block_size=(block[0], block[1]))


def checkpoint_quantization(path: str | Path) -> Fp8Config | None:
    """The quantization a checkpoint folder's ``config.json`` declares (None: a bf16/f32 checkpoint)."""
    cfg_file = Path(path) / "config.json"
    return from_quantization_config(json.loads(cfg_file.read_text()).get("quantization_config"), str(cfg_file))


def resolve_quantization(quantization: str | None, checkpoint: Fp8Config | None) -> Fp8Config | None:
    """What a load makes of ``quantization`` (the user's setting) and what the checkpoint holds: None keeps
    the checkpoint's; ``"fp8"`` on a bf16/f32 checkpoint quantizes it at load per output channel."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    if checkpoint is not None or quantization is None:
        return checkpoint
    return Fp8Config()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A linear weight ``[K, N]`` stored as e4m3 with scales; ``dtype`` is the model's (the product's).

    ``weight f8e4m3[K, N]``; ``scale f32[N]`` (per output channel) or ``f32[K / g, N]`` (rows
    ``[i g, (i + 1) g)`` of column ``n`` scaled by ``scale[i, n]``). The real value is ``weight * scale``.
    Stacked experts: ``weight [E, K, N]`` with ``scale [E, N]`` or ``[E, K / g, N]``, one of each per expert."""

    weight: jax.Array
    scale: jax.Array
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape


def init_linear(module: Any, name: str, rngs: Any, shape: tuple[int, ...], dtype, quant: Fp8Config | None) -> None:
    """A random linear weight ``[in, out]`` (or stacked experts' ``[E, in, out]``) as ``module.<name>``
    (normal * 0.02): in ``dtype``, or (``quant``) e4m3 with its scale beside it (block scales start equal
    along each column)."""
    w = jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02
    if quant is None:
        setattr(module, name, nnx.Param(w.astype(dtype)))
        return
    weight, scale = quantize_per_channel(w)
    if quant.weight_block_size is not None:
        scale = jnp.expand_dims(scale, -2)
    setattr(module, name, nnx.Param(weight))
    setattr(module, name + quant.scale_suffix, nnx.Param(jnp.broadcast_to(scale, quant.scale_shape(shape))))


def linear_weight(module: Any, name: str, dtype) -> jax.Array | Fp8Weight:
    """The matrix the model multiplies by: ``module.<name>`` as it is, or with its scale as an
    :class:`Fp8Weight` of ``dtype`` when it is stored in fp8."""
    w = getattr(module, name)[...]
    if w.dtype != FP8:
        return w
    scale = getattr(module, name + SCALE, None)
    if scale is None:
        scale = getattr(module, name + BLOCK_SCALE)
    return Fp8Weight(w, scale[...], jnp.dtype(dtype))


def quantize_per_channel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w [K, N]`` -> ``(f8e4m3[K, N], scale f32[N])`` with ``scale = amax / 448`` over each column
    (1 for an all-zero column), rounding to nearest; ``weight * scale`` approximates ``w``. Stacked
    experts ``[E, K, N]``: each expert's columns alike, ``scale f32[E, N]``."""
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(FP8), jnp.squeeze(scale, -2)


@functools.cache
def quantizer(shardings: tuple[Any, Any] | None) -> Callable:
    """``quantize_per_channel`` compiled once per pair of result shardings (None: XLA's choice)."""
    return jax.jit(quantize_per_channel, out_shardings=shardings)


def expand_block_scale(scale_inv: np.ndarray, out_dim: int, in_dim: int, block: tuple[int, int]) -> np.ndarray:
    """A checkpoint's ``weight_scale_inv [ceil(out/bo), ceil(in/bi)]`` (Hugging Face's ``[out, in]`` order)
    -> ``f32[out, in / g]`` with ``g = gcd(bi, in)``: the scale of each output row for each ``g`` input
    columns. Exact for partial blocks (``out`` or ``in`` not a multiple of the block): every ``g``-wide
    run of columns lies inside one block. Transposed like the weight, it is the ``_block_scale`` layout."""
    bo, bi = block
    want = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
                              f"[{out_dim}, {in_dim}] weight in {bo}x{bi} blocks")
    g = math.gcd(bi, in_dim)
    cols = np.arange(in_dim // g) * g // bi
    rows = np.arange(out_dim) // bo
    return np.asarray(scale_inv, np.float32)[rows][:, cols]


def dequantize(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """``w``'s real values ``[K, N]`` (or ``[E, K, N]``; computed in fp32, rounded once to ``dtype``)."""
    wf = w.weight.astype(jnp.float32)
    if w.scale.ndim == w.weight.ndim - 1:  # per output channel
        return (wf * jnp.expand_dims(w.scale, -2)).astype(dtype)
    *lead, k, n = w.shape
    blocks = w.scale.shape[-2]
    per_block = wf.reshape(*lead, blocks, k // blocks, n) * jnp.expand_dims(w.scale, -2)
    return per_block.reshape(w.shape).astype(dtype)


def fp8_matmul(x: jax.Array, w: Fp8Weight, *, matmul: Callable[..., jax.Array], transpose_w: bool = False,
               out_dtype=None) -> jax.Array:
    """``x [M, K] @ w`` by ``matmul`` (an array matmul of the ops: XLA's, the batch-invariant kernel), in
    ``w.dtype``'s operands with fp32 accumulation, returned in ``out_dtype`` (default ``x``'s).

    Per output channel: the e4m3 values (exact in bf16 and fp32) are multiplied as they are and each
    column of the fp32 product is scaled after the dot (exact: the scale is constant along ``K``).
    Block scales vary along ``K``, so the weight is dequantized first (one rounding to ``w.dtype`` per
    element, as a bf16 checkpoint holds it) and multiplied."""
    if transpose_w:
        raise ValueError("fp8 weights are stored [in, out]: transpose_w is for the tied LM head, which stays "
                         "in the model's dtype")
    if w.scale.ndim == 1:
        y = matmul(x, w.weight.astype(w.dtype), out_dtype=jnp.float32) * w.scale
        return y.astype(out_dtype or x.dtype)
    return matmul(x, dequantize(w, w.dtype), out_dtype=out_dtype)


def fp8_grouped_matmul(x: jax.Array, w: Fp8Weight, group_sizes: jax.Array, *, grouped_matmul: Callable[..., jax.Array],
                       out_dtype=None) -> jax.Array:
    """A MoE layer's expert product with fp8 experts: ``x [M, K]`` (rows sorted by expert, ``group_sizes``
    of them per expert) times ``w [E, K, N]`` by ``grouped_matmul`` (the ops' grouped GEMM), in ``w.dtype``'s
    operands with fp32 accumulation, returned in ``out_dtype`` (default ``x``'s).

    As :func:`fp8_matmul` for one matrix: per output channel, the e4m3 experts are multiplied as they are
    and each row of the fp32 product scaled by its expert's column scales (exact); block scales are
    dequantized into the experts first. Rows past the groups (another device's experts) stay zero."""
    if w.scale.ndim == 2:
        y = grouped_matmul(x, w.weight.astype(w.dtype), group_sizes, out_dtype=jnp.float32)
        ends = jnp.cumsum(group_sizes)
        expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right"), w.shape[0] - 1)
        return (y * w.scale[expert]).astype(out_dtype or x.dtype)
    return grouped_matmul(x, dequantize(w, w.dtype), group_sizes, out_dtype=out_dtype)


def accepting_fp8_grouped(grouped_matmul: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A grouped GEMM ``(x, w, group_sizes)`` that also takes fp8 experts (:class:`Fp8Weight`), by
    :func:`fp8_grouped_matmul` around it."""

    def wrapped(x, w, group_sizes, **kwargs):
        if isinstance(w, Fp8Weight):
            return fp8_grouped_matmul(x, w, group_sizes, grouped_matmul=grouped_matmul, **kwargs)
        return grouped_matmul(x, w, group_sizes, **kwargs)

    return wrapped


def accepting_fp8(matmul: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``matmul`` that also takes an :class:`Fp8Weight` (by :func:`fp8_matmul` around it)."""

    def wrapped(x, w, **kwargs):
        if isinstance(w, Fp8Weight):
            return fp8_matmul(x, w, matmul=matmul, **kwargs)
        return matmul(x, w, **kwargs)

    return wrapped


def quantize_linears(pure: dict, place: Callable[[tuple, jax.Array], tuple[Any, Any]] | None = None) -> dict:
    """A model's pure-dict state (``nnx.to_pure_dict``) with every linear weight quantized per output
    channel and its ``_scale`` added beside it. ``place(path, w)``: ``(weight sharding, scale sharding)``
    of the results (tensor parallelism), else where XLA puts them."""
    out = {}
    for key, value in pure.items():
        if isinstance(value, dict):
            out[key] = quantize_linears(value, place and (lambda path, w, key=key: place((key,) + path, w)))
        elif key in LINEAR_NAMES or key in EXPERT_NAMES:
            out[key], out[key + SCALE] = quantizer(None if place is None else place((key,), value))(value)
        else:
            out[key] = value
    return out
