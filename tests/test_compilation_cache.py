"""JAX's persistent compilation cache: a second process finds the compiled step on disk."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from jaxpaged import LLMEngine, EngineConfig, SamplingParams, load_params
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path
p = load_params(tiny_checkpoint_path("qwen2"), "float32", use_cache=False)
e = LLMEngine(p, EngineConfig(dtype="float32", block_size=8, num_blocks=32, max_model_len=64))
out = run_to_completion(e, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
print("TOKENS", out[0].outputs[0].token_ids, e.compilation_cache_dir)
"""


def run(env):
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return [line for line in res.stdout.splitlines() if line.startswith("TOKENS")][0]


def test_second_process_reuses_compiled_step(tmp_path):
    cache = tmp_path / "xla"
    env = dict(os.environ, JAXPAGED_COMPILE_CACHE=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    first = run(env)
    entries = set(os.listdir(cache))
    assert entries and str(cache) in first
    second = run(env)
    assert second == first
    assert set(os.listdir(cache)) == entries  # nothing new compiled: every step came from the cache
