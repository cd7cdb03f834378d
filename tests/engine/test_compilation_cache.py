"""Start-up from the caches: a second process loads every warmed-up step from disk (both sampler
variants) and compiles nothing; no request compiles after the warm-up in either process; a damaged
cache entry is reported once and compiled again, never fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, jax
counts = {}
jax.monitoring.register_event_listener(lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.tiny import tiny_checkpoint_path
import os
preload = os.environ.get("PRELOAD") == "1"  # (a GPU engine preloads by itself, at construction)
llm = LLM(tiny_checkpoint_path("qwen2"), dtype="float32", block_size=16, num_blocks=16, max_model_len=64,
          max_num_batched_tokens=32, max_num_seqs=8, warmup=not preload)
preloading = 0
if preload:
    llm.engine._preload_warmup()
    preloading = len(llm.engine.runner._preloads)
    llm.engine.warmup(use_tqdm=False)
warm = len(compiles)
sps = [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=3)]
out = llm.generate([[1, 2, 3], [4, 5, 6, 7]], sps, use_tqdm=False)
print("RESULT", json.dumps(dict(tokens=[o.outputs[0].token_ids for o in out], cache=llm.engine.compilation_cache_dir,
      xla_misses=counts.get("/jax/compilation_cache/cache_misses", 0), warmup=llm.engine.warmup_profile,
      compiles_during_warmup=warm, compiles_after_warmup=len(compiles) - warm, preloading=preloading,
      preloads_left=len(llm.engine.runner._preloads))))
"""


def run(env) -> tuple[dict, str]:
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")][0]
    return json.loads(line[len("RESULT "):]), res.stderr


def test_second_process_loads_every_step_and_survives_a_damaged_entry(tmp_path):
    cache = tmp_path / "xla"
    env = dict(os.environ, JAXPAGED_COMPILE_CACHE=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_LOG_COMPILES="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # (the suite's own cache: this process uses jaxpaged's)
    first, _ = run(env)
    steps = sorted((tmp_path / "xla-steps").rglob("*.step"))
    assert first["cache"] == str(cache)
    assert len(steps) == first["warmup"]["executables"] == 4  # 2 token buckets x 2 sampler variants
    assert first["warmup"]["loaded"] == 0 and first["compiles_after_warmup"] == 0
    second, stderr = run(env)
    assert second["tokens"] == first["tokens"]
    # Every step came from disk: the step was never traced, lowered or compiled (JAX logs each compile).
    assert second["warmup"]["loaded"] == 4 and "Compiling jit(step)" not in stderr
    assert second["compiles_after_warmup"] == 0
    # Read ahead of the warm-up (as a GPU engine does while it maps its pool): the warm-up takes every
    # preloaded executable, reads none itself and compiles nothing.
    preloaded, stderr = run({**env, "PRELOAD": "1"})
    assert preloaded["preloading"] == 4 and preloaded["preloads_left"] == 0
    assert preloaded["tokens"] == first["tokens"] and preloaded["warmup"]["loaded"] == 4
    assert "Compiling jit(step)" not in stderr and preloaded["compiles_after_warmup"] == 0
    for path in steps:  # damage every entry
        path.write_bytes(b"not an executable")
    third, stderr = run(env)
    assert third["tokens"] == first["tokens"] and third["warmup"]["loaded"] == 0
    assert stderr.count("ignoring an unreadable compiled step") == 1  # one warning, not one per entry
    # Damaged entries are gone, so the next process does not meet them. (On a CPU the steps third compiled
    # came from XLA's persistent cache, and such executables are not stored: their copies fail to run in the
    # next process.)
    assert all(not p.exists() or p.read_bytes() != b"not an executable" for p in steps)


def test_importing_jaxpaged_sets_gpu_memory_growth_and_limit_unless_the_user_set_them():
    """JAX's GPU client maps 75% of the GPU's memory at its first allocation (1.7 s of every start on the
    H200) and caps its allocator there; importing jaxpaged asks it to grow instead, up to 95% of the
    device, and leaves a user's own choices alone."""
    code = ("import os, jaxpaged; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'], "
            "os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])")
    names = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    env = {k: v for k, v in os.environ.items() if k not in names}
    own = {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    procs = {expected: subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)  # (both at once)
             for expected, e in (("false 0.95", env), ("true 0.5", own))}
    for expected, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert out.strip() == expected, err[-2000:]


def test_a_step_for_one_of_several_devices_is_cloned_and_reloaded_for_that_device(tmp_path):
    """A serialised executable comes back for the devices it was compiled for, not every device of the
    backend (the suite has four CPU devices: conftest): a clone, and a copy stored and loaded again."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.engine.executable_cache import ExecutableCache, clone, execution_devices

    assert len(jax.devices()) >= 2
    device = jax.devices()[1]
    x = jax.device_put(jnp.arange(4.0), device)
    compiled = jax.jit(lambda a: a * 2 + 1).lower(x).compile()
    assert execution_devices(compiled) == [device]
    cache = ExecutableCache(tmp_path)
    cache.store("double", compiled)
    for copy in (clone(compiled), cache.load("double")):
        out = copy(x)
        assert out.devices() == {device}
        assert out.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert cache.loaded == 1
