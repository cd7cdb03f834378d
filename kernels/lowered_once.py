"""Mosaic GPU kernels lowered once per process, and at warm-up in worker processes at once.

A warm-up compiles one step for each token bucket and each sampler variant (``random``, ``filtered``):
two steps of a bucket launch the same attention kernels with the same shapes, and jax would lower a
kernel again inside each jit that calls it. Lowering a Mosaic GPU kernel (its layout inference and
dialect lowering, in Python) takes seconds a kernel, most of lowering a step.

:func:`launch` puts a kernel into the step as one primitive, keyed by the kernel's traced program
(which holds every static parameter) and its operands' shapes. Lowering that primitive embeds this
process's ``jax.export`` of the kernel, made the first time any step lowers it: the step holds the
same custom call it would have lowered, and only the kernel, so the XLA code around it is the step's
own. Because the export is looked up when a step is lowered, not when it is traced, a warm-up can
trace all its steps first, then export every kernel they launch in worker processes at once
(:func:`export_traced`: CPU-only processes lowering for ``cuda``, each its share of the kernels), and only
then lower the steps. Each kernel is described to a worker by ``build``, a picklable function of no
arguments that returns the ``plgpu.kernel`` (a ``functools.partial`` of ``plgpu.kernel`` with plain
values), and the operands' shapes.

Only on a GPU and outside ``shard_map`` (an export of one device's kernel is not called on a mesh's
shards here); where exporting fails, the kernel is lowered in each step as before, with a warning.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Callable

import jax
from jax import export
from jax.extend.core import Primitive
from jax.interpreters import mlir

log = logging.getLogger(__name__)

# The custom calls a Mosaic GPU kernel lowers to. Export refuses custom calls it does not know to be
# stable across jax versions; these exports never leave the process that made them (or, from a worker,
# the one that asked for them: the same jax).
MOSAIC_GPU_TARGETS = ("mosaic_gpu", "mosaic_gpu_v2")
# The compute capability a CPU-only process lowers Mosaic GPU kernels for (jax assumes Hopper where it
# sees no GPU): workers export only for devices of this one.
WORKER_ARCH = "9.0"
MAX_WORKERS = 16

_kernels: dict[str, tuple[Callable, tuple[jax.ShapeDtypeStruct, ...]]] = {}  # key -> (build, its operands)
_exports: dict[str, export.Exported | None] = {}  # key -> its export (None: lowered in each step)

_launch_p = Primitive("mosaic_gpu_launch")
_launch_p.multiple_results = True
_launch_p.def_abstract_eval(lambda *avals, key, out_avals: out_avals)


def exports() -> int:
    """How many kernels this process has exported (a test's handle on the cache)."""
    return sum(exp is not None for exp in _exports.values())


def _export(build: Callable, avals) -> export.Exported:
    """``build()``'s kernel exported for ``cuda`` at operands ``avals``."""
    return export.export(jax.jit(build()), platforms=("cuda",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call(t) for t in MOSAIC_GPU_TARGETS])(*avals)


def _lower(ctx, *args, key: str, out_avals):
    """The primitive's lowering: a call of the kernel's export, made now if no one made it yet, in a
    thread of its own: in this one the step's lowering context (its name stack) would enter the
    kernel's module as locations, and the module would differ from the one a worker exports or the
    step would lower."""
    build, avals = _kernels[key]
    if key not in _exports:
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as thread:
                _exports[key] = thread.submit(_export, build, avals).result()
        except Exception as e:  # noqa: BLE001 (any failure: lower the kernel in each step instead)
            log.warning("Mosaic GPU kernel lowered in each step (could not export it: %s: %s)",
                        type(e).__name__, str(e)[:200])
            _exports[key] = None
    exp = _exports[key]
    call = build() if exp is None else exp.call
    return mlir.lower_fun(lambda *a: jax.tree.leaves(call(*a)), multiple_results=True)(ctx, *args)


mlir.register_lowering(_launch_p, _lower)


def launch(build: Callable[[], Callable], *args: jax.Array, interpret):
    """``build()(*args)``: the ``plgpu.kernel`` that ``build`` returns, called on ``args``, lowered from
    this process's export of the same kernel. ``build``: picklable (a ``functools.partial`` of
    ``plgpu.kernel`` with plain values), so a worker can rebuild it. ``interpret``: the kernel's
    interpret setting (interpreted kernels run as they are)."""
    kernel = build()
    if interpret or not jax.sharding.get_abstract_mesh().empty:
        return kernel(*args)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    traced = jax.jit(kernel).trace(*avals)
    # The kernel's whole program and static parameters, and the shapes; hashed (the step's jaxpr shows it)
    key = hashlib.sha256(str(traced.jaxpr).encode()).hexdigest()
    _kernels.setdefault(key, (build, avals))
    outs, tree = jax.tree.flatten(traced.out_info)
    out_avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in outs)
    return jax.tree.unflatten(tree, _launch_p.bind(*args, key=key, out_avals=out_avals))


def worker_count() -> int:
    """Worker processes :func:`export_traced` uses by default: one a core this process may run on (at
    most ``MAX_WORKERS``) on a GPU of compute capability ``WORKER_ARCH``, else none (each kernel
    lowered where a step needs it)."""
    if jax.default_backend() != "gpu" or getattr(jax.devices()[0], "compute_capability", None) != WORKER_ARCH:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_WORKERS, cores) if cores >= 2 else 0  # (one core: no faster than the engine's process)


def export_traced(workers: int | None = None) -> int:
    """Exports every kernel traced so far and not exported yet, in ``workers`` processes at once
    (default :func:`worker_count`; none, or fewer than two kernels: nothing, each kernel is exported
    where a step's lowering needs it). Returns how many it exported. A kernel a worker could not export
    is exported or lowered where a step needs it."""
    todo = [(key, build, avals) for key, (build, avals) in _kernels.items() if key not in _exports]
    workers = min(worker_count() if workers is None else workers, len(todo))
    if workers < 1 or len(todo) < 2:
        return 0
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # (the same jaxpaged and jax)
    done = 0
    with tempfile.TemporaryDirectory(prefix="jaxpaged-export-") as tmp:
        procs = []
        for i in range(workers):
            task, out = os.path.join(tmp, f"{i}.task"), os.path.join(tmp, f"{i}.out")
            try:
                with open(task, "wb") as f:
                    pickle.dump([(build, avals) for _, build, avals in todo[i::workers]], f)
            except Exception as e:  # noqa: BLE001 (a build that does not pickle: lowered in the step)
                log.warning("Mosaic GPU kernels lowered in the steps (could not pickle them: %s)", e)
                continue
            with open(os.path.join(tmp, f"{i}.log"), "wb") as logf:
                procs.append((i, out, subprocess.Popen(
                    [sys.executable, "-c", "import sys; from jaxpaged.kernels.lowered_once import _work; _work(*sys.argv[1:])",
                     task, out], env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT)))
        for i, out, proc in procs:
            if proc.wait() != 0 or not os.path.exists(out):
                with open(os.path.join(tmp, f"{i}.log"), "rb") as f:
                    tail = f.read()[-400:].decode(errors="replace")
                log.warning("a Mosaic GPU export worker failed (its kernels are lowered in the steps): %s", tail)
                continue
            with open(out, "rb") as f:
                blobs = pickle.load(f)
            for (key, _, _), blob in zip(todo[i::workers], blobs):
                if blob is not None:
                    _exports[key] = pickle.loads(blob)
                    done += 1
    return done


def _work(task: str, out: str) -> None:
    """A worker process: exports each ``(build, avals)`` of the pickled list in ``task`` and writes their
    exports, each pickled (``None`` where one failed), to ``out``."""
    with open(task, "rb") as f:
        items = pickle.load(f)
    blobs = []
    for build, avals in items:
        try:
            # The export itself, pickled (its serialisation needs ``flatbuffers``), less its VJP rule (a
            # closure; the engine never differentiates a step).
            blobs.append(pickle.dumps(dataclasses.replace(_export(build, avals), _get_vjp=None)))
        except Exception as e:  # noqa: BLE001 (the parent lowers this one itself)
            print(f"export failed: {type(e).__name__}: {e}", file=sys.stderr)
            blobs.append(None)
    with open(out, "wb") as f:
        pickle.dump(blobs, f)
