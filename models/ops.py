"""Model-op selection: which kernels the model's matmuls, norms and RoPE run on this device (attention:
``attention_backends.py``).

:func:`get_model_ops` gives the model its ops: XLA's on a CPU, the decode-path kernels on a GPU, and
fixed-tile Pallas kernels with ``batch_invariant`` (docs/NUMERICS.md). K/V are written by one XLA scatter
(:func:`jaxpaged.kernels.kv_write.write_kv`, in place in the donated pool), except on a GPU, where the
fused qkv epilogue kernel writes them in place itself.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import warnings

import jax

from jaxpaged.kernels import add_rms_norm, gemv, grouped_matmul, matmul, qkv_epilogue, rms_norm
from jaxpaged.kernels.kv_write import triton_addressable, write_kv
from jaxpaged.models.quantization import Fp8Weight, accepting_fp8, fp8_grouped_matmul
from jaxpaged.models.qwen import DEFAULT_OPS, ModelOps, qkv_epilogue_ops, rope_cos_sin, rotary, xla_matmul_unfused_input


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


log = logging.getLogger(__name__)
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


@functools.cache
def prepare_triton_lowering() -> None:
    """Once per process, on a GPU, before the first Pallas-Triton lowering:

    * jax warns at every Pallas-Triton lowering (a step lowers several kernels) that the backend is
      deprecated. The warning is for jaxpaged, not its users: it is silenced here (that message only)
      and said once, as a log line with what it means for them.
    * MLIR's Python bindings look for each dialect's Python module under a few package prefixes, and
      remember only the ones they find. jaxlib's Triton dialect (namespace ``tt``) lives at
      ``jaxlib.triton.dialect``, outside those prefixes, so every Triton op the lowering touches would
      cost five failed imports. The module is made findable under the first prefix, so the lookup
      succeeds once.
    """
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
    log.info("GPU kernels: Pallas lowered by Triton, which jax deprecated in 0.11; jaxpaged pins jax < 0.13, "
             "where it works, and attention_backend='mosaic' runs attention on Mosaic GPU (Hopper)")
    try:
        from jax._src.lib import triton
    except ImportError:  # a jaxlib without the Triton dialect: its lowering fails with jax's own error
        return
    sys.modules.setdefault("jaxlib.mlir.dialects.tt", triton.dialect)


def gemv_reads(x: jax.Array, w, transpose_w: bool = False) -> bool:
    """Whether the Pallas GEMV computes ``x @ w`` (``gemv.supported``). An fp8 weight (:class:`Fp8Weight`)
    goes to XLA's GEMM, whose operand fusion reads the e4m3 bytes and converts them as it loads (a GEMV
    reading e4m3 itself was slower: docs/DECISIONS.md, "fp8 weights")."""
    return not isinstance(w, Fp8Weight) and gemv.supported(x, w, transpose_w)


def fp8_tiled_or_grouped(x: jax.Array, w, group_sizes: jax.Array, *, interpret: bool = False,
                         by_rows: bool = False, out_dtype=None) -> jax.Array:
    """``ops.grouped_matmul`` on a GPU and with ``batch_invariant``: the fixed-tile kernel
    (``grouped_matmul.grouped_matmul_fixed_tile``) for experts in the model dtype; fp8 experts
    (:class:`Fp8Weight`) read as e4m3 by the same kernel, which reads only the experts the rows meet, at
    a byte a weight, where their shapes allow (``grouped_matmul.fp8_supported``); else converted whole in
    front of it (``quantization.fp8_grouped_matmul``). ``by_rows``: the kernel's tile chosen by the row
    count (``grouped_matmul.tile_config``: the decode tile for a decode step's few rows an expert), off
    with ``batch_invariant``; ``interpret``: Pallas interpret mode (CPU)."""
    grouped = functools.partial(grouped_matmul.grouped_matmul_fixed_tile, by_rows=by_rows, interpret=interpret)
    if not isinstance(w, Fp8Weight):
        return grouped(x, w, group_sizes, out_dtype=out_dtype)
    if grouped_matmul.fp8_supported(x, w.weight, w.scale, by_rows=by_rows):
        return grouped(x, w.weight, group_sizes, w.scale, out_dtype=out_dtype)
    return fp8_grouped_matmul(x, w, group_sizes, grouped_matmul=grouped, out_dtype=out_dtype)


def gemv_or_xla_matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None,
                       interpret: bool = False, xla_matmul=xla_matmul_unfused_input) -> jax.Array:
    """``x @ w`` by the Pallas GEMV when it supports the operands (``gemv.supported``: at most 32 rows,
    bf16/fp16), else by XLA. Chosen at trace time from static shapes: each compiled step has one path."""
    if gemv_reads(x, w, transpose_w):
        return gemv.gemv(x, w, transpose_w=transpose_w, out_dtype=out_dtype, interpret=interpret)
    return xla_matmul(x, w, transpose_w=transpose_w, out_dtype=out_dtype)


def matmul_parts(x: jax.Array, w: jax.Array, *, interpret: bool = False,
                 xla_matmul=xla_matmul_unfused_input) -> jax.Array:
    """``ModelOps.matmul_parts``: the GEMV's split-K partials ``f32[S, M, N]`` when it supports the
    operands, else XLA's product as ``[1, M, N]``."""
    if gemv_reads(x, w):
        return gemv.gemv_partials(x, w, interpret=interpret)
    return xla_matmul(x, w)[None]


def silu_mul_matmul_parts(gate_up: jax.Array, w: jax.Array, *, interpret: bool = False,
                          xla_matmul=xla_matmul_unfused_input) -> jax.Array:
    """``ModelOps.silu_mul_matmul_parts``: ``silu(gate) * up @ w`` from the gate/up product's partials
    ``[P, M, 2I]``: the partials' sum and the activation in one XLA fusion, then :func:`matmul_parts` (a
    GEMV that formed the activation itself, per depth tile, was slower: docs/DECISIONS.md)."""
    gate, up = jax.numpy.split(gemv.sum_partials(gate_up, w.dtype), 2, axis=-1)
    return matmul_parts(jax.nn.silu(gate) * up, w, interpret=interpret, xla_matmul=xla_matmul)


def fused_add_rms_norm(parts: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, *,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``ModelOps.add_rms_norm``: the residual add and RMSNorm kernel (:mod:`kernels.add_rms_norm`) when
    the product comes as the GEMV's split-K partials (``P > 1``). A finished product (``P = 1``: XLA's
    GEMM, or a GEMV of one split) keeps XLA's ops: XLA fuses its GEMM's own split-K reduction into the
    residual add, which the kernel would split off again; a float32 model keeps XLA's ops too (the
    numerics its guarantees were checked with)."""
    if parts.shape[0] == 1 or residual.dtype == jax.numpy.float32:
        return add_rms_norm.add_rms_norm_ops(parts, residual, weight, eps, DEFAULT_OPS.rms_norm)
    return add_rms_norm.add_rms_norm(parts, residual, weight, eps, interpret=interpret)


def fused_qkv(x: jax.Array, w: jax.Array, bias, q_norm, k_norm, positions: jax.Array, kv_pool: jax.Array,
              layer: int, slot_mapping: jax.Array, *, eps: float, theta: float,
              interpret: bool = False, xla_matmul=xla_matmul_unfused_input) -> tuple[jax.Array, jax.Array]:
    """The model's ``ModelOps.qkv_epilogue``: the qkv projection (the GEMV's unsummed partials when it
    applies, else XLA's product), then :func:`qkv_epilogue.qkv_epilogue` (bias, q/k
    norm, RoPE, KV write in one kernel). ``x [T, H]`` -> ``(q [T, Hq, D], kv_pool)``."""
    head_dim = kv_pool.shape[-1]
    # Not a Triton tile, or a pool the Triton kernel cannot address (kv_write.pallas_addressable): XLA's
    # ops for this stretch, whose scatter addresses any pool.
    if head_dim & (head_dim - 1) or not triton_addressable(kv_pool):
        return qkv_epilogue_ops(xla_matmul(x, w), bias, q_norm, k_norm, positions, kv_pool, layer, slot_mapping,
                                eps=eps, theta=theta, ops=DEFAULT_OPS, write_kv_fn=write_kv)
    if gemv_reads(x, w):
        parts = gemv.gemv_partials(x, w, interpret=interpret)
    else:
        parts = xla_matmul(x, w)[None]
    # The same cos/sin in every layer of a step: XLA computes them once (common-subexpression elimination).
    cos, sin = rope_cos_sin(positions, head_dim, theta, x.dtype)
    return qkv_epilogue.qkv_epilogue(parts, bias, q_norm, k_norm, cos, sin, kv_pool, layer, slot_mapping,
                                     eps=eps, dtype=x.dtype, interpret=interpret)


@functools.cache
def get_model_ops(batch_invariant: bool = False) -> ModelOps:
    """The model's row-wise ops for this process's device.

    ``batch_invariant``: the fixed-tile Pallas matmul, grouped matmul (a MoE layer's experts) and row-kernel
    RMSNorm whose per-row results never depend on the number of rows (interpret mode off the GPU). Otherwise on a CPU XLA's ops
    (``x @ w``, IEEE fp32 for float32 weights), and on a GPU the decode-path kernels (docs/DECISIONS.md
    gives the measurement behind each): matmuls of at most 32 rows with 16-bit weights by the split-K Pallas GEMV, the
    stretch from the qkv projection to the KV write as one kernel, the residual add and RMSNorm summing
    the GEMV's partials in one kernel, and XLA's GEMMs with an optimisation barrier on their input (a
    producer fused into the GEMM made it slower at decode sizes); a MoE layer's experts by the fixed-tile
    grouped kernel at every step size, its tile chosen by the row count, e4m3 experts read as they are
    (XLA's ``ragged_dot`` reads every expert whatever the rows meet, and ran out of memory at 2,048
    tokens of Qwen3-30B-A3B)."""
    if _on_gpu():
        prepare_triton_lowering()
    if batch_invariant:
        interpret = not _on_gpu()
        return ModelOps(matmul=accepting_fp8(functools.partial(matmul.matmul, interpret=interpret)),
                        rms_norm=functools.partial(rms_norm.rms_norm, interpret=interpret),
                        rotary=functools.partial(rotary, separate_products=True),
                        grouped_matmul=functools.partial(fp8_tiled_or_grouped, interpret=interpret))
    if not _on_gpu():
        return DEFAULT_OPS
    base = xla_matmul_unfused_input
    return dataclasses.replace(
        DEFAULT_OPS, matmul=functools.partial(gemv_or_xla_matmul, xla_matmul=base),
        qkv_epilogue=functools.partial(fused_qkv, xla_matmul=base),
        matmul_parts=functools.partial(matmul_parts, xla_matmul=base),
        silu_mul_matmul_parts=functools.partial(silu_mul_matmul_parts, xla_matmul=base),
        add_rms_norm=fused_add_rms_norm,
        grouped_matmul=functools.partial(fp8_tiled_or_grouped, by_rows=True))
