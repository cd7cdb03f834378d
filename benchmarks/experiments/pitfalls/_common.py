"""Shared by the pitfall demonstrations: the tiny Qwen3 checkpoint (fp32) with its tokenizer."""

from __future__ import annotations

import functools

from jaxpaged import EngineConfig, LLMEngine, load_params
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.io.tokenizer import load_tokenizer


@functools.cache
def tiny_params():
    """Loaded once per process, so every demo engine shares the compiled steps."""
    return load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)


def tiny_engine(**config) -> LLMEngine:
    """An engine over the tiny checkpoint (random weights, a real byte-level BPE tokenizer)."""
    path = tiny_checkpoint_path("qwen3")
    params = tiny_params()
    config = dict(dict(block_size=16, num_blocks=128, max_model_len=512), **config)
    return LLMEngine(params, EngineConfig(**config), load_tokenizer(path))
