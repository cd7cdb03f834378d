"""Reading a step's sampled tokens back to the host: through jax, or by our own stream-ordered copy.

Why: the engine needs each step's ``int32[R]`` tokens on the host as soon as the GPU has them (every
first token waits for it, and at batch 1 so does the next step's launch). Through jax
(``copy_to_host_async`` + ``np.asarray``) the copy is issued only after the computation's completion
has travelled through a CUDA host function and two PjRt worker threads, and its own completion
through another host function before Python wakes: a fraction of a millisecond from the last kernel
to ``np.asarray`` returning for 1 KB, on the path of every first token.

:class:`StreamReader` skips that machinery. It exports the array through DLPack *with a stream of
its own*: jax then makes that stream wait, on the GPU, for the step's completion event (no host wait)
and hands over the device pointer. The reader queues a device-to-host copy of the tokens on its stream
into pinned host memory and synchronises the stream: the copy starts when the GPU finishes the step
and the host sees it a few microseconds later. It uses the CUDA driver API through ``ctypes`` (the
driver jax already loaded; no new dependency), in the primary context XLA runs in.

The DLPack export holds a reference to the buffer; the reader drops it before returning, so the
engine can donate the buffer to a later step (``ModelRunner.step``'s ``spare_tokens``).

:func:`make_token_reader` gives the stream reader where it can (one CUDA device, the driver found),
else jax's (``np.asarray``; every CPU, and tensor parallelism). Both give the same tokens; the stream
reader's are there sooner (docs/DECISIONS.md). The reader holds a stream and a pinned buffer: ``close()`` (the
engine's) releases them.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable

import jax
import numpy as np


_NON_BLOCKING = 0x1  # CU_STREAM_NON_BLOCKING
_DLTENSOR, _DLTENSOR_VERSIONED = b"dltensor", b"dltensor_versioned"
# The capsule accessors, typed once (not per read: the reader runs every step).
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def jax_reader(tokens: jax.Array) -> np.ndarray:
    """The tokens through jax (``np.asarray``)."""
    return np.asarray(tokens)


def dlpack_data_pointer(capsule) -> int:
    """The address of the first element of an unconsumed DLPack capsule's tensor:
    ``DLTensor.data + DLTensor.byte_offset``. A legacy capsule (``"dltensor"``) holds a
    ``DLManagedTensor``, which starts with its ``DLTensor``; a versioned one (``"dltensor_versioned"``)
    a ``DLManagedTensorVersioned``, whose ``DLTensor`` follows its version, context, deleter and flags
    (32 bytes). In a ``DLTensor``, ``data`` is at byte 0 and ``byte_offset`` at byte 40 (after the
    device, ndim, dtype, shape and strides)."""
    name = _capsule_name(capsule)
    if name not in (_DLTENSOR, _DLTENSOR_VERSIONED):
        raise ValueError(f"not an unconsumed DLPack capsule: {name!r}")
    tensor = _capsule_pointer(capsule, name) + (32 if name == _DLTENSOR_VERSIONED else 0)
    data = ctypes.c_void_p.from_address(tensor).value or 0
    return data + ctypes.c_uint64.from_address(tensor + 40).value


class StreamReader:
    """Reads ``int32`` token arrays of up to ``max_rows`` rows from one CUDA device (see the module
    docstring). Raises ``OSError`` / ``RuntimeError`` at construction where CUDA is unavailable."""

    def __init__(self, device: jax.Device, max_rows: int):
        if device.platform != "gpu":
            raise RuntimeError(f"StreamReader needs a CUDA device, got {device.platform}")
        self._ctx = self._stream = self._host = None  # close() releases only what was acquired
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._check(self._cuda.cuInit(0), "cuInit")
        self._dev = dev = ctypes.c_int()
        self._check(self._cuda.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device.local_hardware_id or 0)),
                    "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._ctx = ctx
        self._set_context()
        stream = ctypes.c_void_p()
        self._check(self._cuda.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(_NON_BLOCKING)), "cuStreamCreate")
        self._stream = stream
        self._nbytes = 4 * max_rows
        host = ctypes.c_void_p()
        self._check(self._cuda.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(self._nbytes), ctypes.c_uint(0)),
                    "cuMemHostAlloc")
        self._host = host
        self._view = np.ctypeslib.as_array((ctypes.c_int32 * max_rows).from_address(self._host.value))
        self._max_rows = max_rows

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"CUDA driver call {what} failed with CUresult {result}")

    def _set_context(self) -> None:
        self._check(self._cuda.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def close(self) -> None:
        """Releases the stream, the pinned buffer and the context reference (idempotent)."""
        cuda, self._cuda = self._cuda, None
        if cuda is None:
            return
        self._view = None
        if self._ctx is None:
            return
        cuda.cuCtxSetCurrent(self._ctx)
        if self._stream is not None:
            cuda.cuStreamSynchronize(self._stream)
            cuda.cuStreamDestroy_v2(self._stream)
        if self._host is not None:
            cuda.cuMemFreeHost(self._host)
        cuda.cuDevicePrimaryCtxRelease_v2(self._dev)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown: the driver may be gone)
            pass

    def __call__(self, tokens: jax.Array) -> np.ndarray:
        """``tokens`` (``int32[R]`` on this reader's device) as a fresh numpy array."""
        rows = tokens.shape[0]
        if tokens.dtype != np.int32 or tokens.ndim != 1 or rows > self._max_rows:
            return np.asarray(tokens)
        self._set_context()  # (the calling thread's current context: XLA's may not be set on it)
        capsule = tokens.__dlpack__(stream=self._stream.value)  # the stream waits for the step, on the GPU
        try:
            src = dlpack_data_pointer(capsule)
            self._check(self._cuda.cuMemcpyDtoHAsync_v2(self._host, ctypes.c_uint64(src), ctypes.c_size_t(4 * rows),
                                                        self._stream), "cuMemcpyDtoHAsync")
            self._check(self._cuda.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        finally:
            del capsule  # releases the buffer's external reference (it may be donated next)
        return self._view[:rows].copy()


def make_token_reader(device: jax.Device, max_rows: int, stream: bool = True) -> tuple[str, Callable]:
    """``(name, reader)``: ``"stream"`` (a :class:`StreamReader`) on a CUDA device where it can be set
    up and ``stream`` is True, else ``"jax"`` (``np.asarray``)."""
    if not stream or device.platform != "gpu":
        return "jax", jax_reader
    try:
        return "stream", StreamReader(device, max_rows)
    except (OSError, RuntimeError, AttributeError) as e:
        logging.getLogger(__name__).warning("the stream token reader could not be set up on %s (%s); reading "
                                            "tokens through jax", device, e)
        return "jax", jax_reader
