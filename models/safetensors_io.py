"""Minimal safetensors reader/writer on numpy memory maps, with bfloat16 through ml_dtypes.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets), then raw little-endian tensor bytes. Reading by memory map touches only the tensors used,
and bfloat16 and float8_e4m3fn work without torch (numpy has neither; ml_dtypes, a jax dependency, does).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from .config import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # fp8 checkpoints' weights (models/quantization.py)
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Maps every tensor of one ``.safetensors`` file (read-only memory maps, no copy).

    A damaged file (truncated, corrupted header, offsets past the end or not matching a tensor's
    shape) is a ``CheckpointError`` naming the file and the tensor.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8 or header_len > 100_000_000:
            raise CheckpointError(f"{path}: corrupted safetensors header (header length {header_len} but the file "
                                  f"has {size} bytes): the file is truncated or not a safetensors file")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: corrupted safetensors header (not valid JSON: {err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if data_len else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        try:
            dtype_name, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r:.100}") from None
        if dtype_name not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name}")
        nbytes = int(np.prod(shape)) * _DTYPES[dtype_name].itemsize
        if end - start != nbytes or start < 0:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - start} bytes for shape {shape} "
                                  f"{dtype_name} ({nbytes} expected): corrupted header")
        if end > data_len:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {end} of the data but the file has "
                                  f"{data_len}: the file is truncated (re-download it)")
        tensors[name] = data[start:end].view(_DTYPES[dtype_name]).reshape(shape)
    return tensors


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes tensors in the safetensors format (readable by Hugging Face's ``safetensors``)."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        blob = arr.tobytes()
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
