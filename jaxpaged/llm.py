"""The user-facing entry points: ``LLM`` (vLLM-style class: generate, chat, streaming, abort),
``generate`` (functional) and ``run_to_completion`` (queue prompts on an engine, step until done)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Iterator

from .config import EngineConfig
from .engine import multihost
from .engine.llm_engine import LLMEngine
from .kv import PrefixDivergence
from .models.attention_backends import KERNEL_BACKENDS
from .models.checkpoint import ModelParams, load_params
from .models.hub import resolve_model_path
from .io.outputs import RequestOutput
from .io.prompts import chat_prompts
from .sampling.sampler import RequestOutputKind, SamplingParams
from .io.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"1.50 GiB"``, ``"768.00 KiB"``)."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
FINAL, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _with_kind(sampling_params, kind: RequestOutputKind):
    """The sampling params (one or a list) with ``output_kind`` set; ``None`` stays ``None``."""
    def one(sp):
        sp = SamplingParams.from_optional(sp)
        return sp if sp.output_kind is kind else dataclasses.replace(sp, output_kind=kind)
    if isinstance(sampling_params, (list, tuple)):
        return [one(sp) for sp in sampling_params]
    return one(sampling_params)


def run_to_completion(engine: LLMEngine, prompts, sampling_params, use_tqdm: bool = False) -> list[RequestOutput]:
    """Queues all prompts (checking every one first: a bad one queues nothing), steps until they
    finish, returns their final outputs in input order."""
    rids = engine.add_requests(prompts, _with_kind(sampling_params, FINAL))
    wanted = set(rids)
    results: dict[str, RequestOutput] = {}
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rids), desc="generate", unit="req")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                results[out.request_id] = out
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return [results[r] for r in rids]


def stream(engine: LLMEngine, prompts, sampling_params, output_kind: RequestOutputKind = DELTA) -> Iterator[RequestOutput]:
    """Queues all prompts and yields their outputs as the engine produces them (``DELTA``: only what
    is new in each; ``CUMULATIVE``: everything so far). Closing the iterator early aborts the rest."""
    rids = engine.add_requests(prompts, _with_kind(sampling_params, output_kind))
    pending = set(rids)
    try:
        while pending and engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id in pending:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
    finally:
        for rid in pending:
            try:
                engine.abort_request(rid)
            except KeyError:
                pass


def default_sampling_params(model_path: Path) -> SamplingParams:
    """vLLM's defaults from the checkpoint's ``generation_config.json`` (temperature, top_p, top_k,
    min_p, repetition_penalty; ``max_new_tokens`` is ignored, as vLLM does)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return SamplingParams()
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        log.warning("%s is not valid JSON (%s): using SamplingParams() defaults", path, err)
        return SamplingParams()
    chosen = {k: raw[k] for k in GENERATION_CONFIG_KEYS if raw.get(k) is not None}
    if chosen.get("top_k") == 0:
        chosen["top_k"] = -1
    try:
        return SamplingParams(**chosen)
    except (TypeError, ValueError) as err:
        log.warning("%s: unusable sampling defaults (%s): using SamplingParams() defaults", path, err)
        return SamplingParams()


class LLM:
    """vLLM-style entry point: ``LLM(path_or_hub_id, **engine_config).generate(prompts, SamplingParams(...))``.

    ``model``: a Hugging Face checkpoint folder, or a Hub id already in the local Hugging Face cache
    (``hf download Qwen/Qwen3-0.6B`` first). Without sampling params, ``generate`` and
    ``chat`` use the checkpoint's ``generation_config.json`` defaults, as vLLM does.
    ``dtype``: the weights' dtype (``"auto"``: the checkpoint's). ``warmup``: compile every step shape and
    sampler variant now, with a
    progress bar (``LLMEngine.warmup``), so no request waits for a compilation; ``False`` skips it
    (steps then compile on first use). The default, ``None``, warms up on the Pallas attention backend
    (a GPU's), whose steps have one block-table width, so the warm-up covers every step; not on the
    jnp reference backend (a CPU's), which pads block tables per step: there a warm-up would compile
    steps at the widest table only (20 of them in ~30 s for the tiny checkpoint), which short
    requests never use. ``load_format="dummy"``: random weights of the folder's
    ``config.json`` (vLLM's option, for benchmarks; no weight files needed). ``**config``: ``EngineConfig``
    fields, or their vLLM names (``gpu_memory_utilization``, ``num_gpu_blocks_override``: the command
    line's flags). ``warmed_up``: whether the steps were compiled here (else they compile on first use).
    """

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", cache_dir: str | None = None,
                 warmup: bool | None = None, load_format: str = "auto", **config):
        engine_config = EngineConfig.from_kwargs(**config)  # before loading: a wrong name fails at once
        multihost.initialize(engine_config)  # several processes: jax.distributed, before any device is used
        if engine_config.process_id:  # (KV-cache events are the leader's to publish)
            engine_config = dataclasses.replace(engine_config, kv_events_config=None)
        self.model_path = resolve_model_path(model)
        self.params = load_params(self.model_path, None if dtype == "auto" else dtype, cache_dir=cache_dir,
                                  load_format=load_format, tensor_parallel_size=engine_config.tensor_parallel_size,
                                  quantization=engine_config.quantization)
        self.tokenizer = load_tokenizer(self.model_path)
        self.engine = LLMEngine(self.params, engine_config, self.tokenizer)
        self.default_sampling_params = default_sampling_params(self.model_path)
        e = self.engine
        self.warmed_up = bool(warmup or (warmup is None and e.runner.attention_backend in KERNEL_BACKENDS))
        print(f"jaxpaged: KV pool {e.num_blocks} blocks x {e.config.block_size} tokens "
              f"({e.num_blocks * e.config.block_size} tokens, {format_bytes(e.stats()['kv_pool_bytes'])} "
              f"{e.kv_dtype}), max_model_len {e.max_model_len}; "
              + ("compiling the steps now" if self.warmed_up else "steps compile on first use"))
        if self.warmed_up:
            e.warmup()
        if engine_config.num_processes > 1:  # the leader's engine calls replayed on the other processes
            self.engine = multihost.connect(e, engine_config)

    def follow(self) -> None:
        """On process 1.. of several (``num_processes``): runs process 0's engine calls until process 0 closes
        its ``LLM`` or exits (``engine/multihost.py``). Requests go to process 0 only."""
        if not isinstance(self.engine, multihost.MultiProcessEngine):
            raise RuntimeError("follow() is for a process other than 0 of several (num_processes > 1)")
        self.engine.follow()

    def close(self) -> None:
        """Releases the engine's resources outside JAX (``LLMEngine.close``); on process 0 of several, also
        ends the other processes' ``follow``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sp(self, sampling_params):
        return self.default_sampling_params if sampling_params is None else sampling_params

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Final outputs in prompt order. ``prompts``: a str, a list of token ids, a
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dict, or a list of these."""
        return run_to_completion(self.engine, prompts, self._sp(sampling_params), use_tqdm)

    def generate_stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                        output_kind: RequestOutputKind = DELTA) -> Iterator[RequestOutput]:
        """Yields outputs while they are generated: with ``DELTA`` (default) each holds the new text and
        tokens of one request since its previous output; the last one of a request has ``finished``."""
        return stream(self.engine, prompts, self._sp(sampling_params), output_kind)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of ``{"role", "content"}`` dicts) or a list of
        conversations, formatted by the tokenizer's chat template (or ``chat_template``)."""
        prompts = self.chat_prompts(messages, chat_template, add_generation_prompt, chat_template_kwargs)
        return run_to_completion(self.engine, prompts, self._sp(sampling_params), use_tqdm)

    def chat_prompts(self, messages, chat_template: str | None = None, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict | None = None) -> list[str]:
        """The prompt text of each conversation (what ``chat`` generates from)."""
        return chat_prompts(self.tokenizer, messages, chat_template, add_generation_prompt, chat_template_kwargs)

    def abort(self, request_id: str) -> None:
        """Withdraws a request added through ``llm.engine``; ``KeyError`` if no such unfinished request."""
        self.engine.abort_request(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def explain_prefix(self, a, b) -> PrefixDivergence:
        return self.engine.explain_prefix(a, b)


def generate(params: ModelParams, prompts, config: EngineConfig | None = None,
             sampling_params: SamplingParams | list[SamplingParams] | None = None, tokenizer=None,
             use_tqdm: bool = False) -> list[RequestOutput]:
    """Functional form: a fresh engine (pool) over ``params``; compiled steps are reused across calls.
    Text prompts need ``tokenizer=jaxpaged.load_tokenizer(path)``."""
    engine = LLMEngine(params, config, tokenizer)
    return run_to_completion(engine, prompts, sampling_params, use_tqdm)
