"""Compiled steps kept on disk whole, so a new process skips tracing, lowering and compiling them.

Why: JAX's persistent compilation cache keeps XLA's output only. A new process still traces the
model, lowers it (the Pallas-Triton kernels compile during lowering) and looks the result up, a large
part of a cold start. Here each warmed-up step is stored as a serialised executable
(``jax.experimental.serialize_executable``) and loaded back as a callable ``jax.stages.Compiled``.

Entries live in ``<compilation cache dir>-steps/<key>/``, where ``<key>`` hashes everything an
executable depends on: jax and jaxlib versions, the device kind, the model's config, the weights'
structure and dtype, the engine's step options and the engine's own source code. A different version,
GPU or model config therefore never loads a wrong entry. Writes are atomic (a temporary file, then a
rename), so concurrent engines can share a folder; an unreadable entry is reported once, deleted and
compiled again, never fatal. On a CPU a step that XLA's persistent cache supplied is not stored: the
XLA CPU runtime serialises such an executable without its compiled functions, and the copy loaded in
the next process fails when it runs ("Function ... not found"; jax 0.12).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax

from .. import kernels, models

log = logging.getLogger(__name__)
_warned = False  # the unreadable-entry warning was given (once per process)
_warn_lock = threading.Lock()
_thread = threading.local()  # XLA persistent-cache hits seen by the current thread (compile_step)


def _count_persistent_cache_hit(event: str, **_kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # (recorded in the compiling thread)
        _thread.hits = getattr(_thread, "hits", 0) + 1


jax.monitoring.register_event_listener(_count_persistent_cache_hit)


def compile_step(lowered) -> tuple[Any, bool]:
    """``lowered.compile()``, and whether the result may be stored here (see the module docstring)."""
    before = getattr(_thread, "hits", 0)
    compiled = lowered.compile()
    from_xla_cache = getattr(_thread, "hits", 0) > before
    return compiled, not (from_xla_cache and jax.default_backend() == "cpu")


@functools.cache
def source_hash() -> str:
    """A hash of the engine's Python sources (jaxpaged, its kernels and models): a changed line of code
    must never run an executable compiled from the old one."""
    h = hashlib.sha256()
    for root in (Path(__file__).parent.parent, Path(kernels.__file__).parent, Path(models.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(*parts: Any) -> str:
    """The folder name for executables that depend on ``parts`` (and on jax, the device and the code)."""
    import jaxlib

    device = jax.local_devices()[0]
    text = repr((jax.__version__, jaxlib.__version__, device.platform, device.device_kind, source_hash()) + parts)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def execution_devices(compiled) -> list:
    """The devices ``compiled`` runs on, in its order. Loading a serialised executable needs them:
    ``deserialize_and_load`` otherwise loads it for every device of the backend, and a step compiled
    for one of several devices then fails when it runs ("Expected args ... to have 4 shards")."""
    return list(compiled.runtime_executable().local_devices())


def clone(compiled):
    """A second, independent executable of ``compiled`` (serialised and loaded again: no tracing, lowering or
    compiling). Each copy keeps its own CUDA graphs."""
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    return deserialize_and_load(*serialize(compiled), execution_devices=execution_devices(compiled))


class ExecutableCache:
    """Serialised step executables in ``folder``, one file per step shape (``name``)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.loaded = 0
        self.stored = 0

    def _path(self, name: str) -> Path:
        return self.folder / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.step"

    def load(self, name: str):
        """The executable stored for ``name``, or None (absent or unreadable: then deleted)."""
        path = self._path(name)
        if not path.is_file():
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            by_id = {d.id: d for d in jax.devices()}
            compiled = deserialize_and_load(payload, in_tree, out_tree,
                                            execution_devices=[by_id[i] for i in device_ids])
        except Exception as err:  # noqa: BLE001  (a damaged or foreign entry: compile again)
            global _warned
            with _warn_lock:  # (entries load in parallel threads: one warning, not one per thread)
                first, _warned = not _warned, True
            if first:
                log.warning("jaxpaged: ignoring an unreadable compiled step in %s (%s: %s); compiling it again",
                            self.folder, type(err).__name__, err)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return compiled

    def store(self, name: str, compiled) -> None:
        """Writes ``compiled`` for ``name`` (atomically); an executable that cannot be serialised is skipped."""
        try:
            from jax.experimental.serialize_executable import serialize

            payload, in_tree, out_tree = serialize(compiled)
            data = pickle.dumps((payload, in_tree, out_tree, [d.id for d in execution_devices(compiled)]))
        except Exception as err:  # noqa: BLE001
            log.debug("step not cached (%s)", err)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(name))
            self.stored += 1
        except OSError:
            Path(tmp).unlink(missing_ok=True)
