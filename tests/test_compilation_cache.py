"""JAX's persistent compilation cache: a second process finds the compiled step on disk."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import jax
counts = {}
jax.monitoring.register_event_listener(lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
from jaxpaged import LLMEngine, EngineConfig, SamplingParams, load_params
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path
p = load_params(tiny_checkpoint_path("qwen2"), "float32", use_cache=False)
e = LLMEngine(p, EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=32, max_model_len=64))
out = run_to_completion(e, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
print("TOKENS", out[0].outputs[0].token_ids, e.compilation_cache_dir)
print("HITS", counts.get("/jax/compilation_cache/cache_hits", 0), "MISSES",
      counts.get("/jax/compilation_cache/cache_misses", 0), "STEP_SECONDS", e.stats()["compile_seconds"])
"""


def run(env):
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    tokens = [line for line in res.stdout.splitlines() if line.startswith("TOKENS")][0]
    _, hits, _, misses, _, seconds = [line for line in res.stdout.splitlines() if line.startswith("HITS")][0].split()
    return tokens, int(hits), int(misses), float(seconds)


def test_second_process_reuses_compiled_step(tmp_path):
    cache = tmp_path / "xla"
    env = dict(os.environ, JAXPAGED_COMPILE_CACHE=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    first, hits1, misses1, _ = run(env)
    entries = set(os.listdir(cache))
    assert entries and str(cache) in first and misses1 > 0
    second, hits2, misses2, _ = run(env)
    assert second == first
    # The second process compiled nothing: every executable came from the cache (JAX's own counters).
    assert misses2 == 0 and hits2 >= misses1
    assert set(os.listdir(cache)) == entries
