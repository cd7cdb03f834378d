"""ModelRunner: the jitted step ``(weights, kv_pool, inputs) -> (tokens, kv_pool)``, pool donated.

Everything the device does in one engine iteration is one XLA program: embed, every layer (K/V
written in place into the donated pool, paged attention), the final norm, logits only at the
sampled positions, and sampling. The graph definition, the attention function and the model's ops
are fixed per runner, so they are closed over; weights and pool are arguments (never constants).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kernels import lowered_once
from ..kernels.gemv import ROWS as GEMV_ROWS
from ..kernels.kv_write import write_kv
from ..models.attention_backends import get_attention_fn, resolve_backend
from ..models.ops import get_model_ops
from ..models.qwen import DEFAULT_OPS, KVPool, ModelOps
from ..sampling.features import RowInputs, resample_rows, sample_step
from .executable_cache import clone, compile_step
from .step_inputs import StepInputs, pack, to_step_memory, unpack
from .tuning import StepTuning


def gspmd_partitioner():
    """A context in which jit partitions with GSPMD instead of Shardy (the tensor-parallel step only).

    Why: XLA's GPU compiler segfaults while compiling the tensor-parallel step (shard_map over the
    ``tp`` mesh) when Shardy partitions it, whatever the step's options; with GSPMD it compiles and
    runs (``benchmarks/bench_tp.py``; docs/DECISIONS.md has the versions).
    Scoped to the step's trace and compile, never set globally; it is part of jit's cache key, so every
    call of the step runs inside it.
    """
    from jax._src import config as jax_config  # the State behind jax_use_shardy_partitioner

    state = getattr(jax_config, "use_shardy_partitioner", None)
    return state(False) if state is not None else contextlib.nullcontext()


def enable_compilation_cache(cache_dir: str | Path | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache, so a new process reuses compiled steps.

    Leaves an existing user setting alone. Directory: ``cache_dir``, else ``$JAXPAGED_COMPILE_CACHE``,
    else ``~/.cache/jaxpaged/xla``. Returns the directory in use; ``None`` (no caching by jaxpaged, the
    compiled steps on disk included) if ``$JAXPAGED_COMPILE_CACHE`` is set and empty.
    """
    if cache_dir is None and os.environ.get("JAXPAGED_COMPILE_CACHE") == "":
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = cache_dir or os.environ.get("JAXPAGED_COMPILE_CACHE") or str(Path.home() / ".cache" / "jaxpaged" / "xla")
    jax.config.update("jax_compilation_cache_dir", str(path))
    try:  # a compilation before this point (any jnp call) settled "no cache" for the whole process
        from jax._src import compilation_cache as jax_cache

        if getattr(jax_cache, "_cache_checked", False) and not getattr(jax_cache, "_cache_used", True):
            jax_cache.reset_cache()
    except ImportError:
        pass
    return str(path)


def make_step_fn(graphdef: nnx.GraphDef, attention_fn: Callable, write_kv_fn: Callable,
                 ops: ModelOps = DEFAULT_OPS, batch_invariant: bool = False) -> Callable:
    """The pure step function (not jitted): used by ``ModelRunner`` and by HLO inspection tests.
    ``ops``: the model's matmul / RMSNorm (``models.ops.get_model_ops``); ``batch_invariant``:
    fixed-order sums in the sampler. A ``uniform_decode`` step (``StepInputs``) tells ``attention_fn``
    so (its ``uniform_decode=True``; the backends that compile decode steps apart read it)."""
    decode_attention_fn = functools.partial(attention_fn, uniform_decode=True)  # (one object: jit's cache key)

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
                                attention_fn=decode_attention_fn if inputs.uniform_decode else attention_fn,
                                write_kv_fn=write_kv_fn, ops=ops)
        # Logits at the sampled positions, then the sampler (plus penalties / logprobs in their variants).
        tokens, aux = sample_step(hidden, lambda h: model.compute_logits(h, ops), inputs, token_ids, batch_invariant)
        out = jnp.zeros_like(prev_tokens).at[: tokens.shape[0]].set(tokens)
        return ((out, aux) if aux else out), kv_pool

    return step


# XLA options of the steps that ``StepTuning.cublas_max_tokens`` covers: XLA's GEMMs through cuBLAS.
CUBLAS_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
# Every step: no HLO rematerialisation. The pass sizes a program against the device's memory and
# counts the donated KV pool more than once, so a pool of most of the GPU made it print "Can't reduce memory use below ... by rematerialization" at every compile
# while finding nothing to recompute (an inference step keeps no activations to trade).
# Autotuning at level 2: XLA still times its GEMM candidates on initialised buffers and keeps the
# fastest, but does not check each candidate's output against a reference GEMM (level 4, the default),
# the critical path of a cold warm-up (docs/DECISIONS.md).
STEP_OPTIONS = {"xla_disable_hlo_passes": "rematerialization", "xla_gpu_autotune_level": 2}


class ModelRunner:
    """Owns the jitted step for one model, attention backend and numerics mode; counts compilations.

    ``mesh``: a tensor-parallel mesh (``models/sharding.py``): ``graphdef`` is then the per-shard
    model and the step body runs on every shard under ``shard_map``; ``None`` is the plain step.
    ``batch_invariant``: every token's result is bitwise independent of the batch it is computed in
    (docs/NUMERICS.md). ``tuning``: bucketing and compilation choices (``tuning.StepTuning``).

    The weights are passed to the jitted function as a flat list of arrays, flattened once per
    state object: flattening an NNX ``State`` in Python on every call would cost host time every step,
    while a list of arrays goes through jit's C++ fast path. The step's inputs travel packed in one buffer
    (``step_inputs.pack``: one host-to-device copy instead of 13) with a static ``StepLayout``.

    Copies (``tuning.step_executables``): a step's CUDA graph records the address of every buffer its
    kernels touch, and XLA patches the nodes whose buffers moved before each launch. With async
    scheduling the token buffers a step reads and writes alternate between two; with two copies of
    each small step used in turn, each copy always sees the same two, and no launch waits for a
    patch. Steps above ``tuning.copies_max_tokens`` keep one copy and one compile.
    Decode-sized steps (more than the GEMV's 32 rows, at most ``tuning.cublas_max_tokens``) compile
    with ``CUBLAS_OPTIONS``; larger (prefill) steps keep XLA's Triton GEMM fusions.
    """

    def __init__(self, graphdef: nnx.GraphDef, attention_backend: str = "auto", batch_invariant: bool = False,
                 mesh=None, tuning: StepTuning | None = None):
        tuning = tuning or StepTuning.default(batch_invariant)
        self.tuning = tuning
        self.step_executables = 1 if mesh is not None else tuning.step_executables
        self._turns: dict[tuple, int] = {}  # step shape -> the copy that ran it last
        self.attention_backend = resolve_backend(attention_backend)
        self.batch_invariant = batch_invariant
        self.mesh = mesh
        self._replicated = None  # the mesh's replicated sharding, made on first use
        ops = get_model_ops(batch_invariant)
        if mesh is not None:
            from ..models.sharding import tp_model_ops

            ops = tp_model_ops(ops)
        self._step_fn = make_step_fn(graphdef, get_attention_fn(attention_backend, batch_invariant), write_kv,
                                     ops, batch_invariant)
        self._jitted: dict = {}  # (state treedef, cublas?) -> the jitted step's copies (over flat weight leaves)
        self._state: nnx.State | None = None
        self._leaves: list[jax.Array] = []
        self._treedef = None
        self._shapes_seen: set[tuple] = set()
        self.compile_seconds = 0.0
        # The last precompile's split: executables, seconds tracing and lowering (one at a time; Pallas
        # kernels compile here), seconds of XLA compilation (in parallel threads).
        self.last_precompile: dict = {}
        # Steps compiled ahead of time (``precompile``), called directly by ``step``; on one device they
        # are also kept on disk when the engine gives an ``ExecutableCache`` (``executable_cache.py``).
        self._executables: dict[tuple, Any] = {}
        self.executable_cache = None
        self._preloads: dict[str, concurrent.futures.Future] = {}  # executables being read from disk (preload)
        # The spare token buffer is donated on a GPU only: a CPU has no CUDA graphs, so the recycled
        # buffer buys nothing there, and there ``np.asarray`` may return a view of the buffer itself
        # (cached on the array), which a donated buffer would overwrite under its reader.
        self.donate_spare_tokens = jax.default_backend() == "gpu"
        # Structured outputs' second program (``features.resample_rows``): the step's tokens and
        # logprobs donated where the spare token buffer is.
        self._resample = jax.jit(functools.partial(resample_rows, batch_invariant=batch_invariant),
                                 donate_argnums=(0, 3) if self.donate_spare_tokens else ())

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
                       compiler_options={**STEP_OPTIONS, **(compiler_options or {})}, **shardings)

    def num_copies(self, num_tokens: int) -> int:
        """How many copies of the step a padded step of ``num_tokens`` tokens uses in turn."""
        return self.step_executables if num_tokens <= self.tuning.copies_max_tokens else 1

    def uses_cublas(self, num_tokens: int) -> bool:
        """Whether a padded step of ``num_tokens`` tokens compiles its GEMMs as cuBLAS calls."""
        return GEMV_ROWS < num_tokens <= self.tuning.cublas_max_tokens

    def _flat(self, state: nnx.State, cublas: bool = False):
        """``(copies, leaves)``: the jitted copies for ``state``'s structure (made on first use) and
        ``state``'s flat leaves (flattened once per state object)."""
        if state is not self._state:
            self._leaves, self._treedef = jax.tree.flatten(state)
            self._state = state
        key = (self._treedef, cublas)
        if key not in self._jitted:
            options = CUBLAS_OPTIONS if cublas else None
            self._jitted[key] = tuple(self.make_jitted(self._treedef, options) for _ in range(self.step_executables))
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
        had to be re-patched before each launch (XLA's allocator log). Written into a recycled buffer,
        the temporary buffer keeps its address.
        """
        if prev_tokens is None:
            prev_tokens = self.token_buffer(inputs.logits_indices.shape[0])
        if spare_tokens is None:
            spare_tokens = self.token_buffer(prev_tokens.shape[0])
        num_tokens = inputs.token_ids.shape[0]
        cublas = self.uses_cublas(num_tokens)
        copies, leaves = self._flat(state, cublas)
        if self.mesh is not None:  # one executable for fresh and fed-back tokens (committed or not)
            prev_tokens, spare_tokens = self._replicate(prev_tokens), self._replicate(spare_tokens)
        packed, layout = pack(inputs)  # (a numpy argument: jit's own transfer costs the host less
        # than a jax.device_put before the call)
        base_key = self._base_key(layout, prev_tokens, kv_pool, cublas)
        n = min(len(copies), self.num_copies(num_tokens))
        self._turns[base_key] = turn = (self._turns.get(base_key, -1) + 1) % n  # in turn, per shape
        jitted = copies[turn]
        shape_key = base_key + (turn,)
        exe = self._executables.get(shape_key)
        if exe is not None:  # compiled ahead of time, or loaded from disk: no jit dispatch
            return exe(leaves, kv_pool, packed, prev_tokens, spare_tokens)
        with self._partitioner():
            if shape_key not in self._shapes_seen:
                t0 = time.perf_counter()
                tokens, kv_pool = jitted(leaves, kv_pool, packed, prev_tokens, spare_tokens, layout)
                jax.block_until_ready(tokens)
                self.compile_seconds += time.perf_counter() - t0
                self._shapes_seen.add(shape_key)
                return tokens, kv_pool
            return jitted(leaves, kv_pool, packed, prev_tokens, spare_tokens, layout)

    def resample_rows(self, tokens: jax.Array, logits: jax.Array, rows: RowInputs,
                      logprobs: dict | None = None) -> tuple[jax.Array, dict | None]:
        """Structured outputs: a ``constrained`` step's rows ``rows`` sampled again from its ``logits``
        under their token masks (``features.resample_rows``); returns the step's tokens and logprobs
        with those rows replaced (the originals donated on a GPU). Compiled on first use per shape."""
        if self.mesh is not None:
            rows = jax.tree.map(self._replicate, rows)
        with self._partitioner():
            return self._resample(tokens, logits, rows, logprobs)

    @staticmethod
    def _base_key(layout, prev_tokens, kv_pool, cublas: bool) -> tuple:
        """What selects a compiled step (a copy's index is appended): the static layout, the token
        buffers' and pool's shapes and the pool's dtype, and the cuBLAS option."""
        return (layout, prev_tokens.shape, kv_pool.shape, kv_pool.dtype, cublas)

    def token_buffer(self, rows: int) -> jax.Array:
        """A zeroed ``i32[rows]`` token buffer committed where the step's outputs live (the first device,
        or replicated over the mesh), so fresh buffers and fed-back outputs select one executable."""
        return self.committed(np.zeros(rows, np.int32))

    def committed(self, x: np.ndarray) -> jax.Array:
        """``x`` committed where the step's outputs live (the first device, or replicated over the mesh)."""
        if self.mesh is not None:
            return self._replicate(x)
        return jax.device_put(x, jax.local_devices()[0])

    def preload(self, kv_pool, steps: list[StepInputs], prev_tokens) -> None:
        """Starts reading from ``executable_cache``, in threads, the executables ``precompile`` will want
        for ``steps`` (it then takes them instead of reading them itself). ``kv_pool`` and ``prev_tokens``
        need only their shapes and dtypes: the engine calls this before it makes its pool, so that
        reading the executables overlaps mapping the pool's memory (reading them allocates no device
        memory of the pool's allocator). Shapes already compiled or read are skipped; reads the next
        ``precompile`` does not want are dropped there (an engine that never warms up keeps its reads
        until its weights are dropped)."""
        cache = self.executable_cache
        if cache is None or self.mesh is not None:
            return
        names = []
        for inputs in steps:
            cublas = self.uses_cublas(inputs.token_ids.shape[0])
            key = self._base_key(pack(inputs)[1], prev_tokens, kv_pool, cublas) + (0,)
            if key not in self._shapes_seen and repr(key) not in self._preloads:  # (not compiled or read yet)
                names.append(repr(key))
        if names:
            readers = concurrent.futures.ThreadPoolExecutor(min(len(names), os.cpu_count() or 1),
                                                            thread_name_prefix="jaxpaged-preload")
            self._preloads.update((name, readers.submit(cache.load, name)) for name in names)
            readers.shutdown(wait=False)  # (the threads end with their reads)

    def _load(self, name: str):
        """The executable stored for ``name``: the preloaded one (``preload``), else read now."""
        future = self._preloads.pop(name, None)
        return future.result() if future is not None else self.executable_cache.load(name)

    def precompile(self, state: nnx.State, kv_pool: KVPool, steps: list[StepInputs], prev_tokens: jax.Array,
                   threads: int | None = None) -> list[tuple[StepInputs, int]]:
        """Compiles, without running, every copy of the step for each of ``steps``' shapes not compiled
        yet; returns ``(inputs, copy)`` for each. An executable in ``executable_cache`` is loaded
        instead (no tracing, lowering or compiling). Otherwise every shape is traced here, the Mosaic GPU
        kernels they launch are exported in worker processes at once (``lowered_once.export_traced``),
        the shapes are lowered here in turn, and XLA's compilations run in ``threads`` threads at once
        (default: the host's cores), each starting as soon as its shape is lowered. ``last_precompile``:
        lowering seconds (tracing, kernel exports and lowering: the time XLA's compilations overlap;
        the first two also apart), seconds left after the last lowering, the whole, and the slowest
        compilation. A shape's first
        copy is compiled (or loaded); its other copies are clones of it (``executable_cache.clone``),
        never lowered or compiled again. ``step`` then calls these executables directly (on a mesh:
        through jit, whose cache they fill)."""
        spare = self.token_buffer(prev_tokens.shape[0])
        if self.mesh is not None:
            prev_tokens, spare = self._replicate(prev_tokens), self._replicate(spare)
        wanted, todo, done = [], [], []
        cache = self.executable_cache if self.mesh is None else None
        t0 = time.perf_counter()
        with self._partitioner():
            for inputs in steps:
                num_tokens = inputs.token_ids.shape[0]
                cublas = self.uses_cublas(num_tokens)
                copies, leaves = self._flat(state, cublas)
                packed, layout = pack(inputs)
                base_key = self._base_key(layout, prev_tokens, kv_pool, cublas)
                if base_key + (0,) not in self._shapes_seen:
                    turns = min(len(copies), self.num_copies(num_tokens))
                    wanted.append((base_key, inputs, turns, copies[0], (leaves, packed, layout)))
            compile_times: list[tuple[str, float]] = []

            def finish(base_key, turns, exe=None, lowered=None):
                """A shape's executables: ``exe`` loaded, or ``lowered`` compiled (and stored); then its clones."""
                if exe is None:
                    tc = time.perf_counter()
                    exe, storable = compile_step(lowered)
                    compile_times.append((repr(base_key[0]), time.perf_counter() - tc))
                    if cache is not None and storable:
                        cache.store(repr(base_key + (0,)), exe)
                return [exe] + [clone(exe) for _ in range(1, turns)] if self.mesh is None else [exe]

            with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
                # Executables on disk load in parallel (each load is mostly XLA's runtime, not Python).
                loads = (list(pool.map(lambda w: self._load(repr(w[0] + (0,))), wanted)) if cache
                         else [None] * len(wanted))
                futures = {}
                for i, loaded in enumerate(loads):
                    if loaded is not None:
                        futures[i] = pool.submit(finish, wanted[i][0], wanted[i][2], exe=loaded)
                # The rest: traced here, then the Mosaic GPU kernels they launch exported in worker
                # processes at once (kernels/lowered_once.py), then lowered one at a time here (largest
                # first: the longest compilations start first), each handed to XLA's compiler in a
                # thread as soon as it is lowered.
                todo = sorted((i for i, loaded in enumerate(loads) if loaded is None),
                              key=lambda i: -wanted[i][1].token_ids.shape[0])
                tl = time.perf_counter()
                traced = {}
                for i in todo:
                    _, _, _, jitted, (leaves, packed, layout) = wanted[i]
                    traced[i] = jitted.trace(leaves, kv_pool, packed, prev_tokens, spare, layout)
                trace_seconds = time.perf_counter() - tl
                lowered_once.export_traced()
                export_seconds = time.perf_counter() - tl - trace_seconds
                for i in todo:
                    base_key, _, turns, _, _ = wanted[i]
                    futures[i] = pool.submit(finish, base_key, turns, lowered=traced[i].lower())
                lower_seconds = time.perf_counter() - tl
                t1 = time.perf_counter()
                for i, (base_key, inputs, turns, _, _) in enumerate(wanted):
                    exes = futures[i].result()
                    if self.mesh is None:
                        self._executables.update((base_key + (turn,), exe) for turn, exe in enumerate(exes))
                    done.append((base_key, inputs, turns, exes[0]))
        for base_key, _, turns, _ in done:
            self._shapes_seen.update(base_key + (turn,) for turn in range(turns))
        self._preloads.clear()  # (reads this warm-up did not want: not kept alive with the weights)
        t2 = time.perf_counter()
        self.compile_seconds += t2 - t0
        self.last_precompile = {"executables": sum(turns for _, _, turns, _ in done),
                                "loaded": len(done) - len(todo), "lower_seconds": lower_seconds,
                                "trace_seconds": trace_seconds, "kernel_export_seconds": export_seconds,
                                "compile_seconds": t2 - t1, "wall_seconds": t2 - t0,
                                "slowest_compile_seconds": max((t for _, t in compile_times), default=0.0),
                                "slowest_compile": max(compile_times, key=lambda c: c[1], default=("", 0))[0]}
        return [(inputs, turn) for _, inputs, turns, _ in done for turn in range(turns)]

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
        copies, leaves = self._flat(state, self.uses_cublas(inputs.token_ids.shape[0]))
        prev_tokens = np.zeros(inputs.logits_indices.shape, np.int32)
        spare = jax.ShapeDtypeStruct(prev_tokens.shape, jnp.int32)
        packed, layout = pack(inputs)
        with self._partitioner():
            return copies[0].lower(leaves, kv_pool, packed, prev_tokens, spare, layout).compile()

    def lower_text(self, state: nnx.State, kv_pool: KVPool, inputs: StepInputs) -> str:
        """Compiled HLO text of the step for ``inputs``' shapes."""
        return self.compiled(state, kv_pool, inputs).as_text()
