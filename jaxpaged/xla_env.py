"""Process-wide XLA settings the engine can ask for before JAX creates its GPU client (at ``import jaxpaged``).

Why: XLA runs each compiled step as a CUDA graph and, before every launch, patches the graph nodes whose
buffers moved since that graph's last launch. ``xla_gpu_command_buffer_update_mode=SKIP_TEMP`` gives a
step's temporary buffer a fixed virtual address (XLA switches its client to the VMM allocator for that),
so no launch patches the nodes that use it. It was measured as the cure for batch-256 launches that
re-patched all 269 nodes (1.3-4.3 ms of host time per step; H200, benchmarks/RESULTS.md, session 9).
Session 11 found the cause under the default BFC allocator: each step's fresh 1 KB token output pushed
the temporary buffer up by 1 KB. The step now writes its tokens into a recycled buffer
(``ModelRunner.step``), the temporary buffer keeps its address under BFC, and the default allocator
matches SKIP_TEMP's throughput (nano-vllm's workload 24,900 vs 24,948 tok/s on one machine).

The allocator is chosen once per process, when JAX creates its GPU client (on the first device use), from
``XLA_FLAGS``; a per-executable compiler option cannot switch it. So the flag is added to ``XLA_FLAGS`` at
package import, and only on request: ``JAXPAGED_SKIP_TEMP=1`` (and a CUDA plugin installed, and no update
mode chosen by the user). It stays opt-in: it no longer buys throughput, and the whole process loses
``memory_stats()`` (the VMM allocator keeps none), which the memory experiments read. (Session 9 also
measured batch-1 ITL +3-8% under it; session 11's alternating runs did not reproduce that.)
``skip_temp_active`` tells which allocator the process really has (imported after JAX made its GPU client,
the setting is too late).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from collections.abc import MutableMapping

UPDATE_MODE_FLAG = "--xla_gpu_command_buffer_update_mode"
SKIP_TEMP_FLAG = UPDATE_MODE_FLAG + "=SKIP_TEMP"
OPT_IN_ENV = "JAXPAGED_SKIP_TEMP"  # "1": SKIP_TEMP and the VMM allocator for this process


def cuda_plugin_installed() -> bool:
    """Whether a JAX CUDA PJRT plugin is installed (``jax_plugins.xla_cuda*`` or ``jax_cuda*_plugin``),
    without importing JAX's backends."""
    try:
        if importlib.util.find_spec("jax_plugins") is not None:
            import jax_plugins  # noqa: PLC0415  (a namespace package: lists the installed plugins)

            if any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(jax_plugins.__path__)):
                return True
    except (ImportError, ValueError):
        pass
    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def xla_flags_with_skip_temp(xla_flags: str, opt_in: str | None, cuda: bool) -> str:
    """``XLA_FLAGS`` with ``SKIP_TEMP_FLAG`` appended when asked for (``opt_in == "1"``), a CUDA plugin is
    installed and the flags choose no update mode yet; else unchanged."""
    if opt_in != "1" or not cuda or UPDATE_MODE_FLAG in xla_flags:
        return xla_flags
    return f"{xla_flags} {SKIP_TEMP_FLAG}".strip()


def configure(environ: MutableMapping[str, str] | None = None, cuda: bool | None = None) -> bool:
    """Adds the flag to ``environ`` (default ``os.environ``) if ``JAXPAGED_SKIP_TEMP=1`` there; returns
    whether ``XLA_FLAGS`` now asks for SKIP_TEMP (set here or by the user)."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    new = xla_flags_with_skip_temp(flags, env.get(OPT_IN_ENV), cuda_plugin_installed() if cuda is None else cuda)
    if new != flags:
        env["XLA_FLAGS"] = new
    return SKIP_TEMP_FLAG in new


def skip_temp_active(device=None) -> bool:
    """Whether this process runs SKIP_TEMP with XLA's VMM allocator: ``XLA_FLAGS`` asks for it and
    ``device`` (default: this process's first) is a GPU whose allocator keeps no BFC statistics
    (``memory_stats()`` is ``None``), i.e. the setting took effect."""
    import jax  # noqa: PLC0415

    if SKIP_TEMP_FLAG not in os.environ.get("XLA_FLAGS", ""):
        return False
    d = device or jax.local_devices()[0]
    return d.platform == "gpu" and d.memory_stats() is None
