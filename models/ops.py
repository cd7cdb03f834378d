"""Model-op selection: which kernels the model's attention, matmuls and norms run on this device.

``get_attention_fn(backend)`` returns a function with the signature of
:func:`jaxpaged.kernels.paged_attention_reference.paged_attention_reference`::

    fn(q[T, Hq, D], kv_pool[L, N, bs, 2, Hkv, D], layer (int), cu_q_lens i32[S+1], kv_lens i32[S],
       block_tables i32[S, W], *, scale=None) -> [T, Hq, D]

``backend``: ``"triton"`` (the Pallas kernel of :mod:`jaxpaged.kernels.paged_attention`, lowered by Triton:
any CUDA GPU), ``"mosaic"`` (the Pallas kernels of :mod:`jaxpaged.kernels.mosaic`, lowered
by Mosaic GPU: Hopper and later, bf16 and fp8 pools), ``"reference"`` (pure jnp gather, any platform) or
``"auto"`` (an engine's :func:`choose_attention_backend`: mosaic over fp8 pools on Hopper, triton on other
GPU engines, reference elsewhere; docs/DECISIONS.md has the measurements behind it). Off
the GPU the Pallas kernels run in interpret mode, slowly, which is only useful in tests.

K/V are written by one XLA scatter (:func:`jaxpaged.kernels.kv_write.write_kv`, in place in the
donated pool), except on a GPU, where the fused qkv epilogue kernel writes them in place itself.

:func:`get_model_ops` gives the model its matmuls, norms and RoPE: XLA's on a CPU, the decode-path
kernels on a GPU, and fixed-tile Pallas kernels with ``batch_invariant`` (docs/NUMERICS.md), whose
attention also runs one fixed launch configuration for every step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import warnings
from typing import Callable

import jax

from jaxpaged.kernels import add_rms_norm, gemv, matmul, paged_attention, paged_attention_reference, qkv_epilogue, rms_norm
from jaxpaged.kernels.fp8 import is_fp8
from jaxpaged.kernels.kv_write import write_kv
from jaxpaged.models.qwen import (DEFAULT_OPS, ModelOps, qkv_epilogue_ops, rope_cos_sin, rotary, xla_matmul,
                                  xla_matmul_unfused_input)

from jaxpaged.config import ATTENTION_BACKENDS as BACKENDS


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
      ``jaxlib.triton.dialect``, outside those prefixes, so every Triton op the lowering touched cost
      five failed imports: 1,022 each while lowering two step shapes on the H200 (1.4 of 7.3 s of
      lowering eight shapes under cProfile; in a whole cold warm-up the gain is within run-to-run
      noise). The module is made findable under the first prefix, so the lookup succeeds once.
    """
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
    log.info("GPU kernels: Pallas lowered by Triton, which jax deprecated in 0.11; jaxpaged pins jax < 0.13, "
             "where it works, and attention_backend='mosaic' runs attention on Mosaic GPU (Hopper)")
    try:
        from jax._src.lib import triton
    except ImportError:  # a jaxlib without the Triton dialect: its lowering fails with jax's own error
        return
    sys.modules.setdefault("jaxlib.mlir.dialects.tt", triton.dialect)


def resolve_backend(backend: str) -> str:
    """Maps ``"auto"`` to ``"triton"`` on GPU and ``"reference"`` elsewhere; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if _on_gpu() else "reference"
    return backend


def choose_attention_backend(backend: str, kv_dtype, batch_invariant: bool, head_dim: int, block_size: int,
                             act_dtype=None, tensor_parallel_size: int = 1) -> str:
    """The backend an engine runs: ``backend`` itself after :func:`check_attention_backend`, or for
    ``"auto"`` the fastest measured for this engine: ``"mosaic"`` over an fp8 pool on Hopper where
    that kernel reads it (its fp8 decode kernel put nano-vllm's workload at 1.16x the Triton
    kernel's throughput, H200, docs/DECISIONS.md; on one device: it has not been measured sharded),
    otherwise :func:`resolve_backend`'s choice."""
    check_attention_backend(backend, kv_dtype, batch_invariant, head_dim, block_size, act_dtype)
    if backend == "auto" and _on_gpu() and is_fp8(kv_dtype) and not batch_invariant and tensor_parallel_size == 1:
        try:
            check_attention_backend("mosaic", kv_dtype, batch_invariant, head_dim, block_size, act_dtype)
        except ValueError:  # not Hopper, or a pool or model this kernel does not read
            return resolve_backend(backend)
        return "mosaic"
    return resolve_backend(backend)


def check_attention_backend(backend: str, kv_dtype, batch_invariant: bool, head_dim: int, block_size: int,
                            act_dtype=None) -> None:
    """Raises ValueError, naming ``attention_backend``, where ``backend`` cannot run this engine: the
    Mosaic GPU kernel needs compute capability 9.0+ (wgmma, TMA) and the pool dtypes, head dims and
    block sizes :mod:`jaxpaged.kernels.mosaic` reads (an fp8 pool: blocks of at least 64
    slots, one a KV tile, and bf16 activations ``act_dtype``), and is not the batch-invariant
    configuration (that guarantee is verified on the Triton kernel only)."""
    if resolve_backend(backend) != "mosaic":
        return
    from jaxpaged.kernels.mosaic import common as mgpu  # imports Mosaic GPU: only when asked for

    if head_dim not in mgpu.HEAD_DIMS or block_size not in mgpu.BLOCK_SIZES:
        raise ValueError(f"attention_backend='mosaic' reads head_dim {mgpu.HEAD_DIMS} and block_size "
                         f"{mgpu.BLOCK_SIZES}, this engine has head_dim {head_dim}, block_size {block_size}: use 'triton'")
    if batch_invariant:
        raise ValueError("attention_backend='mosaic' does not run with batch_invariant=True: the bitwise "
                         "guarantee is verified on the Triton kernel only (use attention_backend='triton')")
    if _on_gpu():
        cc = getattr(jax.devices()[0], "compute_capability", "0")
        if float(cc) < 9.0:
            raise ValueError(f"attention_backend='mosaic' needs a GPU of compute capability 9.0+ (Hopper); "
                             f"this one is {cc}: use 'triton'")
    if is_fp8(kv_dtype):
        if block_size < mgpu.MIN_KV_TILE:
            raise ValueError(f"attention_backend='mosaic' reads an fp8 pool one block a KV tile: block_size must be "
                             f">= {mgpu.MIN_KV_TILE} (the fp8 default), this engine has {block_size}")
        if act_dtype is not None and jax.numpy.dtype(act_dtype) != jax.numpy.dtype(jax.numpy.bfloat16):
            raise ValueError(f"attention_backend='mosaic' reads an fp8 pool with bfloat16 activations, this model's "
                             f"are {jax.numpy.dtype(act_dtype).name}: use 'triton'")
        return
    ok = mgpu.pool_dtypes(interpret=not _on_gpu())
    if jax.numpy.dtype(kv_dtype) not in ok:
        raise ValueError(f"attention_backend='mosaic' reads {'/'.join(d.name for d in ok)} KV pools here, not "
                         f"{jax.numpy.dtype(kv_dtype).name}: use 'triton' for this kv_cache_dtype")


@functools.cache
def get_attention_fn(backend: str = "auto", batch_invariant: bool = False) -> Callable[..., jax.Array]:
    """Returns the ragged paged-attention function of ``backend`` (reference signature).

    ``batch_invariant``: Pallas uses its one fixed launch configuration for every step. The jnp
    reference has no such mode: its batched dots and reductions follow XLA's shape-dependent code
    paths (measured on the CPU: a token's logits change with the step's token count), so the
    guarantee holds on the Pallas backend only (interpret mode off the GPU).
    """
    backend = resolve_backend(backend)
    if backend == "reference":
        return paged_attention_reference.paged_attention_reference
    if backend == "mosaic":
        from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu

        return functools.partial(paged_attention_mgpu, interpret=not _on_gpu())
    if _on_gpu():
        prepare_triton_lowering()
    return functools.partial(paged_attention.paged_attention, interpret=not _on_gpu(),
                             batch_invariant=batch_invariant)


def gemv_or_xla_matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None,
                       interpret: bool = False, xla_matmul=xla_matmul_unfused_input) -> jax.Array:
    """``x @ w`` by the Pallas GEMV when it supports the operands (``gemv.supported``: at most 32 rows,
    bf16/fp16), else by XLA. Chosen at trace time from static shapes: each compiled step has one path."""
    if gemv.supported(x, w, transpose_w):
        return gemv.gemv(x, w, transpose_w=transpose_w, out_dtype=out_dtype, interpret=interpret)
    return xla_matmul(x, w, transpose_w=transpose_w, out_dtype=out_dtype)


def matmul_parts(x: jax.Array, w: jax.Array, *, interpret: bool = False,
                 xla_matmul=xla_matmul_unfused_input) -> jax.Array:
    """``ModelOps.matmul_parts``: the GEMV's split-K partials ``f32[S, M, N]`` when it supports the
    operands, else XLA's product as ``[1, M, N]``."""
    if gemv.supported(x, w):
        return gemv.gemv_partials(x, w, interpret=interpret)
    return xla_matmul(x, w)[None]


def silu_mul_matmul_parts(gate_up: jax.Array, w: jax.Array, *, interpret: bool = False,
                          xla_matmul=xla_matmul_unfused_input) -> jax.Array:
    """``ModelOps.silu_mul_matmul_parts``: ``silu(gate) * up @ w`` from the gate/up product's partials
    ``[P, M, 2I]``: the partials' sum and the activation in one XLA fusion, then :func:`matmul_parts`.
    (A GEMV that formed the activation itself, per depth tile, measured 19 us a call instead of ~5.5 us
    for the fusion + GEMV on the H200 at batch 1.)"""
    gate, up = jax.numpy.split(gemv.sum_partials(gate_up, w.dtype), 2, axis=-1)
    return matmul_parts(jax.nn.silu(gate) * up, w, interpret=interpret, xla_matmul=xla_matmul)


def fused_add_rms_norm(parts: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, *,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``ModelOps.add_rms_norm``: the residual add and RMSNorm kernel (:mod:`kernels.add_rms_norm`) when
    the product comes as the GEMV's split-K partials (``P > 1``). A finished product (``P = 1``: XLA's
    GEMM, or a GEMV of one split) keeps XLA's ops: XLA fuses its GEMM's own split-K reduction into the
    residual add, which the kernel would split off again (batch 256 on the H200: +70 us a step;
    measured on the H200); a float32 model keeps XLA's ops too (the numerics its guarantees were
    checked with)."""
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
    if head_dim & (head_dim - 1):  # not a Triton tile: the model's XLA ops for this stretch
        return qkv_epilogue_ops(xla_matmul(x, w), bias, q_norm, k_norm, positions, kv_pool, layer, slot_mapping,
                                eps=eps, theta=theta, ops=DEFAULT_OPS, write_kv_fn=write_kv)
    if gemv.supported(x, w):
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

    ``batch_invariant``: the fixed-tile Pallas matmul and row-kernel RMSNorm whose per-row results never
    depend on the number of rows (interpret mode off the GPU). Otherwise on a CPU XLA's ops
    (``x @ w``, IEEE fp32 for float32 weights), and on a GPU the decode-path kernels (each measured
    on the H200, docs/DECISIONS.md): matmuls of at most 32 rows with 16-bit weights by the split-K
    Pallas GEMV, the stretch from the qkv projection to the KV write as one kernel, the residual add
    and RMSNorm summing the GEMV's partials in one kernel, and XLA's GEMMs with an optimisation
    barrier on their input (a producer fused into the GEMM made it ~2x slower at decode sizes)."""
    if _on_gpu():
        prepare_triton_lowering()
    if batch_invariant:
        interpret = not _on_gpu()
        return ModelOps(matmul=functools.partial(matmul.matmul, interpret=interpret),
                        rms_norm=functools.partial(rms_norm.rms_norm, interpret=interpret),
                        rotary=functools.partial(rotary, separate_products=True))
    if not _on_gpu():
        return DEFAULT_OPS
    base = xla_matmul_unfused_input
    return dataclasses.replace(
        DEFAULT_OPS, matmul=functools.partial(gemv_or_xla_matmul, xla_matmul=base),
        qkv_epilogue=functools.partial(fused_qkv, xla_matmul=base),
        matmul_parts=functools.partial(matmul_parts, xla_matmul=base),
        silu_mul_matmul_parts=functools.partial(silu_mul_matmul_parts, xla_matmul=base),
        add_rms_norm=fused_add_rms_norm)
