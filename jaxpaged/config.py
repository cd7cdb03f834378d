"""EngineConfig: every engine knob in one frozen dataclass, validated when it is made."""

from __future__ import annotations

import dataclasses

from .kv.allocator import check_block_size

ATTENTION_BACKENDS = ("auto", "pallas", "reference")
RESERVATIONS = ("paged", "max_len")
SCHEDULING_POLICIES = ("fcfs", "prefix_affinity")  # jaxpaged/scheduling_policy.py
TOKEN_READBACKS = ("jax", "stream", "auto")  # jaxpaged/readback.py


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine configuration (vLLM names).

    block_size: tokens per KV block (a power of two).
    num_blocks: KV pool size in blocks; ``None`` sizes it from ``memory_fraction`` of the device
      memory left after the weights (on a CPU: a quarter of the available host memory, at most 4 GiB,
      ``pool_size.size_pool``).
    max_num_seqs: sequences in one step (decode batch size).
    max_num_batched_tokens: new tokens in one step (the prefill budget; long prompts are chunked).
    max_model_len: prompt + generated tokens per request; ``None`` = the model's
      ``max_position_embeddings`` capped at 8192, lowered to the pool's size if the pool is smaller.
    enable_prefix_caching: reuse full blocks of earlier prompts (token-exact prefix trie).
    reservation: ``paged`` (blocks on demand) or ``max_len`` (reserve ``max_model_len`` at admission).
    async_scheduling: dispatch the next step before reading the previous one's tokens back (the
      device feeds them in), so the host schedules and builds step N+1 while the device runs step N;
      outputs are identical either way. On by default since the step has no host round trip left:
      on the H200 (2026-11-29) 21,558 vs 15,493 tok/s on the nano-vllm workload, and a batch-256
      decode step's wall time equals its GPU time (benchmarks/RESULTS.md).
    compilation_cache: keep compiled steps on disk across processes (``runner.enable_compilation_cache``).
    dtype: the KV pool's dtype; ``None`` (default) = the weights' dtype (``LLM(path, dtype=...)`` or
      ``load_params(path, dtype)`` choose the weights' dtype).
    attention_backend: ``auto`` (Pallas on GPU), ``pallas``, ``reference``.
    batch_invariant: make each request's output a function of its own prompt, sampling params and
      seed only, bitwise, in every dtype: independent of what else is batched, arrival order, chunked
      prefill boundaries, prefix-cache hits, block size (up to 64), preemption and async scheduling.
      Costs speed: the projections and LM head run a fixed-tile Pallas matmul (no split-K, tiles never
      chosen from the token count), RMSNorm a row kernel, attention one launch configuration for every
      step (no split-K for small decode batches). Off by default. See docs/NUMERICS.md.
    decode_gemv: on a GPU, matmuls of at most 32 rows (decode steps of up to 32 sequences, their LM
      head) with bf16/fp16 weights run the split-K Pallas GEMV (``kernels/gemv.py``) instead of XLA's
      GEMM. Inside the batch-1 step on the H200 the four GEMVs and the LM head took 564 us against
      XLA's 662 us (its GEMMs plus their split-K reductions; ``benchmarks/RESULTS.md``, session 4),
      although a lone XLA GEMM of the same shape is faster than the GEMV. Off: XLA everywhere.
      Ignored with ``batch_invariant`` (its fixed-tile matmul) and on a CPU.
    fuse_matmul_inputs: let XLA fuse the op producing a matmul's input (RMSNorm, SiLU * up) into its
      GEMM kernel. Off by default on a GPU (an optimisation barrier keeps them apart): such fused
      GEMMs ran about 2x slower at decode sizes on the H200. Ignored on a CPU.
    fused_qkv: on a GPU, each layer's stretch from the qkv projection to the KV write (bias, q/k
      RMSNorm, RoPE, the K/V scatter) runs as one Pallas kernel (``kernels/qkv_epilogue.py``) instead
      of four to five XLA kernels. Ignored with ``batch_invariant`` and on a CPU.
    fused_residual: on a GPU with ``decode_gemv``, o_proj and down_proj hand their GEMV's split-K
      partials to the next RMSNorm unsummed, and one Pallas kernel sums them, adds them to the
      residual stream and normalises (``kernels/add_rms_norm.py``): one kernel instead of two to three
      per norm in steps of at most 32 tokens. Larger steps (XLA's GEMMs) keep XLA's fusions, as do
      float32 models; ignored with ``batch_invariant``, tensor parallelism and on a CPU.
    fused_sampler: on a GPU, the sampler draws its Gumbel noise and takes the argmax over the
      vocabulary in one Pallas pass (``kernels/gumbel_argmax.py``; the GPU's fast logarithm, with a
      series where it would be inexact) instead of XLA's two reductions: 97 vs ~155 us of a batch-256
      step on the H200 (RESULTS.md, session 10). Ignored on a CPU (XLA's path, the same formula).
    token_readback: how each step's sampled tokens are read back to the host (``jaxpaged/readback.py``):
      ``"jax"`` (``np.asarray``: the copy is issued only after the step's completion has passed through
      PjRt's host callbacks and worker threads, ~0.48 ms after the last kernel in a traced TTFT step on
      the H200, RESULTS.md session 11), ``"stream"`` (a device-to-host copy on a CUDA stream of the
      engine's own that waits for the step on the GPU, through DLPack and the CUDA driver; an error
      without CUDA), ``"auto"`` (the default: ``"stream"`` where it can be set up, else ``"jax"``).
      One device only (tensor parallelism reads through jax). On the H200, in alternating runs on one
      machine, the stream reader cut the batch-1 TTFT of a 32-token prompt from 2.13-2.26 to
      1.73-1.79 ms and the ITL from 0.94-0.98 to 0.88-0.89 ms, with the same greedy float32 tokens
      (RESULTS.md, session 12).
    min_token_bucket: a step's tokens are padded to a power of two of at least this many (one compiled
      step per size). Smaller buckets mean less padding work in small decode steps (a batch-1 step
      computes ``min_token_bucket`` rows in every projection) and more compiled shapes. ``None``: 1 on
      a GPU (a batch-1 step's GPU time -8% against 16 on the H200, 4 more shapes to compile), 16 on
      a CPU (where compilation, not padding, dominates).
    longest_first: a step's sequences are laid out longest context first, so the attention kernel,
      which launches its programs in row order, starts the longest KV reads first and the short ones
      fill the tail (a longest-job-first launch order). On nano-vllm's ragged decode batches this cut
      the attention's time by up to 15% a layer on the H200 (``benchmarks/bench_attention_workload.py``);
      outputs do not depend on the order.
    step_executables: copies of each compiled step of at most 32 tokens, launched in turn, so that
      each copy's CUDA graph finds its buffers (the two token buffers used in turn) where its previous
      launch left them and XLA patches nothing before the launch (``runner.ModelRunner``; batch-1
      ITL on the H200 1.16-1.37 -> 0.98-1.02 ms, session 6). Each copy is compiled: with 2, warm-up compiles the six
      smallest token buckets twice. ``None``: 2 on a GPU, 1 elsewhere (a CPU has no command
      buffers); tensor parallelism uses 1.
    cublas_max_tokens: steps of more than 32 and at most this many padded tokens (decode-sized steps,
      above the GEMV's 32 rows) compile XLA's GEMMs as cuBLAS calls instead of Triton fusions
      (``xla_gpu_enable_triton_gemm=False`` for those executables only); larger, prefill-sized
      steps keep Triton's. On the H200 a batch-256 decode step's GPU time fell 4%, while cuBLAS for
      every step made the whole workload slower (its prefill steps). ``None``: 512 on a GPU, 0 (never)
      elsewhere and with ``batch_invariant`` (whose matmuls are Pallas kernels).
    max_cudagraph_capture_size: steps of more padded tokens than this run without CUDA graphs (XLA's
      command buffers off for those executables only: ``xla_gpu_enable_command_buffer=""``); their
      kernels are launched one by one, and the GPU starts on the first while the host launches the
      rest. A large step's graph is otherwise re-patched before every launch (``runner.ModelRunner``),
      which holds the host 1.3-4 ms at batch 256 on the H200. ``None``: every step as CUDA graphs.
      (vLLM's name: the largest batch it captures a graph for.)
    compiler_options: XLA options for the compiled step only, as ``((name, value), ...)`` (e.g.
      ``(("xla_gpu_enable_triton_gemm", False),)``); ``None`` = the engine's defaults
      (``runner.DEFAULT_COMPILER_OPTIONS``). Never a global flag.
    scheduling_policy: the order waiting requests are admitted in: ``fcfs`` (arrival order) or
      ``prefix_affinity`` (requests whose prefix is cached or being computed first, so shared prefixes
      are computed once and reused before eviction; a request passed over in more than 8 steps goes
      first, so nothing starves). See ``jaxpaged/scheduling_policy.py``.
    tensor_parallel_size: devices the model is split over (heads, MLP columns, vocabulary, KV heads;
      ``jaxpaged.models.sharding``); the weights must be loaded with the same ``tensor_parallel_size``. 1 =
      one device, the plain step.
    Precision: float32 weights mean IEEE float32 in every matmul and kernel dot (never TF32); bfloat16
    means bf16 storage and operands with fp32 accumulation.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    reservation: str = "paged"
    dtype: str | None = None
    attention_backend: str = "auto"
    seed: int = 0
    event_log: bool = False
    compilation_cache: bool = True  # JAX's persistent compilation cache ($JAXPAGED_COMPILE_CACHE)
    async_scheduling: bool = True  # schedule step N+1 while step N runs (see docstring)
    batch_invariant: bool = False  # bitwise batch-independent outputs, at a speed cost (docs/NUMERICS.md)
    decode_gemv: bool = True  # Pallas split-K GEMV for <= 32-row bf16 matmuls on GPU (see docstring)
    fuse_matmul_inputs: bool = False  # let XLA fuse a matmul's producer into its GEMM (see docstring)
    fused_qkv: bool = True  # one Pallas kernel from the qkv projection to the KV write on GPU (see docstring)
    fused_residual: bool = True  # residual add + RMSNorm as one Pallas kernel on GPU (see docstring)
    fused_sampler: bool = True  # the sampler's noise + argmax as one Pallas pass on GPU (see docstring)
    token_readback: str = "auto"  # how sampled tokens reach the host: "jax", "stream" or "auto" (see docstring)
    min_token_bucket: int | None = None  # smallest padded token count of a step: 1 on GPU, 16 on CPU (see docstring)
    longest_first: bool = True  # rows of a step ordered by context length, longest first (see docstring)
    step_executables: int | None = None  # copies of each small compiled step, used in turn: 2 on GPU (see docstring)
    cublas_max_tokens: int | None = None  # decode-sized steps' GEMMs through cuBLAS: up to 512 tokens on GPU (see docstring)
    max_cudagraph_capture_size: int | None = None  # larger steps launch kernel by kernel (see docstring)
    compiler_options: tuple[tuple[str, object], ...] | None = None  # XLA options for the step (see docstring)
    scheduling_policy: str = "fcfs"  # or "prefix_affinity" (see docstring)
    tensor_parallel_size: int = 1  # devices the model is split over (jaxpaged.models.sharding)

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.step_executables is not None and (not isinstance(self.step_executables, int)
                                                  or self.step_executables < 1):
            raise ValueError(f"step_executables must be a positive integer or None, got {self.step_executables!r}")
        if self.cublas_max_tokens is not None and (not isinstance(self.cublas_max_tokens, int)
                                                   or self.cublas_max_tokens < 0):
            raise ValueError(f"cublas_max_tokens must be a non-negative integer or None, got {self.cublas_max_tokens!r}")
        if self.max_cudagraph_capture_size is not None and (not isinstance(self.max_cudagraph_capture_size, int)
                                                            or self.max_cudagraph_capture_size < 0):
            raise ValueError("max_cudagraph_capture_size must be a non-negative integer or None, "
                             f"got {self.max_cudagraph_capture_size!r}")
        m = self.min_token_bucket
        if m is not None and (not isinstance(m, int) or m < 1 or m & (m - 1)):
            raise ValueError(f"min_token_bucket must be a power of two >= 1, got {m!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.token_readback not in TOKEN_READBACKS:
            raise ValueError(f"token_readback must be one of {TOKEN_READBACKS}, got {self.token_readback!r}")
        if self.reservation not in RESERVATIONS:
            raise ValueError(f"reservation must be one of {RESERVATIONS}, got {self.reservation!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_model_len > self.max_num_batched_tokens:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        if self.max_model_len is None:
            return min(max_position_embeddings, 8192)
        if self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_position_embeddings}")
        return self.max_model_len
