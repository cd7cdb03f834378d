"""EngineConfig: what a user sets, in one frozen dataclass validated when it is made (vLLM's names).

Tuning choices of the step (which kernels run, how steps are bucketed) are not here: they are how
the engine works, decided by measurement (docs/DECISIONS.md). The few a benchmark still varies live
in ``jaxpaged/engine/tuning.py``.
"""

from __future__ import annotations

import dataclasses
import json

ATTENTION_BACKENDS = ("auto", "triton", "mosaic", "reference")  # models/attention_backends.py
RESERVATIONS = ("paged", "max_len")
SCHEDULING_POLICIES = ("fcfs", "prefix_affinity")  # jaxpaged/engine/scheduling_policy.py
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names
FP8_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # name -> jnp dtype
QUANTIZATIONS = ("fp8",)  # vLLM's names of the weight formats the engine runs (models/quantization.py)
# vLLM's names of EngineConfig fields (its LLM arguments and command-line flags): LLM(...) takes either.
VLLM_NAMES = {"gpu_memory_utilization": "memory_fraction", "num_gpu_blocks_override": "num_blocks"}


def check_block_size(block_size: int) -> int:
    """Returns ``block_size`` if it is a positive power of two, else raises ``ValueError``.

    Powers of two keep ``slot // block_size`` a shift and match the kernels' tile shapes.
    """
    if not (isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0
            and not block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a positive power of two, got {block_size!r}")
    return block_size


MAX_PROCESSES = 4096  # EngineConfig.num_processes


def split_host_port(address: str, field: str = "coordinator_address") -> tuple[str, int]:
    """``("host", port)`` of ``"HOST:PORT"`` (a host name or an IPv4 address); ``ValueError`` naming ``field``
    otherwise. The port leaves room for the next one (``engine/multihost.py`` listens there)."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) < 65535 or len(address) > 255:
        raise ValueError(f"{field} must be HOST:PORT with a port in [1, 65534], got {address!r}")
    return host, int(port)


KV_EVENT_PUBLISHERS = ("null", "zmq")  # vLLM's names (engine/kv_events.py)


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events: which prefix blocks the engine holds, published for routers (llm-d's prefix-cache
    scorer) in vLLM's format and under vLLM's names (``--kv-events-config``).

    enable_kv_cache_events: publish them at all.
    publisher: ``"zmq"`` (a ZeroMQ PUB socket; ``pip install 'jaxpaged[kv-events]'``) or ``"null"`` (none).
    endpoint: the PUB socket's address; one with ``*`` (``tcp://*:5557``), ``ipc://`` or ``inproc://`` is
      bound, any other (``tcp://router:5557``) connected to.
    replay_endpoint: a ROUTER socket a subscriber asks for batches it missed (``None``: no replay).
    buffer_steps: batches kept for replay.
    hwm: the PUB socket's high-water mark (messages queued per subscriber before ZeroMQ drops).
    max_queue_size: batches waiting for the publisher thread; a batch that finds the queue full is dropped
      and counted (the engine never waits for the publisher).
    topic: the first frame of each message (llm-d reads ``kv@<pod>@<model>``).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be a bool, got {self.enable_kv_cache_events!r}")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {KV_EVENT_PUBLISHERS}, got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string, got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"kv_events_config.replay_endpoint must be a string or None, got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**8:
                raise ValueError(f"kv_events_config.{name} must be an integer in [1, 1e8], got {value!r}")

    @property
    def enabled(self) -> bool:
        """Events are recorded and published."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value) -> KVEventsConfig | None:
        """A ``KVEventsConfig`` from itself, a dict of its fields or that dict as JSON (vLLM's
        ``--kv-events-config``); ``None`` stays ``None``. An unknown field is a ``ValueError`` naming it."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"kv_events_config is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a KVEventsConfig, a dict or JSON, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field {unknown[0]!r}; the fields: {', '.join(sorted(fields))}")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine configuration (vLLM's names and meanings).

    block_size: tokens per KV block (a power of two); ``None``: 16, or with an fp8 ``kv_cache_dtype``
      64 (at most the head dim): its attention reads 64-slot tiles, fastest when a tile is one block
      (docs/DECISIONS.md). The engine's ``config`` holds the resolved size.
    num_blocks: KV pool size in blocks; ``None`` sizes it from what ``memory_fraction`` of the device
      memory leaves after the weights, at most 4 x what ``max_num_seqs`` sequences of ``max_model_len``
      tokens need (a small model on a large GPU gets a pool it can use, not all memory). On a CPU: a quarter of the available host memory, at most 4 GiB,
      and at most what ``min(max_num_seqs, 16)`` sequences of ``max_model_len`` tokens need
      (``models/kv_pool.py``).
    memory_fraction: share of the device's memory the engine holds, weights and pool together (vLLM's
      ``gpu_memory_utilization``); the rest is the steps' and the compiler's working memory.
    max_num_seqs: sequences in one step (the decode batch size).
    max_num_batched_tokens: new tokens in one step (the prefill budget; long prompts are chunked).
    max_model_len: prompt + generated tokens per request; ``None`` = the model's
      ``max_position_embeddings`` capped at 8192, lowered to the pool's size if the pool is smaller.
    enable_prefix_caching: reuse full blocks of earlier prompts (token-exact prefix trie).
    enable_chunked_prefill: split prompts longer than the step budget over several steps.
    reservation: ``paged`` (blocks on demand) or ``max_len`` (reserve ``max_model_len`` at admission,
      like a contiguous KV cache; for the memory experiments).
    kv_cache_dtype: the KV pool's dtype: ``"auto"`` (the weights' dtype, ``LLM(path, dtype=...)``),
      ``"bfloat16"``, ``"float16"``, ``"float32"``, or 8-bit: ``"fp8"`` (= ``"fp8_e4m3"``) or
      ``"fp8_e5m2"``, with a power-of-two scale per token, KV head and K or V chosen as each token is
      written (``kernels/fp8.py``; no calibration): about twice the tokens in the same memory.
    attention_backend: ``auto`` (``mosaic`` for an fp8 pool on Hopper where it reads it, else ``triton`` on a
      GPU; the jnp reference elsewhere), ``triton`` (the Pallas
      kernel lowered by Triton, any CUDA GPU), ``mosaic`` (the Pallas kernel for Hopper on Mosaic GPU:
      compute capability 9.0+, bf16 KV or fp8 KV in blocks of at least 64 with bf16 weights, not with
      ``batch_invariant``), ``reference`` (jnp).
      docs/DECISIONS.md says which is faster where.
    seed: the engine's generator for requests without a seed.
    event_log: keep a log of KV block events (``True``, or the number of events to keep).
    compilation_cache: keep compiled steps on disk across processes (JAX's persistent cache in
      ``$JAXPAGED_COMPILE_CACHE``, default ``~/.cache/jaxpaged/xla``).
    async_scheduling: dispatch step N+1 before step N's tokens are read back (the device feeds them
      in), so the host schedules while the device computes. Outputs are identical either way. On by
      default: the faster of the two (docs/DECISIONS.md).
    batch_invariant: make each request's output a function of its own prompt, sampling params and
      seed only, bitwise, in every dtype: independent of what else is batched, arrival order, chunked
      prefill boundaries, prefix-cache hits, block size (up to 64), preemption and async scheduling.
      Costs speed (fixed-tile Pallas matmuls, a row-kernel RMSNorm, one attention launch
      configuration). Off by default. See docs/NUMERICS.md.
    scheduling_policy: the order waiting requests are admitted in: ``fcfs`` (arrival order) or
      ``prefix_affinity`` (requests whose prefix is cached or being computed first, with a bounded
      wait so nothing starves).
    kv_offloading_size: GiB of host memory for a second prefix-cache tier under the device pool (0: none).
      A cached block the device pool evicts is copied there (``pinned_host`` memory) and stays
      findable; a later prefix hit on it copies it back instead of recomputing it
      (``kv/host_tier.py``). With tensor parallelism, the total over all devices (vLLM's meaning).
    tensor_parallel_size: devices the model is split over (heads, MLP columns, vocabulary, KV heads;
      ``models/sharding.py``); load the weights with the same ``tensor_parallel_size``.
    quantization: the linear layers' weights: ``None`` (the checkpoint's: bf16/f32, or the fp8 weights
      and block scales of an fp8 checkpoint such as Qwen's ``-FP8`` ones, read from its ``config.json``)
      or ``"fp8"`` (e4m3; a bf16/f32 checkpoint is quantized at load with one scale per output channel).
      Embeddings, LM head and norms stay in the model's dtype (``models/quantization.py``); load the
      weights with the same ``quantization``.
    kv_events_config: KV-cache events for routers (``KVEventsConfig``, or its fields as a dict or JSON,
      vLLM's ``--kv-events-config``); ``None``: none.
    data_parallel_rank: this engine's rank among data-parallel replicas (its KV events say it; a tcp
      endpoint's port is offset by it, as vLLM does).
    coordinator_address, num_processes, process_id: one engine over several processes, one per host
      (``jax.distributed.initialize``'s arguments; ``engine/multihost.py``): ``"HOST:PORT"`` of process 0's
      coordinator (process 0 also listens on PORT + 1 for the other processes), how many processes, and
      this one's index. ``tensor_parallel_size`` is then every process's devices together. Process 0 (the
      leader) takes the requests; the others replay its engine calls (``LLM.follow``). ``num_processes``
      1: one process, no coordinator.
    Precision: float32 weights mean IEEE float32 in every matmul and kernel dot (never TF32); bfloat16
    means bf16 storage and operands with fp32 accumulation.
    """

    block_size: int | None = None
    num_blocks: int | None = None
    memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    reservation: str = "paged"
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    event_log: bool | int = False
    compilation_cache: bool = True
    async_scheduling: bool = True
    batch_invariant: bool = False
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    kv_offloading_size: float = 0
    quantization: str | None = None
    kv_events_config: KVEventsConfig | None = None
    data_parallel_rank: int = 0
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        rank = self.data_parallel_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 65536:
            raise ValueError(f"data_parallel_rank must be an integer in [0, 65536), got {rank!r}")
        if self.block_size is not None:
            check_block_size(self.block_size)
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        self._check_processes()
        size = self.kv_offloading_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size >= 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0, got {size!r}")
        if size and not (self.enable_prefix_caching and self.reservation == "paged"):
            raise ValueError("kv_offloading_size is a tier of the prefix cache: it needs enable_prefix_caching=True "
                             f"and reservation='paged' (got {self.enable_prefix_caching}, {self.reservation!r})")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.reservation not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {self.reservation!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    def _check_processes(self) -> None:
        """``num_processes``, ``process_id`` and ``coordinator_address`` (see the class doc)."""
        n, i = self.num_processes, self.process_id
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PROCESSES:
            raise ValueError(f"num_processes must be an integer in [1, {MAX_PROCESSES}], got {n!r}")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"process_id must be an integer in [0, num_processes={n}), got {i!r}")
        if n == 1:
            if self.coordinator_address is not None:
                raise ValueError("coordinator_address is for several processes: set num_processes > 1 too")
            return
        if self.coordinator_address is None:
            raise ValueError(f"num_processes={n} needs coordinator_address (HOST:PORT of process 0)")
        split_host_port(self.coordinator_address)
        if self.kv_offloading_size:
            raise ValueError(f"kv_offloading_size is not supported with num_processes={n}: each process would "
                             "measure its own reload cost at warm-up and decide reloads differently")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """An ``EngineConfig`` from settings under its own names or vLLM's (``VLLM_NAMES``). An unknown
        name, or one setting under both names, is a ``TypeError`` that says which."""
        fields = [f.name for f in dataclasses.fields(cls)]
        given: dict[str, str] = {}  # field -> the name it was given under
        for name in kwargs:
            field = VLLM_NAMES.get(name, name)
            if field not in fields:
                import difflib

                close = difflib.get_close_matches(name, fields + list(VLLM_NAMES), n=1)
                raise TypeError(f"unknown engine setting {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                                + f"; the settings: {', '.join(fields + list(VLLM_NAMES))}")
            if field in given:
                raise TypeError(f"{given[field]!r} and {name!r} are the same setting ({field}): give one of them")
            given[field] = name
        return cls(**{field: kwargs[name] for field, name in given.items()})

    def resolved_block_size(self, head_dim: int) -> int:
        """``block_size``, or its default for this ``kv_cache_dtype`` and ``head_dim`` (see above)."""
        if self.block_size is not None:
            return self.block_size
        return min(64, head_dim) if self.kv_cache_dtype.startswith("fp8") else 16

    def resolved_kv_cache_dtype(self, weights_dtype: str) -> str:
        """The pool's dtype: the weights' for ``"auto"``, the fp8 names' jnp dtype, else ``kv_cache_dtype``."""
        if self.kv_cache_dtype == "auto":
            return weights_dtype
        return FP8_DTYPES.get(self.kv_cache_dtype, self.kv_cache_dtype)

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        if self.max_model_len is None:
            return min(max_position_embeddings, 8192)
        if self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_position_embeddings}")
        return self.max_model_len
