"""jaxpaged: a JAX LLM inference engine built around PagedAttention and block-level prefix caching."""

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
