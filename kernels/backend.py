"""Backend switch: the attention and KV-write functions the model calls.

``get_attention_fn(backend)`` returns a function with the signature of
:func:`jaxpaged.kernels.reference.paged_attention_reference`::

    fn(q[T, Hq, D], k_cache, v_cache, cu_q_lens i32[S+1], kv_lens i32[S], block_tables i32[S, W],
       *, scale=None) -> [T, Hq, D]

``backend``: ``"pallas"`` (the Pallas-Triton kernels of :mod:`jaxpaged.kernels.paged_attention`; on a
machine without a GPU they run in interpret mode, slowly, which is only useful in tests), ``"reference"``
(pure jnp gather, any platform) or ``"auto"`` (pallas on GPU, reference elsewhere). A Mosaic GPU
(Hopper) backend can be added here under its own name without touching the model.

Every backend writes K/V with the same XLA scatter (:func:`jaxpaged.kernels.kv_write.write_kv`, in
place when the step donates the pool).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jaxpaged.kernels import paged_attention, reference

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


def get_attention_fn(backend: str = "auto") -> Callable[..., jax.Array]:
    """Returns the ragged paged-attention function of ``backend`` (reference signature)."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.paged_attention_reference
    return functools.partial(paged_attention.paged_attention, interpret=not _on_gpu())
