"""Attention backends: the one registry an engine asks which paged-attention kernel runs its steps, whether
that kernel can run this engine, and what the engine's steps look like for it. The engine names none.

Every backend's function has the signature of
:func:`jaxpaged.kernels.paged_attention_reference.paged_attention_reference`::

    fn(q[T, Hq, D], kv_pool[L, N, bs, 2, Hkv, D], layer (int), cu_q_lens i32[S+1], kv_lens i32[S],
       block_tables i32[S, W], *, scale=None) -> [T, Hq, D]

* ``triton``: the Pallas kernel of :mod:`jaxpaged.kernels.paged_attention`, lowered by Triton: any CUDA GPU.
* ``mosaic``: the Pallas kernels of :mod:`jaxpaged.kernels.mosaic`, lowered by Mosaic GPU: Hopper and
  later, bf16 and fp8 pools; decode steps run a kernel of their own.
* ``reference``: pure jnp gather, any platform.

``auto`` (``EngineConfig.attention_backend``'s default) is :func:`choose_attention_backend`'s pick for an
engine: ``mosaic`` over fp8 pools on Hopper where it reads them, ``triton`` on other GPU engines,
``reference`` elsewhere (docs/DECISIONS.md has the measurements behind it). Off the GPU the Pallas
kernels run in interpret mode, slowly, which is only useful in tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxpaged.config import ATTENTION_BACKENDS
from jaxpaged.kernels import paged_attention, paged_attention_reference
from jaxpaged.kernels.fp8 import is_fp8
from jaxpaged.kernels.shapes import compute_capability
from jaxpaged.models.ops import prepare_triton_lowering


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One paged-attention backend as an engine sees it.

    ``fixed_table_width``: the kernel reads block tables only up to each ``kv_len``, so one table width
    (enough for ``max_model_len``) serves every step and a token bucket is one compiled shape (the
    Pallas kernels). Otherwise (the jnp reference, which gathers every table entry for every token) the
    tables are padded per step and a new width compiles on first use.
    """

    name: str
    fixed_table_width: bool = True

    def attention_fn(self, batch_invariant: bool = False) -> Callable[..., jax.Array]:
        """The attention function (``batch_invariant``: one fixed launch configuration for every step)."""
        raise NotImplementedError

    def check(self, kv_dtype, batch_invariant: bool, head_dim: int, block_size: int, act_dtype=None) -> None:
        """Raises ValueError, naming ``attention_backend``, where this backend cannot run such an engine."""

    def decode_steps_apart(self, kv_dtype) -> bool:
        """Whether the engine compiles decode steps (one new token a sequence) as steps of their own, which
        the kernel then reads as such (``uniform_decode``)."""
        return False


class ReferenceBackend(AttentionBackend):
    def attention_fn(self, batch_invariant: bool = False):
        # No batch-invariant mode: its batched dots and reductions follow XLA's shape-dependent code paths
        # (a token's logits change with the step's token count), so that guarantee is the Pallas kernels'.
        return paged_attention_reference.paged_attention_reference


class TritonBackend(AttentionBackend):
    def attention_fn(self, batch_invariant: bool = False):
        if _on_gpu():
            prepare_triton_lowering()
        return functools.partial(paged_attention.paged_attention, interpret=not _on_gpu(),
                                 batch_invariant=batch_invariant)


class MosaicBackend(AttentionBackend):
    def attention_fn(self, batch_invariant: bool = False):
        from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu  # imports Mosaic GPU: only when asked for

        return functools.partial(paged_attention_mgpu, interpret=not _on_gpu())

    def check(self, kv_dtype, batch_invariant: bool, head_dim: int, block_size: int, act_dtype=None) -> None:
        """The Mosaic GPU kernels need compute capability 9.0+ (wgmma, TMA) and the pool dtypes, head dims
        and block sizes they read (an fp8 pool: blocks of at least 64 slots, one a KV tile, and bf16
        activations ``act_dtype``), and are not the batch-invariant configuration (that guarantee is
        verified on the Triton kernel only)."""
        from jaxpaged.kernels.mosaic import common as mgpu  # imports Mosaic GPU: only when asked for

        if head_dim not in mgpu.HEAD_DIMS or block_size not in mgpu.BLOCK_SIZES:
            raise ValueError(f"attention_backend='mosaic' reads head_dim {mgpu.HEAD_DIMS} and block_size "
                             f"{mgpu.BLOCK_SIZES}, this engine has head_dim {head_dim}, block_size {block_size}: "
                             "use 'triton'")
        if batch_invariant:
            raise ValueError("attention_backend='mosaic' does not run with batch_invariant=True: the bitwise "
                             "guarantee is verified on the Triton kernel only (use attention_backend='triton')")
        if _on_gpu():
            cc = compute_capability()
            if cc is None or cc < (9, 0):
                raise ValueError(f"attention_backend='mosaic' needs a GPU of compute capability 9.0+ (Hopper); "
                                 f"this one is {'.'.join(map(str, cc or (0,)))}: use 'triton'")
        if is_fp8(kv_dtype):
            if block_size < mgpu.MIN_KV_TILE:
                raise ValueError(f"attention_backend='mosaic' reads an fp8 pool one block a KV tile: block_size "
                                 f"must be >= {mgpu.MIN_KV_TILE} (the fp8 default), this engine has {block_size}")
            if act_dtype is not None and jnp.dtype(act_dtype) != jnp.dtype(jnp.bfloat16):
                raise ValueError(f"attention_backend='mosaic' reads an fp8 pool with bfloat16 activations, this "
                                 f"model's are {jnp.dtype(act_dtype).name}: use 'triton'")
            return
        ok = mgpu.pool_dtypes(interpret=not _on_gpu())
        if jnp.dtype(kv_dtype) not in ok:
            raise ValueError(f"attention_backend='mosaic' reads {'/'.join(d.name for d in ok)} KV pools here, not "
                             f"{jnp.dtype(kv_dtype).name}: use 'triton' for this kv_cache_dtype")

    def decode_steps_apart(self, kv_dtype) -> bool:
        """Over a bf16 or fp8 pool decode steps run a kernel of their own (keys on wgmma's M)."""
        return jnp.dtype(kv_dtype) == jnp.bfloat16 or is_fp8(kv_dtype)


BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (
    TritonBackend("triton"), MosaicBackend("mosaic"), ReferenceBackend("reference", fixed_table_width=False))}
assert {"auto", *BACKENDS} == set(ATTENTION_BACKENDS)  # config.py names them for users
KERNEL_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.fixed_table_width)  # the Pallas kernels


def resolve_backend(backend: str) -> str:
    """Maps ``"auto"`` to ``"triton"`` on GPU and ``"reference"`` elsewhere; validates the name."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if _on_gpu() else "reference"
    return backend


def get_backend(backend: str) -> AttentionBackend:
    """The registered backend ``backend`` names (``"auto"``: :func:`resolve_backend`'s)."""
    return BACKENDS[resolve_backend(backend)]


def check_attention_backend(backend: str, kv_dtype, batch_invariant: bool, head_dim: int, block_size: int,
                            act_dtype=None) -> None:
    """Raises ValueError, naming ``attention_backend``, where ``backend`` cannot run this engine."""
    get_backend(backend).check(kv_dtype, batch_invariant, head_dim, block_size, act_dtype)


def choose_attention_backend(backend: str, kv_dtype, batch_invariant: bool, head_dim: int, block_size: int,
                             act_dtype=None, tensor_parallel_size: int = 1) -> AttentionBackend:
    """The backend an engine runs: ``backend`` itself after its check, or for ``"auto"`` the fastest
    measured for this engine: ``mosaic`` over an fp8 pool on Hopper where that kernel reads it (on one
    device: it has not been measured sharded), otherwise :func:`resolve_backend`'s choice."""
    check_attention_backend(backend, kv_dtype, batch_invariant, head_dim, block_size, act_dtype)
    if backend == "auto" and _on_gpu() and is_fp8(kv_dtype) and not batch_invariant and tensor_parallel_size == 1:
        try:
            check_attention_backend("mosaic", kv_dtype, batch_invariant, head_dim, block_size, act_dtype)
        except ValueError:  # not Hopper, or a pool or model this kernel does not read
            return get_backend(backend)
        return BACKENDS["mosaic"]
    return get_backend(backend)


@functools.cache
def get_attention_fn(backend: str = "auto", batch_invariant: bool = False) -> Callable[..., jax.Array]:
    """The ragged paged-attention function of ``backend`` (reference signature); ``batch_invariant``: the
    Pallas kernels' one fixed launch configuration for every step."""
    return get_backend(backend).attention_fn(batch_invariant)
