"""LLMEngine: the loop over one model and one paged KV pool (entry points for users: ``llm.py``).

One engine owns one KV pool (one ``[L, num_blocks, block_size, 2, Hkv, D]`` array on the device), the
host-side ``KVCacheManager`` that hands out its blocks, the ``Scheduler`` and the jitted step. Each
``step()``: schedule -> build padded inputs -> run the donated step -> append tokens, cache full
blocks, free finished requests.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Sequence as SequenceT

import jax
import jax.numpy as jnp
import numpy as np

from .step_inputs import MIN_SEQS, MIN_TOKENS, PLACEHOLDER, bucket, build_step_inputs, longest_first, padding_step_inputs
from ..config import EngineConfig
from ..kv import KVCacheManager, PrefixDivergence, explain_prefix
from .metrics import EngineMetrics, StepRecord
from ..models.checkpoint import ModelParams
from ..io.outputs import RequestOutput
from .heap import freeze_long_lived_heap
from ..models.ops import resolve_backend
from ..io.prompts import broadcast_sampling_params, parse_prompt, parse_prompts
from ..io.output_processor import OutputProcessor, RequestState, make_detokenizer
from ..kv.pool_size import check_pool, size_pool
from .readback import make_token_reader
from .model_runner import DEFAULT_COMPILER_OPTIONS, ModelRunner, enable_compilation_cache
from ..sampling.sampler import SamplingParams
from ..sampling.params import RequestOutputKind
from ..sampling.features import prompt_logprob_positions
from .scheduler import Scheduler
from ..models.sharding import kv_bytes_per_token_per_device, make_kv_pool, params_tp
from .sequence import Sequence

log = logging.getLogger(__name__)


def get_runner(params: ModelParams, backend: str, batch_invariant: bool = False,
               compiler_options: tuple | None = None, decode_gemv: bool = True,
               fused_qkv: bool = True, fuse_matmul_inputs: bool = False, fused_residual: bool = True,
               step_executables: int = 1, cublas_max_tokens: int = 0,
               cudagraph_max_tokens: int | None = None, fused_sampler: bool = True) -> ModelRunner:
    """One runner (one jitted step, its compiled shapes) per weights object, backend and numerics mode.

    Kept in ``params.derived``, so engines over the same weights share compiled steps, and dropping
    the weights releases the runner (and its executables) with them.
    """
    options = DEFAULT_COMPILER_OPTIONS if compiler_options is None else tuple(compiler_options)
    key = ("runner", resolve_backend(backend), batch_invariant, options, decode_gemv, fused_qkv, fuse_matmul_inputs,
           fused_residual, step_executables, cublas_max_tokens, cudagraph_max_tokens, fused_sampler)
    if key not in params.derived:
        params.derived[key] = ModelRunner(params.graphdef, backend, batch_invariant, dict(options), mesh=params.mesh,
                                          decode_gemv=decode_gemv, fused_qkv=fused_qkv,
                                          fuse_matmul_inputs=fuse_matmul_inputs, fused_residual=fused_residual,
                                          step_executables=step_executables, cublas_max_tokens=cublas_max_tokens,
                                          cudagraph_max_tokens=cudagraph_max_tokens, fused_sampler=fused_sampler)
    return params.derived[key]


DEFAULT_CUBLAS_MAX_TOKENS = 512  # EngineConfig.cublas_max_tokens on a GPU


def default_cublas_max_tokens(config: EngineConfig) -> int:
    """``config.cublas_max_tokens``, or its default: 512 on a GPU, 0 on a CPU or with ``batch_invariant``."""
    if config.cublas_max_tokens is not None:
        return config.cublas_max_tokens
    if config.batch_invariant or jax.default_backend() != "gpu":
        return 0
    return DEFAULT_CUBLAS_MAX_TOKENS


def detokenize_token(seq: Sequence) -> str | None:
    """The scheduler's per-token hook: grows the detokenized text, returns a stop string it ended on."""
    d = seq.detokenizer
    return None if d is None else d.add_token(seq.token_ids)


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
        if config.max_model_len is None and self.num_blocks * config.block_size < self.max_model_len:
            # The default max_model_len does not fit the pool (a small CPU host): use what fits.
            self.max_model_len = self.num_blocks * config.block_size
        check_pool(self.num_blocks, config.block_size, self.max_model_len)
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
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   scheduling_policy=config.scheduling_policy)
        self.kv_pool = make_kv_pool(params, self.num_blocks, config.block_size, self.kv_dtype)
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %.2f GiB %s; max_model_len %d", self.num_blocks,
                 config.block_size, self.num_blocks * config.block_size,
                 self.num_blocks * config.block_size * self.bytes_per_token / 2**30, self.kv_dtype, self.max_model_len)
        self.compilation_cache_dir = enable_compilation_cache() if config.compilation_cache else None
        self.min_token_bucket = config.min_token_bucket or (1 if jax.default_backend() == "gpu" else MIN_TOKENS)
        self.runner = get_runner(params, config.attention_backend, config.batch_invariant, config.compiler_options,
                                 config.decode_gemv, config.fused_qkv, config.fuse_matmul_inputs, config.fused_residual,
                                 config.step_executables or (2 if jax.default_backend() == "gpu" else 1),
                                 default_cublas_max_tokens(config), config.max_cudagraph_capture_size,
                                 config.fused_sampler)
        # Compilations are counted per engine: steps compiled by an earlier engine are not ours.
        self._compile_base = (self.runner.compile_seconds, self.runner.num_compiled_shapes)
        # Pallas reads block tables only up to each kv_len: one fixed width, fewer compilations.
        max_blocks = -(-self.max_model_len // config.block_size)
        self._table_width = bucket(max_blocks, 1) if self.runner.attention_backend == "pallas" else None
        self.metrics = EngineMetrics()
        self._rng = np.random.default_rng(config.seed)
        self._next_id = 0
        self._requests: dict[str, RequestState] = {}  # unfinished user requests by id
        self._aborted: list[RequestState] = []  # aborted since the last step (their outputs are due)
        self._num_feature_requests = 0  # unfinished requests using penalties / min_p / logprobs / ...
        self._outputs = OutputProcessor(tokenizer)
        self.scheduler.on_token = detokenize_token  # a plain function: no cycle back to the engine
        # Async scheduling: the step in flight (its placeholders) and its device output.
        self._pending: tuple | None = None  # (samples, tokens, aux, prompt logprob rows)
        self._pending_rows: dict[Sequence, int] | None = None  # keyed by identity (Sequence has no __eq__)
        self._prev_tokens = jnp.zeros(bucket(config.max_num_seqs, MIN_SEQS), jnp.int32)
        # Token buffers whose values are read back (or never needed): each step writes its tokens into
        # one of them (donated; ``ModelRunner.step``: a fresh output buffer each step moved the CUDA
        # graph's temporaries). Two made here, so no step allocates one, the first or after an idle step.
        self._free_tokens: list[jax.Array] = [jnp.zeros_like(self._prev_tokens) for _ in range(2)]
        # How sampled tokens reach the host (readback.py): jax's np.asarray, or a stream-ordered copy.
        readback = config.token_readback if config.tensor_parallel_size == 1 else "jax"
        self.token_readback, self._read_tokens = make_token_reader(readback, jax.local_devices()[0],
                                                                   self._prev_tokens.shape[0])

    # ---- requests ------------------------------------------------------------------------------
    def _tokenize(self, prompt, rid: str) -> tuple[str | None, list[int]]:
        p = parse_prompt(prompt, f"request {rid!r}")
        if p.token_ids is not None:
            return p.text, p.token_ids
        if self.tokenizer is None:
            raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer; pass token ids instead")
        return p.text, self.tokenizer.encode(p.text)

    def _new_request_id(self) -> str:
        while str(self._next_id) in self._requests:  # never take an id a user chose
            self._next_id += 1
        rid = str(self._next_id)
        self._next_id += 1
        return rid

    def _prepare(self, prompt, sampling_params, request_id: str | None, cache_salt=None,
                 reserved: set[str] = frozenset()) -> RequestState:
        """Checks one request completely (``TypeError`` / ``ValueError`` naming it) without queueing it."""
        rid = self._new_request_id() if request_id is None else request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {type(rid).__name__} {rid!r}")
        if rid in self._requests or rid in reserved:
            raise ValueError(f"request id {rid!r} is already in use")
        try:
            sp = SamplingParams.from_optional(sampling_params)
            sp.validate()
        except (TypeError, ValueError) as err:
            raise type(err)(f"request {rid!r}: {err}") from None
        text, ids = self._tokenize(prompt, rid)
        if not ids:
            raise ValueError(f"request {rid!r}: prompt is empty")
        vocab = self.params.config.vocab_size
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab] if min(ids) < 0 or max(ids) >= vocab else []
        if bad:
            raise ValueError(f"request {rid!r}: prompt token id {bad[0][1]} at position {bad[0][0]} is outside "
                             f"the vocabulary [0, {vocab})")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1 or len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = "
                             f"{len(ids) + max_tokens} exceeds max_model_len ({self.max_model_len})")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(ids) + max_tokens > budget:
            # Without chunking a prompt (or, after a preemption, prompt + output) is computed in one
            # step, so it must fit the step's token budget or it would never be scheduled.
            raise ValueError(f"request {rid!r}: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = "
                             f"{len(ids) + max_tokens} exceeds max_num_batched_tokens ({budget}), and "
                             f"chunked prefill is off: enable it, raise the budget or shorten the request")
        for name in ("stop_token_ids",):
            bad_ids = [t for t in getattr(sp, name) or () if t >= vocab]
            if bad_ids:
                raise ValueError(f"request {rid!r}: SamplingParams.{name} holds {bad_ids[0]}, outside the "
                                 f"vocabulary [0, {vocab})")
        if sp.min_tokens > max_tokens:
            raise ValueError(f"request {rid!r}: SamplingParams.min_tokens ({sp.min_tokens}) must be <= max_tokens "
                             f"({max_tokens})")
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"request {rid!r}: stop strings need a tokenizer (use stop_token_ids)")
        state = RequestState(rid, text, ids, sp)
        if sp.prompt_logprobs is not None:
            # Cached prompt blocks would skip their logprobs (vLLM: such requests do not read the
            # prefix cache): a private cache root, so only this request's own blocks can hit.
            cache_salt = ("prompt_logprobs", rid, cache_salt)
        for i in range(sp.n):
            # A private PRNG stream per sample: seed + i (vLLM), or a fresh engine draw.
            seed = sp.seed + i if sp.seed is not None else int(self._rng.integers(0, 2**31 - 1))
            child_sp = copy.copy(sp)  # (sp is validated: no second validation, part of every TTFT)
            child_sp.n, child_sp.seed, child_sp.max_tokens = 1, seed, max_tokens
            seq = Sequence(rid if sp.n == 1 else f"{i}_{rid}", ids, sampling_params=child_sp, cache_salt=cache_salt)
            seq.parent, seq.index = state, i
            seq.detokenizer = make_detokenizer(self.tokenizer, child_sp, len(ids))
            if sp.logprobs is not None:
                seq.logprobs = []
            if sp.prompt_logprobs is not None:
                seq.prompt_logprobs = {}
            state.seqs.append(seq)
        state.sent_tokens, state.sent_chars, state.sent_finished = [0] * sp.n, [0] * sp.n, [False] * sp.n
        return state

    def _queue(self, state: RequestState) -> str:
        self._requests[state.request_id] = state
        # (counted from a sample's params: a private copy, so a user mutating theirs cannot skew it)
        self._num_feature_requests += state.seqs[0].sampling_params.uses_device_features
        for seq in state.seqs:  # the n samples of a prompt arrive together: the first computes the prompt,
            self.scheduler.add(seq)  # the others wait one step and take its blocks from the prefix cache
        return state.request_id

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Validates and queues one request; raises ``TypeError`` / ``ValueError`` naming the request
        and the field. A rejected request leaves the engine untouched: everything queued keeps running.

        ``prompt``: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
        """
        return self._queue(self._prepare(prompt, sampling_params, request_id, cache_salt))

    def add_requests(self, prompts, sampling_params=None) -> list[str]:
        """Checks every prompt first, then queues them all: a bad one leaves nothing queued."""
        parsed = parse_prompts(prompts)
        sps = broadcast_sampling_params(sampling_params, len(parsed), SamplingParams)
        states, reserved = [], set()
        for i, (p, sp) in enumerate(zip(parsed, sps)):
            prompt = p.text if p.token_ids is None else p.token_ids
            try:
                state = self._prepare(prompt, sp, None, reserved=reserved)
            except (TypeError, ValueError) as err:
                raise type(err)(f"prompt {i}: {err}") from None
            reserved.add(state.request_id)
            states.append(state)
        return [self._queue(st) for st in states]

    def abort_request(self, request_id: str) -> None:
        """Withdraws a queued or running request (all its samples), releasing its blocks. The next
        ``step()`` returns its output with ``finish_reason == "abort"``."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        state = self._requests.pop(request_id)
        self._num_feature_requests -= state.seqs[0].sampling_params.uses_device_features
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq)
            if seq.token_ids[-1] == PLACEHOLDER:  # its token is still on the device: drop it
                seq.token_ids.pop()
                seq.finish_reason = "abort"  # (also tells resolve() to skip it)
        self._aborted.append(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._pending is not None or bool(self._aborted)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine iteration; returns the outputs it produced: finished requests, aborted
        ones, and, for requests that stream (``output_kind`` CUMULATIVE / DELTA), new tokens.

        With ``async_scheduling`` the step is dispatched before the previous step's tokens are read
        back: the device fills the placeholder tokens in from the previous output, and the host's
        scheduling and bookkeeping overlap the device's work. Outputs are the same either way.
        """
        t0 = time.perf_counter()
        aborted, self._aborted = self._aborted, []
        outputs = [o for o in map(self._outputs.make_output, aborted) if o is not None]
        scheduled = self.scheduler.schedule()
        if not scheduled:
            touched = self._resolve_pending()
            if not touched and not aborted and self.scheduler.has_unfinished():
                raise RuntimeError("no request could be scheduled although some are waiting (pool exhausted)")
            return outputs + self._make_outputs(touched)
        if self.config.longest_first and len(scheduled) > 1:
            scheduled = longest_first(scheduled)
        now = time.monotonic()
        for seq, _ in scheduled:
            state = seq.parent
            if state.first_scheduled is None:
                state.first_scheduled = now
                state.num_cached_tokens = seq.num_cached_tokens
        num_decode = sum(1 for seq, n in scheduled if n == 1 and len(seq.token_ids) > seq.num_prompt_tokens)
        num_tokens = sum(n for _, n in scheduled)
        inputs = build_step_inputs(scheduled, self.kv.tables, self.config.block_size, width=self._table_width,
                                   max_seqs=self.config.max_num_seqs, prev_rows=self._pending_rows,
                                   eos_token_ids=self.params.config.eos_token_id,
                                   maybe_features=self._num_feature_requests > 0,
                                   min_tokens=self.min_token_bucket)
        prompt_rows = prompt_logprob_positions(scheduled) if inputs.features.prompt_logprobs >= 0 else []
        t1 = time.perf_counter()
        tokens, self.kv_pool = self.runner.step(self.params.state, self.kv_pool, inputs, self._prev_tokens,
                                                self._take_free_tokens())
        aux = None
        if isinstance(tokens, tuple):  # a logprobs variant: (tokens, aux arrays)
            tokens, aux = tokens
        if self.config.async_scheduling:
            if self.token_readback == "jax":
                tokens.copy_to_host_async()  # the read-back starts as soon as the step ends, not when asked
            touched = self._resolve_pending()  # the previous step's tokens: ready, or nearly
            t2 = time.perf_counter()
            outputs += self._make_outputs(touched)  # before advance() books new placeholders
            samples = self.scheduler.advance(scheduled)
            self._pending = (samples, tokens, aux, prompt_rows)
            self._pending_rows = {seq: row for row, seq, _ in samples}
            self._prev_tokens = tokens
        else:
            host_tokens = self._read_tokens(tokens)[: len(scheduled)]
            self._free_tokens.append(tokens)
            t2 = time.perf_counter()
            samples = [(row, seq, len(seq.token_ids)) for row, (seq, n) in enumerate(scheduled)
                       if seq.num_computed_tokens + n == len(seq.token_ids)]
            finished = self.scheduler.postprocess(scheduled, host_tokens)
            del finished  # every finished sequence sampled in this step: it is in ``samples``
            self._record_logprobs(samples, aux, prompt_rows)
            outputs += self._make_outputs([seq for _, seq, _ in samples])
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
        return outputs

    def _take_free_tokens(self) -> jax.Array | None:
        """A read-back token buffer for the next step's output, never the one the step reads its
        placeholders from (``_prev_tokens``, also read back when a step scheduled nothing)."""
        for i, buf in enumerate(self._free_tokens):
            if buf is not self._prev_tokens:
                return self._free_tokens.pop(i)
        return None  # (not reached: two buffers and at most one is the feedback)

    def _resolve_pending(self) -> list[Sequence]:
        """Reads back the step in flight (async scheduling) and fills its placeholder tokens. Returns
        the sequences that got a token."""
        if self._pending is None:
            return []
        samples, tokens, aux, prompt_rows = self._pending
        self._pending, self._pending_rows = None, None
        self._free_tokens.append(tokens)  # (read back below, or never needed)
        if not samples and not prompt_rows:
            return []
        self.scheduler.resolve(samples, self._read_tokens(tokens))
        live = [(row, seq, pos) for row, seq, pos in samples if seq.finish_reason != "abort"]
        self._record_logprobs(live, aux, [r for r in prompt_rows if r[1].finish_reason != "abort"])
        return [seq for _, seq, _ in live]

    def _record_logprobs(self, samples, aux, prompt_rows) -> None:
        """Keeps the logprobs of the sampled tokens (``samples``: ``(row, seq, _)``) and of prompt
        positions (``prompt_rows``: ``(row, seq, position)``, in the step's order)."""
        if aux is None:
            return
        if "logprobs" in aux and samples:
            lp = {k: np.asarray(v) for k, v in aux["logprobs"].items()}
            for row, seq, _ in samples:
                if seq.logprobs is not None:
                    seq.logprobs.append((float(lp["token"][row]), int(lp["rank"][row]), lp["ids"][row], lp["values"][row]))
        if "prompt_logprobs" in aux and prompt_rows:
            plp = {k: np.asarray(v) for k, v in aux["prompt_logprobs"].items()}
            for j, (_, seq, pos) in enumerate(prompt_rows):
                seq.prompt_logprobs.setdefault(pos, (float(plp["token"][j]), int(plp["rank"][j]), plp["ids"][j],
                                                     plp["values"][j]))

    def _make_outputs(self, touched: list[Sequence]) -> list[RequestOutput]:
        """Outputs for the requests whose sequences got tokens or finished this step, in order."""
        outs, seen = [], set()
        final_only = RequestOutputKind.FINAL_ONLY
        for seq in touched:
            if seq.sampling_params.output_kind is final_only and not seq.is_finished:
                continue  # the common case: nothing to send until this sample ends (O(1), no lookups)
            state = seq.parent
            if id(state) in seen or state.request_id not in self._requests or self._requests[state.request_id] is not state:
                continue
            seen.add(id(state))
            out = self._outputs.make_output(state)
            if out is not None:
                outs.append(out)
            if state.finished:
                del self._requests[state.request_id]
                self._num_feature_requests -= state.seqs[0].sampling_params.uses_device_features
        return outs

    def warmup(self, use_tqdm: bool = True, freeze_gc: bool = True) -> float:
        """Compiles the step for every token bucket up to ``max_num_batched_tokens`` ahead of time.

        Runs each shape once on an all-padding batch (no sequence, every slot -1: nothing is written
        or read). Returns the seconds spent. On the Pallas backend later steps then never stop to
        compile; the jnp reference backend pads block tables per step, so it still compiles new widths.
        ``freeze_gc``: then moves the process's long-lived objects out of the cyclic garbage
        collector's reach (``heap.freeze_long_lived_heap``), so a full collection in the middle of a
        workload takes milliseconds, not most of a second.
        """
        max_blocks = -(-self.max_model_len // self.config.block_size)
        width = self._table_width or bucket(max_blocks, 1)
        sizes = []
        t = self.min_token_bucket
        s_max = bucket(self.config.max_num_seqs, MIN_SEQS)
        while t < bucket(self.config.max_num_batched_tokens, self.min_token_bucket) * 2:
            sizes.append(t)
            t *= 2
        t0 = time.perf_counter()
        it = sizes
        if use_tqdm:
            from tqdm.auto import tqdm

            it = tqdm(sizes, desc="compile step buckets", unit="shape")
        for t_pad in it:
            inputs = padding_step_inputs(t_pad, min(t_pad, s_max), width)
            for _ in range(self.runner.num_copies(t_pad)):  # every copy of the step (runner docstring)
                tokens, self.kv_pool = self.runner.step(self.params.state, self.kv_pool, inputs,
                                                        jnp.zeros_like(self._prev_tokens))
                tokens.block_until_ready()
        if freeze_gc:
            freeze_long_lived_heap()
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
                 host_seconds=self.metrics.host_seconds, device_wait_seconds=self.metrics.device_seconds,
                 token_readback=self.token_readback)
        return s

    def explain_prefix(self, a: str | SequenceT[int], b: str | SequenceT[int]) -> PrefixDivergence:
        """The first block (and token) where two prompts diverge: why they share no more cached blocks."""
        _, ids_a = self._tokenize(a, "a")
        _, ids_b = self._tokenize(b, "b")
        return explain_prefix(ids_a, ids_b, self.config.block_size)
