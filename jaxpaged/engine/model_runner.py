"""The jitted step: ``(state, kv_pool, inputs) -> (tokens, kv_pool)``, with the KV pool donated.

Everything the device does in one engine iteration is one XLA program: embed, every layer (K/V
written in place into the donated pool, paged attention), the final norm, logits only at the
sampled positions, and sampling. The graph definition and the attention functions are fixed per
``ModelRunner``, so they are closed over; weights and pool are arguments (never constants).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .step_inputs import StepInputs
from ..models.ops import get_attention_fn, get_model_ops, resolve_backend
from ..kernels.gemv import ROWS as GEMV_ROWS
from ..kernels.kv_write import write_kv
from ..models.qwen import DEFAULT_OPS, KVPool, ModelOps
from ..sampling.features import sample_step
from .transfer import pack, to_step_memory, unpack


# XLA options the engine compiles its step with (per executable, never a global flag). Empty until a
# whole-workload measurement shows an option helps (benchmarks/RESULTS.md, exp_xla_flags.py).
DEFAULT_COMPILER_OPTIONS: tuple[tuple[str, object], ...] = ()


def pool_hlo_report(hlo: str, pool_shape: tuple[int, ...]) -> dict:
    """How a compiled step (``hlo``: its text) treats the pool ``[L, N, bs, 2, Hkv, D]``.

    ``aliased``: pool-shaped parameters aliased to outputs (the donated pool: 1); ``aliases``: all
    parameters aliased to outputs (the pool and the recycled token buffer: 2). ``copies``: copies of the whole
    pool. ``slices``: values holding part of the pool, i.e. any array with the pool's ``N, bs`` axes that
    is not the pool itself (a layer, ``[1, N, ...]``, keys only, ...): XLA copies a slice before a custom
    call, so the step must index the pool, never slice it. Both must be 0.
    """
    lines = hlo.splitlines()
    dims = ",".join(map(str, pool_shape))
    n, bs = pool_shape[1], pool_shape[2]
    copies = sum(1 for ln in lines if re.search(rf"\w+\[{dims}\]", ln) and re.search(r"\bcopy(-start)?\(", ln))
    slices = 0
    for ln in lines:
        m = re.search(r"= \w+\[([\d,]+)\]", ln)
        if m and m.group(1) != dims and re.search(rf"(^|,){n},{bs}(,|$)", m.group(1)):
            slices += 1
    aliased_params = [int(k) for k in re.findall(r"\{\d+\}: \((\d+), \{\}, (?:may|must)-alias\)", lines[0])]
    pool_params = {int(m.group(1)) for ln in lines
                   if (m := re.search(rf"= \w+\[{dims}\](?:\{{[\d,]*\}})? parameter\((\d+)\)", ln))}
    return dict(aliased=sum(1 for k in aliased_params if k in pool_params), aliases=len(aliased_params),
                copies=copies, slices=slices)


def entry_param_readers(hlo: str, params: list[int]) -> dict[int, int]:
    """How many instructions of a compiled step's entry computation read each of its parameters
    ``params`` (numbers as in ``parameter(K)``). The step's packed inputs and previous tokens must be
    read by one each (``transfer.to_step_memory``'s copy), or every launch patches the CUDA graph's
    nodes that read them."""
    lines = hlo.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("ENTRY"))
    body = []
    for ln in lines[start + 1:]:
        if ln.startswith("}"):
            break
        body.append(ln)
    names = {}
    for ln in body:
        m = re.search(r"(%[\w.\-]+) = [^=]*\bparameter\((\d+)\)", ln)
        if m and int(m.group(2)) in params:
            names[int(m.group(2))] = m.group(1)
    return {k: sum(1 for ln in body if "parameter(" not in ln and re.search(re.escape(name) + r"(?![\w.\-])", ln))
            for k, name in names.items()}


def gspmd_partitioner():
    """A context in which jit partitions with GSPMD instead of Shardy (the tensor-parallel step only).

    Why: on the H200 machine (jax 0.11.2, CUDA 13, 2026-11-29) XLA's GPU compiler segfaults while
    compiling the tensor-parallel step (shard_map over the ``tp`` mesh) when Shardy partitions it, at
    every size, with either attention backend and with command buffers, Triton GEMMs, autotuning or
    the latency-hiding scheduler off; with GSPMD it compiles and runs (``bench_tp.py``, RESULTS.md).
    Scoped to the step's trace and compile, never set globally; it is part of jit's cache key, so every
    call of the step runs inside it.
    """
    from jax._src import config as jax_config  # the State behind jax_use_shardy_partitioner

    state = getattr(jax_config, "use_shardy_partitioner", None)
    return state(False) if state is not None else contextlib.nullcontext()


def enable_compilation_cache(cache_dir: str | Path | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache, so a new process reuses compiled steps.

    Leaves an existing user setting alone. Directory: ``cache_dir``, else ``$JAXPAGED_COMPILE_CACHE``,
    else ``~/.cache/jaxpaged/xla``. Returns the directory in use (``None`` if disabled by an empty
    ``$JAXPAGED_COMPILE_CACHE``).
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = cache_dir or os.environ.get("JAXPAGED_COMPILE_CACHE", str(Path.home() / ".cache" / "jaxpaged" / "xla"))
    if not path:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return str(path)


def make_step_fn(graphdef: nnx.GraphDef, attention_fn: Callable, write_kv_fn: Callable,
                 ops: ModelOps = DEFAULT_OPS, batch_invariant: bool = False, fused_sampler: bool = True) -> Callable:
    """The pure step function (not jitted): used by ``ModelRunner`` and by HLO inspection tests.
    ``ops``: the model's matmul / RMSNorm; ``batch_invariant``: fixed-order sums in the sampler;
    ``fused_sampler``: the sampler's Pallas pass on a GPU (``EngineConfig.fused_sampler``)."""

    def step(state: nnx.State, kv_pool: KVPool, inputs: StepInputs,
             prev_tokens: jax.Array) -> tuple[jax.Array, KVPool]:
        """``prev_tokens i32[R]``: the previous step's output (fills placeholder tokens in).
        Returns ``(tokens i32[R], kv_pool)``: this step's samples in rows ``0..S-1``, zeros after, so
        every step's output has one shape and can feed the next step without a host round trip. In a
        logprobs variant (``inputs.features``) the first item is ``(tokens, aux)`` instead."""
        model = nnx.merge(graphdef, state)
        prev = prev_tokens[jnp.maximum(inputs.prev_index, 0)]
        token_ids = jnp.where(inputs.prev_index >= 0, prev, inputs.token_ids)
        hidden, kv_pool = model(token_ids, inputs.positions, kv_pool, inputs.meta,
                                attention_fn=attention_fn, write_kv_fn=write_kv_fn, ops=ops)
        # Logits at the sampled positions, then the sampler (plus penalties / logprobs in their variants).
        tokens, aux = sample_step(hidden, lambda h: model.compute_logits(h, ops), inputs, token_ids, batch_invariant,
                                  fused_sampler)
        out = jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens)
        return ((out, aux) if aux else out), kv_pool

    return step


COPIES_MAX_TOKENS = 32  # steps of at most this many tokens use every copy of the step (ModelRunner)
# XLA options of the steps that ``cublas_max_tokens`` covers: XLA's GEMMs through cuBLAS, not Triton.
CUBLAS_OPTIONS: tuple[tuple[str, object], ...] = (("xla_gpu_enable_triton_gemm", False),)
# XLA options of the steps above ``cudagraph_max_tokens``: no command buffers (CUDA graphs), plain launches.
EAGER_OPTIONS: tuple[tuple[str, object], ...] = (("xla_gpu_enable_command_buffer", ""),)
VARIANT_OPTIONS = {"cublas": CUBLAS_OPTIONS, "eager": EAGER_OPTIONS}
VARIANTS = ("default", "cublas", "eager", "cublas+eager")  # every variant name ModelRunner.variant returns


class ModelRunner:
    """Owns the jitted step for one model and attention backend; counts compilations.

    ``mesh``: a tensor-parallel mesh (``jaxpaged.models.sharding``): ``graphdef`` is then the per-shard model
    and the step body runs on every shard under ``shard_map``; ``None`` (one device) is the plain step.

    ``batch_invariant``: every token's result is bitwise independent of the batch it is computed in
    (fixed-tile Pallas matmuls and norms, one attention launch configuration, fixed-order sampler sums;
    docs/NUMERICS.md).

    The weights are passed to the jitted function as a flat list of arrays, flattened once per
    state object: flattening an NNX ``State`` in Python on every call costs ~0.3 ms a step, while a
    list of arrays goes through jit's C++ fast path. The step's inputs travel packed in one buffer
    (``transfer.pack``: one host-to-device copy instead of 13) with a static ``StepLayout``.

    ``step_executables``: copies of each compiled step, used in turn (``EngineConfig``). A step's
    CUDA graph records the address of every buffer its kernels touch, and XLA patches the nodes whose
    buffers moved before each launch. With async scheduling the token buffers the step reads and
    writes alternate between two (``step``'s ``spare_tokens``); with two copies used in turn (per
    shape) each copy always sees the same two. Measured on the H200 (RESULTS.md, session 6): at batch
    1 ITL p50 1.37 -> 1.02 and 1.16 -> 0.98 ms in two paired runs. Until session 11 a larger step's
    temporary buffer moved at every launch anyway (a fresh token output was allocated before it) and
    copies did not help there, so steps of more than ``COPIES_MAX_TOKENS`` tokens keep one copy and
    one compile (the few nodes that touch the token buffers are patched: 0.07-0.3 ms at batch 256).
    Each copy is a separate jit of the same function (compiled separately).

    ``cublas_max_tokens``: steps of more than ``GEMV_ROWS`` and at most this many padded tokens
    (decode-sized steps) are compiled with ``CUBLAS_OPTIONS`` on top of ``compiler_options``, so their
    XLA GEMMs are cuBLAS calls; larger (prefill) steps keep XLA's Triton GEMM fusions. 0: never.
    Measured on the H200 (RESULTS.md, session 7): a batch-256 decode step's GPU time -4%, while the
    whole workload with cuBLAS everywhere was 0.89x (its prefill steps slower; session 3).

    ``cudagraph_max_tokens``: steps of more padded tokens than this are compiled with ``EAGER_OPTIONS``
    (no XLA command buffers: each kernel is launched on its own, and the GPU starts on the first while
    the host launches the rest); ``None`` (the default): every step runs as CUDA graphs. Why it exists:
    a large step's graph was re-patched before every launch (1.3-4 ms at batch 256, RESULTS.md
    sessions 6 and 8; fixed in session 11, see ``step``), and launching kernel by kernel did not pay.
    """

    def __init__(self, graphdef: nnx.GraphDef, attention_backend: str = "auto", batch_invariant: bool = False,
                 compiler_options: dict | None = None, mesh=None, decode_gemv: bool = True,
                 fused_qkv: bool = True, fuse_matmul_inputs: bool = False, fused_residual: bool = True,
                 step_executables: int = 1, cublas_max_tokens: int = 0, cudagraph_max_tokens: int | None = None,
                 fused_sampler: bool = True):
        if step_executables < 1:
            raise ValueError(f"step_executables must be >= 1, got {step_executables}")
        self.step_executables = 1 if mesh is not None else step_executables
        self._turns: dict[tuple, int] = {}  # step shape -> the copy that ran it last
        self.cublas_max_tokens = cublas_max_tokens
        self.cudagraph_max_tokens = cudagraph_max_tokens
        self.copies_max_tokens = COPIES_MAX_TOKENS  # (experiments may raise it: benchmarks/profile_step.py)
        self.attention_backend = resolve_backend(attention_backend)
        self.batch_invariant = batch_invariant
        self.compiler_options = dict(compiler_options or {})
        self.mesh = mesh  # tensor parallelism: the step runs per shard under shard_map (jaxpaged.models.sharding)
        self._replicated = None  # the mesh's replicated sharding, made on first use
        ops = get_model_ops(batch_invariant, decode_gemv, fused_qkv, fuse_matmul_inputs, fused_residual)
        if mesh is not None:
            from ..models.sharding import tp_model_ops

            ops = tp_model_ops(ops)
        self._step_fn = make_step_fn(graphdef, get_attention_fn(attention_backend, batch_invariant), write_kv,
                                     ops, batch_invariant, fused_sampler)
        self._jitted: dict = {}  # (state treedef, variant) -> the jitted step's copies (over flat weight leaves)
        self._state: nnx.State | None = None
        self._leaves: list[jax.Array] = []
        self._treedef = None
        self._shapes_seen: set[tuple] = set()
        self.compile_seconds = 0.0
        # The spare token buffer is donated on a GPU only: a CPU has no CUDA graphs, so the recycled
        # buffer buys nothing there, and there ``np.asarray`` may return a view of the buffer itself
        # (cached on the array), which a donated buffer would overwrite under its reader.
        self.donate_spare_tokens = jax.default_backend() == "gpu"

    def make_jitted(self, treedef, compiler_options: dict | None = None) -> Callable:
        """The step jitted over flat weight leaves: ``(leaves, kv_pool, packed, prev_tokens, spare_tokens,
        layout)``, pool and spare donated, ``layout`` static. ``compiler_options``: XLA options for this
        executable only."""
        fn = self._step_fn

        def step(leaves, kv_pool, packed, prev_tokens, spare_tokens, layout):
            del spare_tokens  # donated: the output tokens are written into its buffer (see step())
            packed, prev_tokens = to_step_memory(packed, prev_tokens)  # (stable addresses: see there)
            return fn(jax.tree.unflatten(treedef, leaves), kv_pool, unpack(packed, layout), prev_tokens)

        shardings = {}
        if self.mesh is not None:
            from ..models.sharding import shard_step, step_shardings

            step, shardings = shard_step(step, self.mesh, treedef), step_shardings(self.mesh, treedef)
        # keep_unused: the spare buffer is never read, and jit would otherwise drop it (and its aliasing).
        donate = (1, 4) if self.donate_spare_tokens else (1,)
        return jax.jit(step, donate_argnums=donate, static_argnums=(5,), keep_unused=True,
                       compiler_options=compiler_options or None, **shardings)

    def num_copies(self, num_tokens: int) -> int:
        """How many copies of the step a padded step of ``num_tokens`` tokens uses in turn: all of them
        up to ``copies_max_tokens`` (``COPIES_MAX_TOKENS``) tokens, one above or without CUDA graphs (the
        copies exist for the graphs' buffer addresses; see the class docstring)."""
        if num_tokens > self.copies_max_tokens or "eager" in self.variant(num_tokens):
            return 1
        return self.step_executables

    def variant(self, num_tokens: int) -> str:
        """Which compiled variant a padded step of ``num_tokens`` tokens runs: ``"default"``, or its
        options' names joined by ``+`` (one of ``VARIANTS``): ``"cublas"`` (see ``cublas_max_tokens``),
        ``"eager"`` (see ``cudagraph_max_tokens``)."""
        names = []
        if GEMV_ROWS < num_tokens <= self.cublas_max_tokens:
            names.append("cublas")
        if self.cudagraph_max_tokens is not None and num_tokens > self.cudagraph_max_tokens:
            names.append("eager")
        return "+".join(names) or "default"

    def set_jitted(self, state: nnx.State, jitted: Callable) -> None:
        """Replaces the jitted step for ``state``'s structure, for every step size (experiments with
        compiler options): one jitted function, or a tuple of copies as ``_flat`` returns them."""
        self._flat(state)
        copies = jitted if isinstance(jitted, tuple) else (jitted,)
        for variant in VARIANTS:
            self._jitted[self._treedef, variant] = copies
        self._shapes_seen.clear()

    def _flat(self, state: nnx.State, variant: str = "default"):
        """``(copies, leaves)``: the jitted copies of ``variant`` for ``state``'s structure (made on first
        use) and ``state``'s flat leaves (flattened once per state object)."""
        if state is not self._state:
            self._leaves, self._treedef = jax.tree.flatten(state)
            self._state = state
        key = (self._treedef, variant)
        if key not in self._jitted:
            options = {}
            if variant != "default":
                for name in variant.split("+"):
                    options.update(VARIANT_OPTIONS[name])
            options.update(self.compiler_options)  # the user's own options win
            self._jitted[key] = tuple(self.make_jitted(self._treedef, options)
                                      for _ in range(self.step_executables))
        return self._jitted[key], self._leaves

    def step(self, state: nnx.State, kv_pool: KVPool, inputs: StepInputs,
             prev_tokens: jax.Array | None = None, spare_tokens: jax.Array | None = None) -> tuple[jax.Array, KVPool]:
        """Runs one step; the first call for a new shape bucket compiles (its time is recorded).

        ``prev_tokens``: the previous step's output (default: zeros, one row per sequence slot).
        ``spare_tokens``: a device array of that shape whose value is no longer needed (an earlier
        step's output, already read back): donated on a GPU (``donate_spare_tokens``), and the step
        writes its tokens into it (default: a fresh one). Why: XLA allocates a step's outputs just
        before its temporary buffer; a fresh 1 KB token array each step lands at the start of the free
        space and pushes the temporary buffer up by 1 KB, so every kernel node of the step's CUDA graph
        had to be re-patched before each launch (1.6-2.8 ms of host time at batch 256 on the H200;
        XLA's allocator log, benchmarks/RESULTS.md, session 11). Written into a recycled buffer, the
        temporary buffer keeps its address.
        """
        if prev_tokens is None:
            prev_tokens = np.zeros(inputs.logits_indices.shape, np.int32)
        if spare_tokens is None:
            spare_tokens = jnp.zeros(prev_tokens.shape, jnp.int32)
        num_tokens = inputs.token_ids.shape[0]
        variant = self.variant(num_tokens)
        copies, leaves = self._flat(state, variant)
        if self.mesh is not None:  # one executable for fresh and fed-back tokens (committed or not)
            prev_tokens, spare_tokens = self._replicate(prev_tokens), self._replicate(spare_tokens)
        packed, layout = pack(inputs)  # (a numpy argument: jit's own transfer was measured cheaper
        # than a jax.device_put before the call, 350 vs 467 us a call; bench_dispatch.py, RESULTS.md)
        base_key = (layout, prev_tokens.shape, kv_pool.shape, kv_pool.dtype, variant)
        n = min(len(copies), self.num_copies(num_tokens))
        self._turns[base_key] = turn = (self._turns.get(base_key, -1) + 1) % n  # in turn, per shape
        jitted = copies[turn]
        shape_key = base_key + (turn,)
        with self._partitioner():
            if shape_key not in self._shapes_seen:
                t0 = time.perf_counter()
                tokens, kv_pool = jitted(leaves, kv_pool, packed, prev_tokens, spare_tokens, layout)
                jax.block_until_ready(tokens)
                self.compile_seconds += time.perf_counter() - t0
                self._shapes_seen.add(shape_key)
                return tokens, kv_pool
            return jitted(leaves, kv_pool, packed, prev_tokens, spare_tokens, layout)

    def _partitioner(self):
        """GSPMD for the tensor-parallel step (see :func:`gspmd_partitioner`); nothing on one device."""
        return gspmd_partitioner() if self.mesh is not None else contextlib.nullcontext()

    def _replicate(self, x):
        """``x`` committed to every device of the mesh (a no-op for the previous step's tokens)."""
        if self._replicated is None:
            from jax.sharding import NamedSharding, PartitionSpec

            self._replicated = NamedSharding(self.mesh, PartitionSpec())
        if isinstance(x, jax.Array) and x.committed and x.sharding == self._replicated:
            return x
        return jax.device_put(x, self._replicated)

    @property
    def num_compiled_shapes(self) -> int:
        """Step shapes compiled so far (each copy of a shape, see ``step_executables``, counts once)."""
        return len({key[:-1] for key in self._shapes_seen})

    @property
    def num_compiled_executables(self) -> int:
        """Executables compiled so far: every copy of every shape (what a no-recompile check counts)."""
        return len(self._shapes_seen)

    def compiled(self, state: nnx.State, kv_pool: KVPool, inputs: StepInputs):
        """The step compiled for ``inputs``' shapes (``jax.stages.Compiled``: its HLO text and XLA's memory
        analysis, to check that the pool is never copied). Runs nothing."""
        copies, leaves = self._flat(state, self.variant(inputs.token_ids.shape[0]))
        prev_tokens = np.zeros(inputs.logits_indices.shape, np.int32)
        spare = jax.ShapeDtypeStruct(prev_tokens.shape, jnp.int32)
        packed, layout = pack(inputs)
        with self._partitioner():
            return copies[0].lower(leaves, kv_pool, packed, prev_tokens, spare, layout).compile()

    def lower_text(self, state: nnx.State, kv_pool: KVPool, inputs: StepInputs) -> str:
        """Compiled HLO text of the step for ``inputs``' shapes."""
        return self.compiled(state, kv_pool, inputs).as_text()
