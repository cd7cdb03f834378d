"""The user-facing entry points: ``LLM`` (vLLM-style class), ``generate`` (functional) and
``run_to_completion`` (queue prompts on an engine and step it until they finish)."""

from __future__ import annotations

from pathlib import Path

from .config import EngineConfig
from .engine import LLMEngine
from .kv import PrefixDivergence
from .models.checkpoint import ModelParams, load_params
from .outputs import RequestOutput
from .sampling import SamplingParams
from .tokenizer import load_tokenizer


def run_to_completion(engine: LLMEngine, prompts, sampling_params, use_tqdm: bool = False) -> list[RequestOutput]:
    """Queues all prompts (validating every one first), steps until done, returns outputs in order."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    if len(sps) != len(prompts):
        raise ValueError(f"got {len(sps)} sampling params for {len(prompts)} prompts")
    rids: list[str] = []
    try:
        for p, sp in zip(prompts, sps):
            rids.append(engine.add_request(p, sp))
    except BaseException:
        for rid in rids:  # all or nothing: withdraw the requests queued before the bad one
            engine.abort_request(rid)
        raise
    results: dict[str, RequestOutput] = {}
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rids), desc="generate", unit="req")
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return [results[r] for r in rids]


class LLM:
    """vLLM-style entry point: ``LLM(path, **engine_config).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", cache_dir: str | None = None, **config):
        self.params = load_params(model, dtype, cache_dir=cache_dir,
                                  tensor_parallel_size=config.get("tensor_parallel_size", 1))
        self.tokenizer = load_tokenizer(model)
        self.engine = LLMEngine(self.params, EngineConfig(**config), self.tokenizer)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        return run_to_completion(self.engine, prompts, sampling_params, use_tqdm)

    def stats(self) -> dict:
        return self.engine.stats()

    def explain_prefix(self, a, b) -> PrefixDivergence:
        return self.engine.explain_prefix(a, b)


def generate(params: ModelParams, prompts, config: EngineConfig | None = None,
             sampling_params: SamplingParams | list[SamplingParams] | None = None, tokenizer=None,
             use_tqdm: bool = False) -> list[RequestOutput]:
    """Functional form: a fresh engine (pool) over ``params``; compiled steps are reused across calls."""
    engine = LLMEngine(params, config, tokenizer)
    return run_to_completion(engine, prompts, sampling_params, use_tqdm)
