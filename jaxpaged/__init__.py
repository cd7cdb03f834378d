"""jaxpaged: a JAX LLM inference engine built around PagedAttention and block-level prefix caching."""

import importlib
import os
from typing import TYPE_CHECKING

# JAX's GPU client takes 75% of the GPU's memory on its first allocation by default, and mapping that
# arena is a cost every start pays, even for a model whose weights and pool need a few MiB. The engine sizes
# its pool from the allocator's limit either way (``models/kv_pool.py``), so it grows the arena as it needs
# instead. The limit itself stays 75% of the device unless raised: 95% lets ``memory_fraction`` (vLLM's
# ``gpu_memory_utilization``) mean a share of nearly the whole device, so weights of 60 GB still leave a
# pool and working memory on an 80 GB card; the rest is CUDA's own (context, libraries' workspaces).
# Effective only when set before JAX starts its GPU client; a user's own settings win (docs/DECISIONS.md).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

# The public names and the modules that define them, imported on first use (PEP 562): `import jaxpaged`
# and `python -m jaxpaged --help` do not load JAX until a name that needs it is used.
_PUBLIC = {
    "LLM": ".llm", "generate": ".llm", "run_to_completion": ".llm",
    "LLMEngine": ".engine.llm_engine",
    "EngineConfig": ".config",
    "SamplingParams": ".sampling", "RequestOutputKind": ".sampling", "StructuredOutputsParams": ".sampling",
    "RequestOutput": ".io.outputs", "CompletionOutput": ".io.outputs", "RequestMetrics": ".io.outputs",
    "Logprob": ".io.outputs",
    "ModelParams": ".models.checkpoint", "load_params": ".models.checkpoint",
    "QwenConfig": ".models.config", "CheckpointError": ".models.config",
    "explain_prefix": ".kv", "KVCacheManager": ".kv", "KVStats": ".kv",
    "load_tokenizer": ".io.tokenizer",
}

__version__ = "0.1.0"
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine.llm_engine import LLMEngine
    from .io.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from .io.tokenizer import load_tokenizer
    from .kv import KVCacheManager, KVStats, explain_prefix
    from .llm import LLM, generate, run_to_completion
    from .models.checkpoint import ModelParams, load_params
    from .models.config import CheckpointError, QwenConfig
    from .sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams
