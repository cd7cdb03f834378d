"""Backend switch: the attention and KV-write functions the model calls.

``get_attention_fn(backend)`` returns a function with the signature of
:func:`jaxpaged.kernels.reference.paged_attention_reference`::

    fn(q[T, Hq, D], kv_pool[L, N, bs, 2, Hkv, D], layer (int), cu_q_lens i32[S+1], kv_lens i32[S],
       block_tables i32[S, W], *, scale=None) -> [T, Hq, D]

``backend``: ``"pallas"`` (the Pallas-Triton kernels of :mod:`jaxpaged.kernels.paged_attention`; on a
machine without a GPU they run in interpret mode, slowly, which is only useful in tests), ``"reference"``
(pure jnp gather, any platform) or ``"auto"`` (pallas on GPU, reference elsewhere). A Mosaic GPU
(Hopper) backend can be added here under its own name without touching the model.

Every backend writes K/V with the same XLA scatter (:func:`jaxpaged.kernels.kv_write.write_kv`, in
place when the step donates the pool).

``batch_invariant=True`` (``EngineConfig.batch_invariant``, docs/NUMERICS.md): the Pallas attention
runs one fixed launch configuration for every step (:func:`paged_attention.invariant_config`), and
:func:`get_model_ops` gives the model fixed-tile Pallas matmuls and a row-kernel RMSNorm instead of
XLA's shape-dependent ones; the default returns the plain XLA ops.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxpaged.kernels import matmul, paged_attention, reference, rms_norm
from jaxpaged.models.qwen import DEFAULT_OPS, ModelOps, rotary

BACKENDS = ("pallas", "reference", "auto")


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_backend(backend: str) -> str:
    """Maps ``"auto"`` to ``"pallas"`` on GPU and ``"reference"`` elsewhere; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if _on_gpu() else "reference"
    return backend


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
        return reference.paged_attention_reference
    return functools.partial(paged_attention.paged_attention, interpret=not _on_gpu(),
                             batch_invariant=batch_invariant)


@functools.cache
def get_model_ops(batch_invariant: bool = False) -> ModelOps:
    """The model's matmul and RMSNorm: XLA's (default: ``x @ w``, IEEE fp32 for float32 weights), or
    the fixed-tile Pallas matmul and row-kernel RMSNorm whose per-row results never depend on the
    number of rows (``batch_invariant``; interpret mode off the GPU)."""
    if not batch_invariant:
        return DEFAULT_OPS
    interpret = not _on_gpu()
    return ModelOps(matmul=functools.partial(matmul.matmul, interpret=interpret),
                    rms_norm=functools.partial(rms_norm.rms_norm, interpret=interpret),
                    rotary=functools.partial(rotary, separate_products=True))
