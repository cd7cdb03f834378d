"""A Mosaic GPU kernel lowered once per process, whichever compiled step launches it.

A warm-up compiles one step for each token bucket and each sampler variant (``random``, ``filtered``):
two steps of a bucket launch the same attention kernels with the same shapes, and jax lowers a kernel
again inside each jit that calls it. Lowering a Mosaic GPU kernel (its layout inference and dialect
lowering, in Python) takes 1-2 s a kernel at Qwen3-0.6B's shapes, most of lowering a launch.
:func:`launch` exports a kernel once per distinct kernel (its traced program, which holds every static
parameter, and its operands' shapes) with ``jax.export`` and calls the export from each step: the step
embeds the same custom call it would have lowered, and only the kernel, so the XLA code around it is
the step's own, as without the cache.

Only on a GPU and outside ``shard_map`` (an export of one device's kernel is not called on a mesh's
shards here); where exporting fails, the kernel is lowered in the step as before, logged once.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
from jax import export

log = logging.getLogger(__name__)

# The custom calls a Mosaic GPU kernel lowers to. Export refuses custom calls it does not know to be
# stable across jax versions; these exports never leave the process that made them.
MOSAIC_GPU_TARGETS = ("mosaic_gpu", "mosaic_gpu_v2")

_exports: dict[str, export.Exported | None] = {}


def exports() -> int:
    """How many kernels this process has exported (a test's handle on the cache)."""
    return sum(exp is not None for exp in _exports.values())


def launch(kernel: Callable, *args: jax.Array, interpret) -> jax.Array:
    """``kernel(*args)`` (a ``plgpu.kernel``), from this process's export of the same kernel where
    there is one. ``interpret``: the kernel's interpret setting (interpreted kernels run as they are)."""
    if interpret or not jax.sharding.get_abstract_mesh().empty:
        return kernel(*args)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    traced = jax.jit(kernel).trace(*avals)
    key = str(traced.jaxpr)  # the kernel's whole program and static parameters, and the shapes
    if key not in _exports:
        try:
            _exports[key] = export.export(jax.jit(kernel), platforms=("cuda",), disabled_checks=[
                export.DisabledSafetyCheck.custom_call(t) for t in MOSAIC_GPU_TARGETS])(*avals)
        except Exception as e:  # noqa: BLE001 (any failure: lower the kernel in each step instead)
            log.warning("Mosaic GPU kernel lowered in each step (could not export it: %s: %s)",
                        type(e).__name__, str(e)[:200])
            _exports[key] = None
    exp = _exports[key]
    return kernel(*args) if exp is None else exp.call(*args)
