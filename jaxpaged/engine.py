"""LLMEngine: the loop over one model and one paged KV pool (entry points for users: ``llm.py``).

One engine owns one KV pool (a tuple of per-layer ``(k_cache, v_cache)`` arrays on the device), the
host-side ``KVCacheManager`` that hands out its blocks, the ``Scheduler`` and the jitted step. Each
``step()``: schedule -> build padded inputs -> run the donated step -> append tokens, cache full
blocks, free finished requests.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence as SequenceT

import jax
import jax.numpy as jnp
import numpy as np

from .batch import MIN_SEQS, MIN_TOKENS, bucket, build_step_inputs, padding_step_inputs
from .config import EngineConfig
from .kv import KVCacheManager, PrefixDivergence, explain_prefix
from .metrics import EngineMetrics, StepRecord
from .models.checkpoint import ModelParams
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .kernels.backend import resolve_backend
from .runner import ModelRunner, enable_compilation_cache
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sharding import kv_bytes_per_token_per_device, make_kv_pool, params_tp
from .sequence import Sequence


def get_runner(params: ModelParams, backend: str, batch_invariant: bool = False) -> ModelRunner:
    """One runner (one jitted step, its compiled shapes) per weights object, backend and numerics mode.

    Kept in ``params.derived``, so engines over the same weights share compiled steps, and dropping
    the weights releases the runner (and its executables) with them.
    """
    key = ("runner", resolve_backend(backend), batch_invariant)
    if key not in params.derived:
        params.derived[key] = ModelRunner(params.graphdef, backend, batch_invariant, mesh=params.mesh)
    return params.derived[key]


def size_pool(params: ModelParams, config: EngineConfig, max_model_len: int, dtype: str) -> int:
    """Blocks in the pool: ``num_blocks`` if given, else ``memory_fraction`` of free device memory
    (with tensor parallelism: of the device with the least free memory, per device's share of a block)."""
    bs = config.block_size
    block_bytes = kv_bytes_per_token_per_device(params, jnp.dtype(dtype).itemsize) * bs
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    else:
        devices = [jax.devices()[0]] if params.mesh is None else \
            [d for d in params.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = min((d.memory_stats() or {} for d in devices),
                    key=lambda st: st.get("bytes_limit", 0) - st.get("bytes_in_use", 0))
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            num_blocks = int(free * config.memory_fraction // block_bytes)
        else:  # CPU: no allocator statistics; enough for a modest batch of full-length requests
            num_blocks = math.ceil(max_model_len / bs) * min(config.max_num_seqs, 16)
    if num_blocks * bs < max_model_len:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens: raise num_blocks / memory_fraction or "
            f"lower max_model_len")
    return num_blocks


class LLMEngine:
    """Continuous-batching engine over one model and one paged KV pool."""

    def __init__(self, params: ModelParams, config: EngineConfig | None = None, tokenizer=None):
        config = config or EngineConfig()
        self.params, self.config, self.tokenizer = params, config, tokenizer
        cfg = params.config
        if params_tp(params) != config.tensor_parallel_size:
            raise ValueError(f"EngineConfig(tensor_parallel_size={config.tensor_parallel_size}) but the weights "
                             f"were loaded for {params_tp(params)} device(s): load them with "
                             f"load_params(path, tensor_parallel_size={config.tensor_parallel_size})")
        self.kv_dtype = config.dtype or params.dtype  # the pool's dtype: the weights' unless set
        self.max_model_len = config.resolved_max_model_len(cfg.max_position_embeddings)
        self.num_blocks = size_pool(params, config, self.max_model_len, self.kv_dtype)
        # Over all devices (KV heads replicated when tp > num_key_value_heads count each time).
        self.bytes_per_token = params_tp(params) * kv_bytes_per_token_per_device(
            params, jnp.dtype(self.kv_dtype).itemsize)
        prefix_caching = config.enable_prefix_caching and config.reservation == "paged"
        self.kv = KVCacheManager(self.num_blocks, config.block_size, enable_prefix_caching=prefix_caching,
                                 reservation=config.reservation, max_model_len=self.max_model_len,
                                 event_log=config.event_log, bytes_per_token_slot=self.bytes_per_token)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, eos_token_ids=cfg.eos_token_id,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        self.kv_pool = make_kv_pool(params, self.num_blocks, config.block_size, self.kv_dtype)
        self.compilation_cache_dir = enable_compilation_cache() if config.compilation_cache else None
        self.runner = get_runner(params, config.attention_backend, config.batch_invariant)
        # Compilations are counted per engine: steps compiled by an earlier engine are not ours.
        self._compile_base = (self.runner.compile_seconds, self.runner.num_compiled_shapes)
        # Pallas reads block tables only up to each kv_len: one fixed width, fewer compilations.
        max_blocks = -(-self.max_model_len // config.block_size)
        self._table_width = bucket(max_blocks, 1) if self.runner.attention_backend == "pallas" else None
        self.metrics = EngineMetrics()
        self._rng = np.random.default_rng(config.seed)
        self._next_id = 0
        self._requests: dict[str, tuple[Sequence, str | None]] = {}
        self._first_cached: dict[str, int] = {}
        self._first_scheduled: dict[str, float] = {}
        # Async scheduling: the step in flight (its placeholders) and its device output.
        self._pending: tuple[list, jax.Array] | None = None
        self._pending_rows: dict[int, int] | None = None
        self._prev_tokens = jnp.zeros(bucket(config.max_num_seqs, MIN_SEQS), jnp.int32)

    # ---- requests ------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | SequenceT[int], rid: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def add_request(self, prompt: str | SequenceT[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Validates and queues one request; raises ``ValueError`` naming the request and the field.

        A rejected request leaves the engine untouched: everything already queued keeps running.
        """
        if request_id is None:
            while str(self._next_id) in self._requests:  # never take an id a user chose
                self._next_id += 1
            rid = str(self._next_id)
            self._next_id += 1
        else:
            rid = request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        sp = sampling_params if sampling_params is not None else SamplingParams()
        try:
            sp.validate()
        except ValueError as err:
            raise ValueError(f"request {rid!r}: {err}") from None
        text, ids = self._tokenize(prompt, rid)
        if not ids:
            raise ValueError(f"request {rid!r}: prompt is empty")
        vocab = self.params.config.vocab_size
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid!r}: prompt token id {bad[0][1]} at position {bad[0][0]} is outside "
                             f"the vocabulary [0, {vocab})")
        if len(ids) + sp.max_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{len(ids) + sp.max_tokens} exceeds max_model_len ({self.max_model_len})")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(ids) + sp.max_tokens > budget:
            # Without chunking a prompt (or, after a preemption, prompt + output) is computed in one
            # step, so it must fit the step's token budget or it would never be scheduled.
            raise ValueError(f"request {rid!r}: prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) = "
                             f"{len(ids) + sp.max_tokens} exceeds max_num_batched_tokens ({budget}), and "
                             f"chunked prefill is off: enable it, raise the budget or shorten the request")
        if sp.seed is None:  # a private stream, so batching never changes this request's samples
            sp = dataclasses.replace(sp, seed=int(self._rng.integers(0, 2**31 - 1)))
        seq = Sequence(rid, ids, sampling_params=sp, cache_salt=cache_salt)
        self._requests[rid] = (seq, text)
        self.scheduler.add(seq)
        return rid

    def abort_request(self, request_id: str) -> None:
        """Withdraws a queued or running request, releasing its blocks. Its output is never returned."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        seq, _ = self._requests.pop(request_id)
        self.scheduler.abort(seq)
        self._first_cached.pop(request_id, None)
        self._first_scheduled.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine iteration; returns the requests that finished in it.

        With ``async_scheduling`` the step is dispatched before the previous step's tokens are read
        back: the device fills the placeholder tokens in from the previous output, and the host's
        scheduling and bookkeeping overlap the device's work. Outputs are the same either way.
        """
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            finished = self._resolve_pending()
            if not finished and self.scheduler.has_unfinished():
                raise RuntimeError("no request could be scheduled although some are waiting (pool exhausted)")
            return [self._output(seq) for seq in finished]
        now = time.monotonic()
        for seq, _ in scheduled:
            if seq.request_id not in self._first_scheduled:
                self._first_scheduled[seq.request_id] = now
                self._first_cached[seq.request_id] = seq.num_cached_tokens
        num_decode = sum(1 for seq, n in scheduled if n == 1 and seq.num_output_tokens > 0)
        num_tokens = sum(n for _, n in scheduled)
        inputs = build_step_inputs(scheduled, self.kv.tables, self.config.block_size, width=self._table_width,
                                   max_seqs=self.config.max_num_seqs, prev_rows=self._pending_rows)
        t1 = time.perf_counter()
        tokens, self.kv_pool = self.runner.step(self.params.state, self.kv_pool, inputs, self._prev_tokens)
        if self.config.async_scheduling:
            finished = self._resolve_pending()  # the previous step's tokens: ready, or nearly
            t2 = time.perf_counter()
            samples = self.scheduler.advance(scheduled)
            self._pending = (samples, tokens)
            self._pending_rows = {id(seq): row for row, seq, _ in samples}
            self._prev_tokens = tokens
        else:
            host_tokens = np.asarray(tokens)[: len(scheduled)]
            t2 = time.perf_counter()
            finished = self.scheduler.postprocess(scheduled, host_tokens)
        self.metrics.host_seconds += t1 - t0
        self.metrics.device_seconds += t2 - t1
        kv = self.kv
        used = kv.num_used_blocks
        self.metrics.record(StepRecord(
            step=self.metrics.total_steps, num_seqs=len(scheduled), num_prefill_tokens=num_tokens - num_decode,
            num_decode_tokens=num_decode, num_padded_tokens=int(inputs.token_ids.shape[0]),
            blocks_used=used, blocks_cached=kv.num_cached_blocks,
            kv_bytes_in_use=used * self.config.block_size * self.bytes_per_token,
            block_utilisation=kv.block_utilisation(), seconds=time.perf_counter() - t0))
        self.metrics.host_seconds += time.perf_counter() - t2
        return [self._output(seq) for seq in finished]

    def _resolve_pending(self) -> list[Sequence]:
        """Reads back the step in flight (async scheduling) and fills its placeholder tokens."""
        if self._pending is None:
            return []
        samples, tokens = self._pending
        self._pending, self._pending_rows = None, None
        if not samples:
            return []
        return self.scheduler.resolve(samples, np.asarray(tokens))

    def _output(self, seq: Sequence) -> RequestOutput:
        rid = seq.request_id
        _, text = self._requests.pop(rid)
        out_ids = seq.output_token_ids
        out_text = self.tokenizer.decode(out_ids) if self.tokenizer is not None else ""
        return RequestOutput(
            request_id=rid, prompt=text, prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, out_text, out_ids, seq.finish_reason)], finished=True,
            num_cached_tokens=self._first_cached.pop(rid, 0),
            metrics=RequestMetrics(seq.arrival_time, self._first_scheduled.pop(rid, None),
                                   seq.first_token_time, seq.finish_time))

    def warmup(self, use_tqdm: bool = True) -> float:
        """Compiles the step for every token bucket up to ``max_num_batched_tokens`` ahead of time.

        Runs each shape once on an all-padding batch (no sequence, every slot -1: nothing is written
        or read). Returns the seconds spent. On the Pallas backend later steps then never stop to
        compile; the jnp reference backend pads block tables per step, so it still compiles new widths.
        """
        max_blocks = -(-self.max_model_len // self.config.block_size)
        width = self._table_width or bucket(max_blocks, 1)
        sizes = []
        t = MIN_TOKENS
        s_max = bucket(self.config.max_num_seqs, MIN_SEQS)
        while t < bucket(self.config.max_num_batched_tokens, MIN_TOKENS) * 2:
            sizes.append(t)
            t *= 2
        t0 = time.perf_counter()
        it = sizes
        if use_tqdm:
            from tqdm.auto import tqdm

            it = tqdm(sizes, desc="compile step buckets", unit="shape")
        for t_pad in it:
            inputs = padding_step_inputs(t_pad, min(t_pad, s_max), width)
            tokens, self.kv_pool = self.runner.step(self.params.state, self.kv_pool, inputs,
                                                    jnp.zeros_like(self._prev_tokens))
            tokens.block_until_ready()
        return time.perf_counter() - t0

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Memory manager counters, scheduler counters, compile time and pool geometry."""
        s = self.kv.stats().as_dict()
        s.update(dataclasses.asdict(self.scheduler.counters))
        s.update(num_blocks=self.num_blocks, block_size=self.config.block_size,
                 kv_dtype=str(self.kv_dtype), kv_pool_bytes=self.num_blocks * self.config.block_size * self.bytes_per_token,
                 kv_bytes_per_token=self.bytes_per_token, max_model_len=self.max_model_len,
                 compile_seconds=self.runner.compile_seconds - self._compile_base[0],
                 compiled_shapes=self.runner.num_compiled_shapes - self._compile_base[1],
                 attention_backend=self.runner.attention_backend, step_seconds=self.metrics.total_seconds,
                 host_seconds=self.metrics.host_seconds, device_wait_seconds=self.metrics.device_seconds)
        return s

    def explain_prefix(self, a: str | SequenceT[int], b: str | SequenceT[int]) -> PrefixDivergence:
        """The first block (and token) where two prompts diverge: why they share no more cached blocks."""
        _, ids_a = self._tokenize(a, "a")
        _, ids_b = self._tokenize(b, "b")
        return explain_prefix(ids_a, ids_b, self.config.block_size)
