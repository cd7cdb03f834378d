"""load_params: a Hugging Face Qwen folder -> converted params, cached with Orbax so the second load is fast.

The cache key covers the folder's absolute path, config.json's contents, each weight file's size and
modification time, the dtype, the quantization and the converter's version, so a changed checkpoint is never served
stale. The cache lives in ``$JAXPAGED_CACHE`` (default ``~/.cache/jaxpaged``)/params/<key>.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from .config import QwenConfig, canonical_dtype
from .hub import resolve_model_path
from .convert import abstract_model, convert_tensors, read_hf_tensors, safetensors_files
from .quantization import Fp8Config, checkpoint_quantization, resolve_quantization

CONVERTER_VERSION = "1"
log = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelParams:
    """Everything needed to run a model: architecture, NNX graph definition and weights (``state``).

    ``mesh``: set when the weights are split over a tensor-parallel mesh (``load_params(...,
    tensor_parallel_size=N)``): ``state`` then holds global arrays split as ``jaxpaged.models.sharding``
    says, and ``graphdef`` is the model one shard runs (``sharding.shard_config``).
    ``quantization``: set when the linear layers' weights are fp8 (``models/quantization.py``); ``dtype``
    is then the activations', embeddings' and LM head's."""

    config: QwenConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    dtype: str
    path: Path | None = None
    from_cache: bool = False
    mesh: Any = None
    # Things derived from these weights (the engine's compiled steps), released together with them.
    derived: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    quantization: Fp8Config | None = None


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXPAGED_CACHE", Path.home() / ".cache" / "jaxpaged"))


def cache_key(path: Path, dtype: str, quant: Fp8Config | None = None) -> str:
    """Hash of what determines the converted params (see the module docstring)."""
    h = hashlib.sha256()
    h.update(str(path.resolve()).encode())
    h.update((path / "config.json").read_bytes())
    for f in safetensors_files(path):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"{dtype}:{quant}:{CONVERTER_VERSION}".encode())
    return h.hexdigest()[:24]


def _beside(directory: Path, what: str) -> Path:
    """A sibling of ``directory`` that no other writer (process or thread) names the same."""
    return directory.with_name(f"{directory.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def save_state(directory: Path, state: nnx.State) -> None:
    """Writes the state with Orbax, atomically: into a temporary folder of this writer's own, then
    renamed to ``directory``. Processes that load the same checkpoint for the first time at once (two
    servers, a notebook and a script, test workers) each write their own copy and the last rename
    wins; a copy already there (a damaged one being rebuilt, or another writer's) is moved aside
    first, so a reader sees a whole copy or none."""
    import orbax.checkpoint as ocp  # here, not at module level: slow to import, and most imports of jaxpaged never save

    tmp = _beside(directory, "tmp")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp.resolve(), nnx.to_pure_dict(state))
        old = _beside(directory, "old")
        try:
            directory.rename(old)
        except FileNotFoundError:
            pass
        try:
            tmp.rename(directory)
        except OSError:  # another writer's copy landed in between: it stays, this one goes
            pass
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:  # the cache only saves time: a load never fails for want of it
        log.warning("param cache %s not written (%s)", directory, err)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def restore_state(directory: Path, abstract_state: nnx.State) -> nnx.State:
    """Reads a state saved by ``save_state`` into the shapes/dtypes of ``abstract_state``."""
    import orbax.checkpoint as ocp

    target = nnx.to_pure_dict(abstract_state)
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(directory.resolve(), target)
    nnx.replace_by_pure_dict(abstract_state, pure)
    return abstract_state


def load_params(path: str | Path, dtype: str | None = None, *, cache_dir: str | Path | None = None,
                use_cache: bool = True, tensor_parallel_size: int = 1, load_format: str = "auto",
                quantization: str | None = None) -> ModelParams:
    """Loads a Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE Hugging Face folder (or a Hub id already in the local
    Hugging Face cache) as params in ``dtype`` (default: the checkpoint's).

    The first load converts the safetensors and saves an Orbax copy; later loads restore that copy.
    ``tensor_parallel_size > 1``: split over that many devices, each reading only its slices of the
    safetensors (``models/sharded_load.py``; the Orbax cache is not used).
    ``load_format``: ``"auto"`` reads the weights; ``"dummy"`` (vLLM's name) makes random ones of the
    folder's ``config.json`` (``sharding.random_state``), which needs no weight files: for benchmarks.
    ``quantization``: ``None`` (the checkpoint's: an fp8 checkpoint's ``quantization_config`` loads its
    fp8 weights and block scales as they are) or ``"fp8"`` (also a bf16/f32 checkpoint's linear weights,
    quantized at load with a scale per output channel; ``models/quantization.py``).
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    path = resolve_model_path(path)
    cfg = QwenConfig.from_pretrained(path)
    dtype = canonical_dtype(dtype or cfg.dtype)
    if load_format == "dummy":  # random weights of the architecture: quantized per output channel if asked
        quant = resolve_quantization(quantization, None)
        return random_params(cfg, dtype, tensor_parallel_size=tensor_parallel_size, path=path, quantization=quant)
    quant = resolve_quantization(quantization, checkpoint_quantization(path))
    if tensor_parallel_size > 1:
        from jaxpaged.models.sharding import make_mesh

        from .sharded_load import load_sharded_state

        mesh = make_mesh(tensor_parallel_size)
        graphdef, state = load_sharded_state(path, cfg, mesh, dtype, quant)
        return ModelParams(cfg, graphdef, state, dtype, path, from_cache=False, mesh=mesh, quantization=quant)
    graphdef, abstract_state = abstract_model(cfg, dtype, quant)
    cached = None
    if use_cache:
        cached = Path(cache_dir or default_cache_dir()) / "params" / cache_key(path, dtype, quant)
        if cached.is_dir():
            try:
                state = _on_device(restore_state(cached, abstract_state))
                return ModelParams(cfg, graphdef, state, dtype, path, from_cache=True, quantization=quant)
            except Exception as err:  # a damaged cache is rebuilt, never fatal
                log.warning("param cache %s unreadable (%s); converting again", cached, err)
    state = _on_device(convert_tensors(cfg, read_hf_tensors(path), dtype, quant))
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        save_state(cached, state)
    return ModelParams(cfg, graphdef, state, dtype, path, from_cache=False, quantization=quant)


def random_params(cfg: QwenConfig, dtype: str, seed: int = 0, tensor_parallel_size: int = 1,
                  path: Path | None = None, quantization: Fp8Config | None = None) -> ModelParams:
    """Random weights of ``cfg``'s shapes (normal * 0.02, norms one: ``sharding.random_state``), committed to
    the first device; ``tensor_parallel_size > 1``: created directly split over that many devices, never
    whole on one device (the same values as on one device). ``quantization``: the linear weights then
    quantized to fp8 per output channel, as a bf16 checkpoint loaded with ``quantization="fp8"``."""
    from .sharding import make_mesh, random_state, shard_config

    if tensor_parallel_size > 1:
        mesh = make_mesh(tensor_parallel_size)
        graphdef, state = random_state(shard_config(cfg, tensor_parallel_size), dtype, seed, mesh, quantization)
        return ModelParams(cfg, graphdef, state, dtype, path, from_cache=False, mesh=mesh, quantization=quantization)
    graphdef, state = random_state(cfg, dtype, seed, quant=quantization)
    return ModelParams(cfg, graphdef, state, dtype, path, from_cache=False, quantization=quantization)


def _on_device(state: nnx.State) -> nnx.State:
    """Every weight committed to the first device, however it was made (converted here, or restored by
    Orbax with a sharding of its own): the compiled step is specific to its arguments' placement, so
    weights placed alike in every process let a second process reuse the first one's compiled steps."""
    return jax.device_put(state, jax.local_devices()[0])
