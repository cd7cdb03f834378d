"""LLMEngine: the loop over one model and one paged KV pool (entry points for users: ``llm.py``).

One engine owns one KV pool (one ``[L, num_blocks, block_size, 2, Hkv, D]`` array on the device), the
host-side ``KVCacheManager`` that hands out its blocks, the ``Scheduler`` and the jitted step
(``ModelRunner``). Each ``step()`` is vLLM's schedule -> execute -> update:

    scheduled = scheduler.schedule()                  # which sequences, how many new tokens each
    inputs = build_step_inputs(scheduled, ...)        # padded arrays in one buffer
    tokens = runner.step(weights, kv_pool, inputs)    # one jitted call, pool donated (runs async)
    samples = scheduler.advance(scheduled)            # book it: placeholders for the tokens in flight
    resolve(previous step)  /  resolve(this step)     # async (default) / sync: fill tokens in, stop, output

With async scheduling the step is dispatched before the previous step's tokens are read back: the
device fills the placeholders in from the previous step's output, so the host schedules step N+1
while the device runs step N. Both modes share one bookkeeping path (advance, then resolve).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Sequence as SequenceT

import jax
import jax.numpy as jnp
import numpy as np

from ..config import EngineConfig
from ..io.output_processor import OutputProcessor, RequestState, make_detokenizer
from ..io.outputs import RequestOutput
from ..io.prompts import broadcast_sampling_params, parse_prompt, parse_prompts
from ..kv import KVCacheManager, PrefixDivergence, explain_prefix
from ..kv.host_tier import ReloadCost
from ..kv.kv_events import AllBlocksCleared
from ..models.checkpoint import ModelParams
from ..models.kv_pool import (bytes_per_token_slot, check_holds_one_sequence, check_kv_dtype, engine_pool_shape,
                              make_kv_pool, size_pool)
from ..models.attention_backends import choose_attention_backend, resolve_backend
from ..models.sharding import params_tp
from ..sampling import RequestOutputKind, SamplingParams
from ..sampling import grammar
from ..sampling.features import SamplerFeatures, build_row_inputs, padding_row_inputs, prompt_logprob_positions
from ..sampling.sampler import SAMPLING_MODES
from .executable_cache import ExecutableCache, cache_key
from .heap import freeze_long_lived_heap
from .kv_events import make_publisher
from .kv_transfer import KVTransfers
from .metrics import EngineMetrics, StepRecord
from .model_runner import ModelRunner, enable_compilation_cache
from .multihost import agreed_min
from .readback import make_token_reader
from .scheduler import Samples, ScheduledBatch, Scheduler
from ..request import PLACEHOLDER, WITHDRAWN, Sequence
from .step_inputs import MIN_SEQS, bucket, build_step_inputs, longest_first, padding_step_inputs
from .tuning import StepTuning

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (its KV pool was lost); every request it held is gone."""

WARMUP_RUNS = 3  # launches of each executable in a GPU warm-up (see warmup)
SETTLE_REQUESTS = 3  # throwaway requests that end a GPU warm-up (see settle)


def get_runner(params: ModelParams, backend: str, batch_invariant: bool = False,
               tuning: StepTuning | None = None) -> ModelRunner:
    """One runner (one jitted step, its compiled shapes) per weights object, backend, numerics mode and
    tuning. Kept in ``params.derived``, so engines over the same weights share compiled steps, and
    dropping the weights releases the runner (and its executables) with them."""
    tuning = tuning or StepTuning.default(batch_invariant)
    key = ("runner", resolve_backend(backend), batch_invariant, tuning)
    if key not in params.derived:
        params.derived[key] = ModelRunner(params.graphdef, backend, batch_invariant, mesh=params.mesh, tuning=tuning)
    return params.derived[key]


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose tokens the host has not read yet."""

    samples: Samples  # (row, sequence, index of its placeholder)
    tokens: jax.Array  # i32[R] on the device
    aux: dict | None  # logprob arrays of a logprobs variant
    prompt_rows: list  # (row, sequence, position) of prompt logprobs


class LLMEngine:
    """Continuous-batching engine over one model and one paged KV pool."""

    def __init__(self, params: ModelParams, config: EngineConfig | None = None, tokenizer=None, *,
                 tuning: StepTuning | None = None):
        """``tuning``: the step's internal tuning (benchmarks only; default: measured per device)."""
        config = config or EngineConfig()
        cfg = params.config
        config = dataclasses.replace(config, block_size=config.resolved_block_size(cfg.head_dim))
        self.params, self.config, self.tokenizer = params, config, tokenizer
        if params_tp(params) != config.tensor_parallel_size:
            raise ValueError(f"EngineConfig(tensor_parallel_size={config.tensor_parallel_size}) but the weights "
                             f"were loaded for {params_tp(params)} device(s): load them with "
                             f"load_params(path, tensor_parallel_size={config.tensor_parallel_size})")
        if config.quantization is not None and params.quantization is None:
            raise ValueError(f"EngineConfig(quantization={config.quantization!r}) but the weights are not quantized: "
                             f"load them with load_params(path, quantization={config.quantization!r})")
        self.kv_dtype = config.resolved_kv_cache_dtype(params.dtype)
        backend = choose_attention_backend(config.attention_backend, self.kv_dtype, config.batch_invariant,
                                           cfg.head_dim, config.block_size, params.dtype, params_tp(params))
        check_kv_dtype(config.kv_cache_dtype, self.kv_dtype, config.block_size, cfg.head_dim)
        self.max_model_len = config.resolved_max_model_len(cfg.max_position_embeddings)
        self.num_blocks = size_pool(params, config, self.max_model_len, self.kv_dtype)
        # Over several processes the pool is one array on all of them: the size every process can hold.
        self.num_blocks = agreed_min(self.num_blocks)
        if (config.max_model_len is None and 0 < self.num_blocks * config.block_size < self.max_model_len
                and jax.default_backend() == "cpu"):
            # The default max_model_len does not fit a small CPU host's pool: use what fits. On a GPU a pool
            # that small is an error naming the settings (check_holds_one_sequence), as in vLLM.
            self.max_model_len = self.num_blocks * config.block_size
        check_holds_one_sequence(self.num_blocks, config.block_size, self.max_model_len)
        self.bytes_per_token = bytes_per_token_slot(params, config.block_size, self.kv_dtype)  # all devices
        prefix_caching = config.enable_prefix_caching and config.reservation == "paged"
        # The host tier: as many blocks as kv_offloading_size holds (none if it holds less than one).
        num_host_blocks = int(config.kv_offloading_size * 2**30 // (config.block_size * self.bytes_per_token))
        self.kv = KVCacheManager(self.num_blocks, config.block_size, enable_prefix_caching=prefix_caching,
                                 reservation=config.reservation, max_model_len=self.max_model_len,
                                 event_log=config.event_log, bytes_per_token_slot=self.bytes_per_token,
                                 num_host_blocks=num_host_blocks,
                                 kv_events=config.kv_events_config is not None and config.kv_events_config.enabled)
        # KV-cache events for routers: each step's prefix-cache changes, published by a thread of their own.
        self.kv_event_publisher = make_publisher(config.kv_events_config, config.data_parallel_rank)
        if self.kv_event_publisher is not None:  # a router's view of an engine that (re)starts: empty
            self.kv_event_publisher.publish([AllBlocksCleared()])
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, eos_token_ids=cfg.eos_token_id,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   scheduling_policy=config.scheduling_policy)
        self.compilation_cache_dir = enable_compilation_cache() if config.compilation_cache else None
        self.runner = get_runner(params, backend.name, config.batch_invariant, tuning)
        if self.compilation_cache_dir and self.runner.executable_cache is None and params.mesh is None:
            key = cache_key(params.config, params.dtype, str(jax.tree.structure(params.state)),
                            self.runner.attention_backend, config.batch_invariant, self.runner.tuning)
            self.runner.executable_cache = ExecutableCache(Path(self.compilation_cache_dir + "-steps") / key)
        self.min_token_bucket = self.runner.tuning.min_token_bucket
        # Compilations are counted per engine: steps compiled by an earlier engine are not ours.
        self._compile_base = (self.runner.compile_seconds, self.runner.num_compiled_shapes)
        # Block tables of one fixed width (enough for max_model_len) where the backend reads them only up to
        # each kv_len, so a token bucket is one shape; else padded per step (None), a new width compiling
        # on first use.
        self._max_width = bucket(-(-self.max_model_len // config.block_size), 1)
        self._table_width = self._max_width if backend.fixed_table_width else None
        # Decode steps as steps of their own where the backend runs them on a kernel of their own.
        self._uniform_decode = backend.decode_steps_apart(self.kv_dtype)
        if jax.default_backend() == "gpu":
            # The warm-up's executables are read from disk while the pool's memory is mapped (seconds for
            # a pool of most of the GPU); the pool is still made before anything else can allocate.
            self._preload_warmup()
        self.kv_pool = make_kv_pool(params, self.num_blocks, config.block_size, self.kv_dtype)
        self.kv_transfers = KVTransfers(self.kv_pool, num_host_blocks) if self.kv.host is not None else None
        if config.kv_offloading_size:
            log.info("KV host tier: %d blocks, %.2f GiB", num_host_blocks,
                     num_host_blocks * config.block_size * self.bytes_per_token / 2**30)
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %.2f GiB %s; max_model_len %d", self.num_blocks,
                 config.block_size, self.num_blocks * config.block_size,
                 self.num_blocks * config.block_size * self.bytes_per_token / 2**30, self.kv_dtype, self.max_model_len)
        self.metrics = EngineMetrics()
        self.warmup_profile: dict = {}  # where the last warm-up's time went (``warmup``)
        self.reload_cost: ReloadCost | None = None  # the host tier's, measured at a GPU warm-up
        self._rng = np.random.default_rng(config.seed)
        self._next_id = 0
        self._requests: dict[str, RequestState] = {}  # unfinished user requests by id
        self._aborted: list[RequestState] = []  # aborted since the last step (their outputs are due)
        self._num_feature_requests = 0  # unfinished requests using penalties / min_p / logprobs / ...
        self._grammars: grammar.GrammarCompiler | None = None  # structured outputs' compiler (made on first use)
        self._compiling: list[RequestState] = []  # queued requests whose grammar may still be compiling
        self._outputs = OutputProcessor(tokenizer)
        # Async scheduling: the step in flight and the rows of its placeholders (by sequence identity).
        self._in_flight: InFlight | None = None
        self._pending_rows: dict[Sequence, int] | None = None
        # Token buffers are committed to the device, as every step's output is: jit compiles a separate
        # executable for an uncommitted argument, which would make the first real step compile again.
        self._prev_tokens = self.runner.token_buffer(bucket(config.max_num_seqs, MIN_SEQS))
        # Token buffers whose values are read back (or never needed): each step writes its tokens into
        # one of them (donated; ``ModelRunner.step``: a fresh output buffer each step moved the CUDA
        # graph's temporaries). Two made here, so no step allocates one, the first or after an idle step.
        self._free_tokens: list[jax.Array] = [self.runner.token_buffer(self._prev_tokens.shape[0]) for _ in range(2)]
        # How sampled tokens reach the host (readback.py): a stream-ordered copy on one GPU, else jax's.
        self.token_readback, self._read_tokens = make_token_reader(
            jax.local_devices()[0], self._prev_tokens.shape[0], stream=config.tensor_parallel_size == 1)

    # ---- requests ------------------------------------------------------------------------------
    def _tokenize(self, prompt, rid: str) -> tuple[str | None, list[int]]:
        p = parse_prompt(prompt, f"request {rid!r}")
        if p.token_ids is not None:
            return p.text, p.token_ids
        if self.tokenizer is None:
            raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer; pass token ids instead")
        return p.text, self.tokenizer.encode(p.text)

    def _next_request_id(self, reserved: set[str]) -> str:
        """The next free automatic id (not yet taken: ``_queue`` takes it, so a refused request uses none)."""
        n = self._next_id
        while str(n) in self._requests or str(n) in reserved:  # never take an id a user chose
            n += 1
        return str(n)

    def _prepare(self, prompt, sampling_params, request_id: str | None, cache_salt=None,
                 reserved: set[str] = frozenset()) -> RequestState:
        """Checks one request completely (``TypeError`` / ``ValueError`` naming it) without queueing it."""
        rid = self._next_request_id(reserved) if request_id is None else request_id
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
        compiled = None
        if sp.structured_outputs is not None:  # compiled in the compiler's threads (cached by its text)
            try:
                compiled = self.grammar_compiler().submit(sp.structured_outputs)
            except ValueError as err:
                raise ValueError(f"request {rid!r}: {err}") from None
            if compiled.done() and compiled.exception() is not None:  # (known to fail: the cache)
                raise ValueError(f"request {rid!r}: {compiled.exception()}")
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
            if compiled is not None:
                seq.structured = grammar.StructuredState(compiled)  # (a matcher of its own per sample)
            state.seqs.append(seq)
        state.sent_tokens, state.sent_chars, state.sent_finished = [0] * sp.n, [0] * sp.n, [False] * sp.n
        return state

    def _queue(self, state: RequestState, auto_id: bool) -> str:
        if auto_id:  # taken only now: a refused request leaves the next id free
            self._next_id = int(state.request_id) + 1
        self._requests[state.request_id] = state
        # (counted from a sample's params: a private copy, so a user mutating theirs cannot skew it)
        self._num_feature_requests += state.seqs[0].sampling_params.uses_device_features
        if state.seqs[0].structured is not None and not state.seqs[0].structured.ready:
            self._compiling.append(state)
        for seq in state.seqs:  # the n samples of a prompt arrive together: the first computes the prompt,
            self.scheduler.add(seq)  # the others wait one step and take its blocks from the prefix cache
        return state.request_id

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Validates and queues one request; raises ``TypeError`` / ``ValueError`` naming the request
        and the field. A rejected request leaves the engine untouched: everything queued keeps running.

        ``prompt``: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
        """
        return self._queue(self._prepare(prompt, sampling_params, request_id, cache_salt), request_id is None)

    def grammar_compiler(self) -> grammar.GrammarCompiler:
        """The compiler of structured outputs' grammars for this model's tokenizer (made on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            self._grammars = grammar.GrammarCompiler(self.tokenizer.to_json(), self.params.config.vocab_size,
                                                     self.params.config.eos_token_id)
        return self._grammars

    def add_requests(self, prompts, sampling_params=None) -> list[str]:
        """Checks every prompt first, then queues them all: a bad one leaves nothing queued (a grammar
        of a structured output is compiled first, all of them at once: one that cannot be compiled is
        a ``ValueError`` naming its field)."""
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
        for i, state in enumerate(states):
            structured = state.seqs[0].structured
            if structured is not None and structured.grammar.exception() is not None:  # (waits for it)
                raise ValueError(f"prompt {i}: request {state.request_id!r}: {structured.grammar.exception()}")
        return [self._queue(st, True) for st in states]

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """Withdraws a queued or running request (all its samples), releasing its blocks. The next
        ``step()`` returns its output with ``finish_reason == reason`` ("abort"; "error" for a request
        that failed)."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        state = self._requests.pop(request_id)
        self._num_feature_requests -= state.seqs[0].sampling_params.uses_device_features
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq, reason)
            if seq.token_ids[-1] == PLACEHOLDER:  # its token is still on the device: drop it
                seq.token_ids.pop()
                seq.finish_reason = reason  # (also tells resolve() to skip it)
        self._aborted.append(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._aborted)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine iteration; returns the outputs it produced: finished requests, aborted
        ones, and, for requests that stream (``output_kind`` CUMULATIVE / DELTA), new tokens.

        A failure belongs to the requests it came from, not to the engine: a request whose step
        inputs cannot be built ends with ``finish_reason == "error"`` and the step runs without it; a
        step that fails as a whole ends every request it held (and the one in flight) the same way,
        and the engine goes on. Only a failure that lost the KV pool (donated to a step that did not
        return it) stops the engine: ``EngineDeadError``."""
        self._step_scheduled: ScheduledBatch = []
        self._step_in_flight = self._in_flight
        try:
            return self._step()
        except Exception as err:  # noqa: BLE001  (turned into errors of the requests it touched)
            return self._fail_step(err)
        finally:
            if self.kv_event_publisher is not None:  # the step's prefix-cache changes, one batch
                events = self.kv.take_kv_events()
                if events:
                    self.kv_event_publisher.publish(events)

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        aborted, self._aborted = self._aborted, []
        outputs = [o for o in map(self._outputs.make_output, aborted) if o is not None]
        if self._compiling:
            outputs += self._check_compiling()
        scheduled = self.scheduler.schedule()
        if self.kv_transfers is not None:  # offloads of evicted blocks, reloads of host hits: before the step
            transfers = self.kv.take_transfers()
            if transfers:
                self.kv_pool = self.kv_transfers.run(self.kv_pool, transfers)
        if not scheduled:
            if self.kv_transfers is not None:
                self.kv_transfers.finish_offloads()
            touched = self._resolve(self._in_flight)
            if not touched and self._compiling:  # only grammars compiling: wait for one (briefly)
                concurrent.futures.wait([st.seqs[0].structured.grammar for st in self._compiling], timeout=0.01,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            elif not touched and not aborted and self.scheduler.has_unfinished():
                raise RuntimeError("no request could be scheduled although some are waiting (pool exhausted)")
            return outputs + self._make_outputs(touched)
        scheduled = longest_first(scheduled)  # the longest KV reads launch first (same results)
        self._step_scheduled = scheduled
        inputs, scheduled, failed = self._build_inputs_isolating(scheduled)
        outputs += failed
        if inputs is None:  # every request of the step failed
            return outputs
        self._step_scheduled = scheduled
        num_decode = sum(1 for seq, n in scheduled if n == 1 and len(seq.token_ids) > seq.num_prompt_tokens)
        t1 = time.perf_counter()
        tokens, self.kv_pool = self.runner.step(self.params.state, self.kv_pool, inputs, self._prev_tokens,
                                                self._take_free_tokens())
        tokens, aux = tokens if isinstance(tokens, tuple) else (tokens, None)  # (a logprobs variant: aux arrays)
        constrained = inputs.features.constrained
        if self.token_readback == "jax" and not constrained:
            tokens.copy_to_host_async()  # the read-back starts as soon as the step ends, not when asked
        if self.kv_transfers is not None:  # the evicted blocks to the host, while the device runs the step
            self.kv_transfers.finish_offloads()
        prompt_rows = prompt_logprob_positions(scheduled) if inputs.features.prompt_logprobs >= 0 else []
        if self.config.async_scheduling:  # the previous step's tokens (ready, or nearly), then book this one
            outputs += self._make_outputs(self._resolve(self._in_flight))
        broken: list[tuple[RequestState, BaseException]] = []
        if constrained:  # every token the step read is known now: the masks, while the step runs
            try:
                tokens, aux, broken = self._resample_constrained(scheduled, inputs, tokens, aux)
            except Exception as err:  # noqa: BLE001  (the step's failure, without losing the outputs made above)
                return outputs + self._fail_step(err)
            if self.token_readback == "jax":
                tokens.copy_to_host_async()
        step = InFlight(self.scheduler.advance(scheduled), tokens, aux, prompt_rows)
        for state, err in broken:  # (after the booking: their tokens in flight are dropped)
            outputs += self._fail_requests([state], err)
        if self.config.async_scheduling:
            self._in_flight, self._prev_tokens = step, tokens
            self._pending_rows = {seq: row for row, seq, _ in step.samples}
        else:
            self._free_tokens.append(tokens)
            outputs += self._make_outputs(self._resolve(step))
        self._record_step(scheduled, num_decode, inputs, t0, t1)
        return outputs

    def _resample_constrained(self, scheduled: ScheduledBatch, inputs, tokens: jax.Array, aux: dict):
        """A ``constrained`` step's constrained rows sampled again under their token masks
        (``features.resample_rows``), launched behind the step: ``(tokens, aux, broken)``, ``broken``
        the ``(request, error)`` of each matcher that failed (its row keeps the step's token; the caller
        ends the request). Left out: sequences that ended on the previous step's token, and prefill chunks
        short of their prompt's end (their token is dropped)."""
        logits = aux.pop("logits")
        picked = [(row, seq, n) for row, (seq, n) in enumerate(scheduled)
                  if seq.structured is not None and not seq.is_finished
                  and seq.num_computed_tokens + n == len(seq.token_ids)]
        cfg = self.params.config
        build = lambda rows: build_row_inputs(rows, inputs, tokens.shape[0], cfg.eos_token_id, cfg.vocab_size)
        broken = []
        try:
            row_inputs = build(picked) if picked else None
        except Exception as err:  # noqa: BLE001  (a matcher failed: find whose, alone)
            keep = []
            for p in picked:
                try:
                    build([p])
                    keep.append(p)
                except Exception as own:  # noqa: BLE001
                    broken.append((p[1].parent, own))
            if not broken:
                raise err
            row_inputs = build(keep) if keep else None
        if row_inputs is not None:
            tokens, logprobs = self.runner.resample_rows(tokens, logits, row_inputs, aux.get("logprobs"))
            if logprobs is not None:
                aux["logprobs"] = logprobs
        return tokens, aux, broken

    def _check_compiling(self) -> list[RequestOutput]:
        """Ends the queued requests whose grammar failed to compile (``finish_reason == "error"``); forgets
        those compiled."""
        done = [st for st in self._compiling if st.seqs[0].structured.ready]
        if not done:
            return []
        self._compiling = [st for st in self._compiling if not st.seqs[0].structured.ready]
        outputs = []
        for st in done:
            failure = st.seqs[0].structured.failure
            if failure is not None:
                outputs += self._fail_requests([st], failure)
        return outputs

    def _build_inputs(self, scheduled: ScheduledBatch):
        """The step's padded inputs; notes each request's first scheduling (its queueing time ends)."""
        now = time.monotonic()
        for seq, _ in scheduled:
            state = seq.parent
            if state.first_scheduled is None:
                state.first_scheduled = now
                state.num_cached_tokens = seq.num_cached_tokens
                state.num_host_cached_tokens = seq.num_host_cached_tokens
        return build_step_inputs(scheduled, self.kv.tables, self.config.block_size, width=self._table_width,
                                 max_seqs=self.config.max_num_seqs, prev_rows=self._pending_rows,
                                 eos_token_ids=self.params.config.eos_token_id,
                                 maybe_features=self._num_feature_requests > 0, min_tokens=self.min_token_bucket,
                                 uniform_decode=self._uniform_decode, vocab_size=self.params.config.vocab_size)

    def _build_inputs_isolating(self, scheduled: ScheduledBatch):
        """``(inputs, scheduled, error outputs)``: the step's inputs; if building them fails, each
        request is tried alone, those that fail alone end with an error, and the inputs are built for
        the rest (``inputs`` None when nothing is left). A failure no single request explains is the
        step's (raised)."""
        try:
            return self._build_inputs(scheduled), scheduled, []
        except Exception as err:  # noqa: BLE001
            culprits: dict[int, RequestState] = {}
            for seq, n in scheduled:
                if id(seq.parent) in culprits:
                    continue
                try:
                    self._build_inputs([(seq, n)])
                except Exception:  # noqa: BLE001
                    culprits[id(seq.parent)] = seq.parent
            if not culprits:
                raise
            failed = self._fail_requests(list(culprits.values()), err)
            scheduled = [(seq, n) for seq, n in scheduled if id(seq.parent) not in culprits]
            return (self._build_inputs(scheduled) if scheduled else None), scheduled, failed

    def _fail_requests(self, states: list[RequestState], err: BaseException) -> list[RequestOutput]:
        """Ends ``states`` with ``finish_reason == "error"`` (their blocks freed, their outputs returned)."""
        log.error("jaxpaged: requests %s failed and were ended: %s: %s", [s.request_id for s in states],
                  type(err).__name__, err, exc_info=err)
        outputs = []
        for state in states:
            if self._requests.get(state.request_id) is not state:
                continue  # finished or aborted already
            self.abort_request(state.request_id, "error")
            self._aborted.pop()  # (its output is returned now, not by the next step)
            out = self._outputs.make_output(state)
            if out is not None:
                outputs.append(out)
        return outputs

    def _fail_step(self, err: Exception) -> list[RequestOutput]:
        """After a step raised: ends the requests it held and those of the step in flight with an
        error, and makes the engine steppable again; raises ``EngineDeadError`` if the pool is lost."""
        if self.kv_pool.is_deleted():
            raise EngineDeadError(f"a step failed after consuming the KV pool: {type(err).__name__}: {err}") from err
        states: dict[int, RequestState] = {}
        in_flight = self._step_in_flight
        for seq in [s for s, _ in self._step_scheduled] + [s for _, s, _ in (in_flight.samples if in_flight else [])]:
            states.setdefault(id(seq.parent), seq.parent)
        if not states:  # nothing to blame: the engine itself is broken
            raise EngineDeadError(f"a step failed with no request in it: {type(err).__name__}: {err}") from err
        self._in_flight, self._pending_rows = None, None
        # Token buffers a failed launch may have consumed (donated) are replaced; two free ones again.
        rows = self._prev_tokens.shape[0]
        if self._prev_tokens.is_deleted():
            self._prev_tokens = self.runner.token_buffer(rows)
        buffers = self._free_tokens + ([in_flight.tokens] if in_flight is not None else [])
        free: dict[int, jax.Array] = {id(b): b for b in buffers if not b.is_deleted() and b is not self._prev_tokens}
        self._free_tokens = list(free.values())[:2]
        while len(self._free_tokens) < 2:
            self._free_tokens.append(self.runner.token_buffer(rows))
        return self._fail_requests(list(states.values()), err)

    def _take_free_tokens(self) -> jax.Array | None:
        """A read-back token buffer for the next step's output, never the one the step reads its
        placeholders from (``_prev_tokens``, also read back when a step scheduled nothing)."""
        for i, buf in enumerate(self._free_tokens):
            if buf is not self._prev_tokens:
                return self._free_tokens.pop(i)
        return None  # (not reached: two buffers and at most one is the feedback)

    def _resolve(self, step: InFlight | None) -> list[Sequence]:
        """Reads a booked step's tokens back and fills its placeholders in; ends sequences on stop
        tokens and stop strings; keeps logprobs. Returns the sequences that got a token."""
        if step is None:
            return []
        if step is self._in_flight:
            self._in_flight, self._pending_rows = None, None
            self._free_tokens.append(step.tokens)  # (read back below, or never needed)
        if not step.samples and not step.prompt_rows:
            return []
        t = time.perf_counter()
        host_tokens = self._read_tokens(step.tokens)
        self.metrics.device_seconds += time.perf_counter() - t  # (waiting for the device, and the copy)
        got = self.scheduler.resolve(step.samples, host_tokens)
        if self.scheduler.grammar_failures:  # a matcher refused its token: that request ends, alone
            failures, self.scheduler.grammar_failures = self.scheduler.grammar_failures, []
            for seq, why in failures:
                if self._requests.get(seq.parent.request_id) is seq.parent:
                    log.error("jaxpaged: request %s failed and was ended: %s", seq.parent.request_id, why)
                    self.abort_request(seq.parent.request_id, "error")
        for seq, stop in self._outputs.stop_strings(got):
            self.scheduler.stop_on_string(seq, stop)
        live = [(row, seq, pos) for row, seq, pos in step.samples if seq.finish_reason not in WITHDRAWN]
        self._record_logprobs(live, step.aux, [r for r in step.prompt_rows if r[1].finish_reason not in WITHDRAWN])
        return got

    def _record_step(self, scheduled: ScheduledBatch, num_decode: int, inputs, t0: float, t1: float) -> None:
        """Per-step metrics: the host's time before the launch and overall, and the pool's use."""
        num_tokens = sum(n for _, n in scheduled)
        kv, used = self.kv, self.kv.num_used_blocks
        now = time.perf_counter()
        self.metrics.host_seconds += t1 - t0
        self.metrics.record(StepRecord(
            step=self.metrics.total_steps, num_seqs=len(scheduled), num_prefill_tokens=num_tokens - num_decode,
            num_decode_tokens=num_decode, num_padded_tokens=int(inputs.token_ids.shape[0]),
            blocks_used=used, blocks_cached=kv.num_cached_blocks,
            kv_bytes_in_use=used * self.config.block_size * self.bytes_per_token,
            block_utilisation=kv.block_utilisation(), seconds=now - t0))

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
        """Compiles every step a plain request can need, ahead of time: each token bucket up to
        ``max_num_batched_tokens``, in each sampler variant (``random``, and ``filtered`` for top-k /
        top-p), every copy of each (``ModelRunner.precompile``: XLA compiles them in parallel). On a GPU
        each then runs once on an all-padding batch (no sequence, every slot -1: nothing is written or
        read), so its first real launch finds everything loaded, and three throwaway requests follow
        (``settle``). Returns the seconds spent.

        Structured outputs' variant (a token mask per row, ``sampling/bitmask.py``) is compiled here too
        on a GPU when llguidance is installed (``warms_up_structured_outputs``). Not compiled here, on first use instead: the variants of
        penalties, min_p, min_tokens with stop tokens, and logprobs (``sampling/features.py``: one per combination in use); on the jnp
        reference backend (a CPU's default), steps whose block tables are narrower than
        ``max_model_len`` needs (their width is padded per step there).
        ``freeze_gc``: once the steps are compiled, moves the process's long-lived objects out of the
        cyclic garbage collector's reach (``heap.freeze_long_lived_heap``), so a full collection in the
        middle of a workload takes milliseconds, not most of a second. It runs before the warm-up's
        launches, not after them: a collection walks the whole heap, and a request right after it found
        the launch path's host caches cold (as after any idle).
        """
        t0 = time.perf_counter()
        steps = self._warmup_steps()
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=2 if jax.default_backend() == "gpu" else 1, unit="phase",
                       desc=f"jaxpaged: compiling {len(steps)} step shapes")
        compiled = self.runner.precompile(self.params.state, self.kv_pool, steps, self._prev_tokens)
        if self.kv_transfers is not None:
            self.kv_transfers.warmup(self.kv_pool)
        if bar is not None:
            bar.update(1)
        if freeze_gc:  # before the runs: a full collection after them left the first request slower
            freeze_long_lived_heap()
        t_run = time.perf_counter()
        if jax.default_backend() == "gpu":
            # Each shape runs a few times in a row, each copy in turn (the runner alternates them), with
            # the token buffers passed around as a run of real steps passes them: XLA builds a step's
            # CUDA graph over its first launches and re-patches it whenever a buffer it reads moved,
            # which the first request must not pay for.
            for inputs, turn in compiled:
                if turn:
                    continue
                for _ in range(WARMUP_RUNS * self.runner.num_copies(inputs.token_ids.shape[0])):
                    tokens, self.kv_pool = self.runner.step(self.params.state, self.kv_pool, inputs,
                                                            self._prev_tokens, self._take_free_tokens())
                    tokens = tokens[0] if isinstance(tokens, tuple) else tokens  # (a constrained step's logits)
                    self._free_tokens.append(self._prev_tokens)
                    self._prev_tokens = tokens
            jax.block_until_ready(self._prev_tokens)  # (nothing ran if every shape was compiled before)
            if self.warms_up_structured_outputs:
                self._warmup_resample()
            if self.kv_transfers is not None:
                self._measure_reload_cost(compiled)
            self.settle()
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        self.warmup_profile = dict(self.runner.last_precompile, run_seconds=time.perf_counter() - t_run,
                                   total_seconds=time.perf_counter() - t0)
        return self.warmup_profile["total_seconds"]

    def _warmup_resample(self) -> None:
        """Runs structured outputs' second program (``ModelRunner.resample_rows``, token masks only) once
        for each sequence bucket and sampler variant of the constrained steps ``warmup`` compiles, so the
        first constrained request compiles nothing."""
        features = SamplerFeatures(bitmask_width=grammar.bitmask_width(self.params.config.vocab_size))
        rows = self._prev_tokens.shape[0]
        shapes = {(i.logits_indices.shape[0], i.sampling_mode) for i in self._warmup_steps() if i.features.constrained}
        for s_pad, mode in sorted(shapes):  # (logits committed where a step's outputs are: the same executable)
            logits = self.runner.committed(np.zeros((s_pad, self.params.config.vocab_size), np.float32))
            tokens, _ = self.runner.resample_rows(self.runner.token_buffer(rows), logits,
                                                  padding_row_inputs(s_pad, rows, mode, features))
            jax.block_until_ready(tokens)

    def _measure_reload_cost(self, compiled) -> None:
        """Times the host tier's copies and the largest prefill step (all padding: its matmuls, which is
        most of what recomputing a block costs) and tells the KV manager when a reload beats
        recomputing (``kv.host_tier.ReloadCost``)."""
        self.kv_pool = self.kv_transfers.measure(self.kv_pool)
        inputs = max((i for i, turn in compiled if not turn and not i.uniform_decode and not i.features),
                     key=lambda i: i.token_ids.shape[0])
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            tokens, self.kv_pool = self.runner.step(self.params.state, self.kv_pool, inputs, self._prev_tokens,
                                                    self._take_free_tokens())
            jax.block_until_ready(tokens)
            times.append(time.perf_counter() - t0)
            self._free_tokens.append(self._prev_tokens)
            self._prev_tokens = tokens
        fixed, per_block = self.kv_transfers.measured["reload"]
        self.reload_cost = ReloadCost(seconds_per_block=per_block, fixed_seconds=fixed, block_size=self.config.block_size,
                                      recompute_seconds_per_token=sorted(times)[1] / inputs.token_ids.shape[0])
        self.kv.set_reload_cost(self.reload_cost)
        log.info("KV host tier: a reload of n blocks %.0f + n x %.1f us, recomputing a block %.1f us: %s",
                 fixed * 1e6, per_block * 1e6, self.reload_cost.recompute_seconds_per_token * self.config.block_size * 1e6,
                 "reloads pay from %d blocks" % next(n for n in range(1, 1 << 20) if self.reload_cost.worth_reloading(n))
                 if self.reload_cost.ever_worth_reloading else "recomputing is cheaper: the tier stays unused")

    def _preload_warmup(self) -> None:
        """Starts reading the warm-up's executables from disk in threads (``ModelRunner.preload``); they
        need only the pool's and the token buffers' shapes, so this may run before either exists."""
        shape = engine_pool_shape(self.params, self.num_blocks, self.config.block_size, self.kv_dtype)
        rows = bucket(self.config.max_num_seqs, MIN_SEQS)
        self.runner.preload(jax.ShapeDtypeStruct(shape, jnp.dtype(self.kv_dtype)), self._warmup_steps(),
                            jax.ShapeDtypeStruct((rows,), jnp.int32))

    @property
    def warms_up_structured_outputs(self) -> bool:
        """Whether ``warmup`` compiles structured outputs' step variants: on a GPU, with llguidance
        installed and a tokenizer to build grammars from."""
        return jax.default_backend() == "gpu" and self.tokenizer is not None and grammar.available()

    def _warmup_steps(self) -> list:
        """The padded inputs of every step ``warmup`` compiles: each token bucket, each sampler variant
        (with and without structured outputs' token masks, when llguidance is installed), and where the
        engine marks decode steps (``uniform_decode``) each bucket a decode step can fill (a step of one
        token is always one: that bucket has no other variant)."""
        sizes, t = [], self.min_token_bucket
        s_max = bucket(self.config.max_num_seqs, MIN_SEQS)
        while t < bucket(self.config.max_num_batched_tokens, self.min_token_bucket) * 2:
            sizes.append(t)
            t *= 2
        decode_buckets = bucket(self.config.max_num_seqs, self.min_token_bucket) if self._uniform_decode else 0
        # Structured outputs' variant (a token mask per row) too, on a GPU where the grammar backend is
        # installed (on a CPU, where compiling is slow and nothing is served, it compiles on first use).
        variants = [SamplerFeatures()]
        if self.warms_up_structured_outputs:
            variants.append(SamplerFeatures(constrained=True))
        return [padding_step_inputs(t_pad, min(t_pad, s_max), self._table_width or self._max_width, mode, uniform,
                                    features)
                for t_pad in sizes for mode in SAMPLING_MODES for uniform in (False, True) for features in variants
                if (uniform and t_pad <= decode_buckets) or (not uniform and not (t_pad == 1 and decode_buckets))]

    def settle(self, num_requests: int = SETTLE_REQUESTS) -> None:
        """Runs ``num_requests`` throwaway one-token requests through the whole loop, then puts back
        every counter, step record, KV event and random draw they left, so the engine looks as if none
        ran.

        Why: XLA re-records a step's CUDA graph (milliseconds of host time) when a buffer the graph
        reads has moved since its last launch. Real steps reach the addresses they
        keep reusing only after a few requests (the allocator's free space after the warm-up differs
        from a serving loop's), so without this the first three requests each paid a re-record.
        Measured with XLA's command-buffer log (docs/DECISIONS.md): after three throwaway requests the
        next request re-records nothing, also when its prompt lands in another token bucket. Each
        prompt is shorter than a block, so nothing enters the prefix cache; the blocks they used go
        to the end of the free list (later requests get never-used blocks first). Does nothing while
        requests are queued or running (their outputs must reach the caller), with a block size of 1
        (no prompt is shorter than a block), or where the engine's limits admit no such request.
        """
        prompt = [0] * min(self.config.block_size // 2, self.max_model_len - 1,
                           self.config.max_num_batched_tokens - 1)
        if self.has_unfinished_requests() or not prompt:
            return
        kv_counters, sched_counters = copy.copy(self.kv.counters), copy.copy(self.scheduler.counters)
        m = self.metrics
        metrics = (len(m.records), m.total_seconds, m.total_steps, m.host_seconds, m.device_seconds)
        events = self.kv.events.snapshot() if self.kv.events is not None else None
        rng_state = self._rng.bit_generator.state  # (requests without a seed draw theirs from it)
        for i in range(num_requests):
            try:
                self.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id=f"jaxpaged-settle-{i}")
            except ValueError:  # (refused whole, nothing queued: limits this check does not foresee)
                break
            while self.has_unfinished_requests():
                self.step()
        for counters, saved in ((self.kv.counters, kv_counters), (self.scheduler.counters, sched_counters)):
            for field in dataclasses.fields(saved):  # (in place: other parts of the engine hold these objects)
                setattr(counters, field.name, getattr(saved, field.name))
        del m.records[metrics[0]:]
        m.total_seconds, m.total_steps, m.host_seconds, m.device_seconds = metrics[1:]
        if events is not None:
            self.kv.events.restore(events)
        self._rng.bit_generator.state = rng_state

    def close(self) -> None:
        """Releases what the engine acquired outside JAX (the stream token reader's CUDA stream and
        pinned buffer). The engine cannot step afterwards; dropping it does the same."""
        close = getattr(self._read_tokens, "close", None)
        if close is not None:
            close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()

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
        if self.kv_transfers is not None:
            s.update(self.kv_transfers.stats())
        if self.kv_event_publisher is not None:
            s.update(self.kv_event_publisher.stats())
        return s

    def explain_prefix(self, a: str | SequenceT[int], b: str | SequenceT[int]) -> PrefixDivergence:
        """The first block (and token) where two prompts diverge: why they share no more cached blocks;
        and where this engine's cache holds the shared blocks now (``cached_tiers``: GPU, host tier)."""
        _, ids_a = self._tokenize(a, "a")
        _, ids_b = self._tokenize(b, "b")
        trie = self.kv.trie
        tiers = [node.tier for node in trie.path(ids_a)] if trie is not None else None
        return explain_prefix(ids_a, ids_b, self.config.block_size, cached_tiers=tiers)
