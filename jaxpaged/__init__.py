"""jaxpaged: a JAX LLM inference engine built around PagedAttention and block-level prefix caching."""

import os

# JAX's GPU client takes 75% of the GPU's memory on its first allocation by default, and mapping that
# arena cost 1.7 s of every start on the H200 (one tiny array's transfer; 7 ms without it), even for a
# model whose weights and pool need a few MiB. The engine sizes its pool from the allocator's limit
# either way (``kv/pool_size.py``), so it grows the arena as it needs instead; effective only when set
# before JAX starts its GPU client, and a user's own setting wins (docs/DECISIONS.md).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .llm import LLM, generate, run_to_completion
from .kv import KVCacheManager, KVStats, explain_prefix
from .models.checkpoint import ModelParams, load_params
from .models.config import CheckpointError, QwenConfig
from .io.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling import RequestOutputKind, SamplingParams
from .io.tokenizer import load_tokenizer

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "ModelParams", "QwenConfig", "CheckpointError", "generate", "run_to_completion", "load_params",
           "explain_prefix", "KVCacheManager", "KVStats", "load_tokenizer", "RequestOutputKind", "Logprob"]
