"""Test-wide settings: no persistent XLA cache or param cache outside the test's own temp folders."""

import os
import shutil
import tempfile

os.environ.setdefault("JAXPAGED_COMPILE_CACHE", "")  # no jaxpaged caching (compiled steps on disk): tests that
# check it set their own folder
os.environ.setdefault("JAXPAGED_CACHE", tempfile.mkdtemp(prefix="jaxpaged-test-cache-"))
# JAX's own persistent cache, one folder per run (shared by pytest-xdist's workers, which inherit this
# environment): an executable that several test modules compile again (conftest drops jit's caches
# after each module) or several workers compile is compiled once, then loaded.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxpaged-test-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# On a machine without a GPU (CI, the CPU suite): XLA's CPU backend compiles with LLVM's optimisations
# off. Compilation is most of the suite's time (about 85% of its CPU seconds) and the tests' shapes are
# tiny, so faster compiles win over faster code (one bf16 model test: 31 -> 18 s of compile). Every
# test compares results computed under the same setting; subprocesses inherit it.
# LLVM's expensive passes off as well: the interpret-mode Pallas tests compile 5-15% faster (two
# batch-invariance tests: 40.3 -> 37.9 s, 54.4 -> 46.4 s), the others the same.
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()
# Four CPU devices: XLA's CPU client then runs computations on at least four threads, which Mosaic GPU's
# interpreter needs for the warp-specialised prefill kernel (three warpgroups, each a computation that
# blocks its thread at barriers, and the caller's): on two cores it deadlocked
# (``kernels/mosaic/common.interpreter_threads``). Tests use the first device unless they ask for more.
if shutil.which("nvidia-smi") is None and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def sm90_triton_modules(monkeypatch) -> list[str]:
    """The Triton IR (text) of every Pallas-Triton kernel lowered while the test runs, lowered for an sm_90
    GPU without one: ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` fills the list. Each
    module passes MLIR's verifier first, as the GPU's Triton compiler would check it."""
    import types

    from jax._src.pallas.triton import pallas_call_registration as registration

    monkeypatch.setattr(registration, "gpu_info_lib",
                        types.SimpleNamespace(get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90)))
    modules: list[str] = []
    lower_module = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        out = lower_module(*args, **kwargs)
        out.module.operation.verify()  # raises MLIRError naming the op
        modules.append(out.module.operation.get_asm())
        return out

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """``LLMEngine.warmup()`` freezes the heap (``jaxpaged.engine.heap``): each test starts and ends unfrozen, so one
    test's warm-up does not keep another's cyclic garbage alive."""
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True, scope="module")
def _fresh_compile_caches():
    """After each test module, JAX's compiled executables are dropped (``jax.clear_caches``). Why: on a
    CPU every executable keeps ~3 memory mappings of its JIT-compiled code, and the suite's executables
    (interpret-mode kernels, module-level jitted functions with many static configurations) piled up to
    over 55,000 mappings in one process, near Linux's default limit of 65,530 (``vm.max_map_count``),
    where LLVM's next allocation failed and the process segfaulted in a later compile. (Keeping them
    until a process held 20,000 mappings saved no time: 10:25 and 11:04 against 10:14-10:18.)"""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


_COMPILES = {"count": 0, "seconds": 0.0}


def _count_compiles(event: str, duration: float, **_kw) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["count"] += 1
        _COMPILES["seconds"] += duration


def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    config._jaxpaged_compiles = [0, 0.0]  # summed over pytest-xdist workers on the controller


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: hand the counts to the controller
        workeroutput["jaxpaged_compiles"] = (_COMPILES["count"], _COMPILES["seconds"])


def pytest_testnodedown(node, error):
    count, seconds = getattr(node, "workeroutput", {}).get("jaxpaged_compiles", (0, 0.0))
    node.config._jaxpaged_compiles[0] += count
    node.config._jaxpaged_compiles[1] += seconds


def pytest_terminal_summary(terminalreporter, config):
    """The suite's cost in XLA compilations (what keeps it slow on a CPU), printed after the results."""
    count = _COMPILES["count"] + config._jaxpaged_compiles[0]
    seconds = _COMPILES["seconds"] + config._jaxpaged_compiles[1]
    terminalreporter.write_line(f"XLA executables compiled: {count} ({seconds:.0f} s of backend compile)")


# Modules marked slow as a whole (``./dev.sh test -m "not slow"`` is the quick edit-test loop): the
# interpret-mode batch-invariance engine runs, multi-device and multi-process runs, the compilation
# cache's processes, and end-to-end runs of the CLI, the server, README, benchmarks, experiments and notebooks.
SLOW_MODULES = {"test_batch_invariance.py", "test_tensor_parallel.py", "test_compilation_cache.py",
                "test_readme.py", "test_cli.py", "test_warmup.py", "test_api_server.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path
        if path.name in SLOW_MODULES or path.parent.name == "benchmarks":
            item.add_marker(pytest.mark.slow)
