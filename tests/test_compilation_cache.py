"""JAX's persistent compilation cache: a second process finds every compiled step on disk (both
sampler variants, through ``LLM``'s warm-up), and no request compiles after the warm-up in either."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import jax
counts = {}
jax.monitoring.register_event_listener(lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.tiny import tiny_checkpoint_path
llm = LLM(tiny_checkpoint_path("qwen2"), dtype="float32", block_size=8, num_blocks=32, max_model_len=64,
          max_num_batched_tokens=32, max_num_seqs=8)
warm = len(compiles)
sps = [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=3)]
out = llm.generate([[1, 2, 3], [4, 5, 6, 7]], sps, use_tqdm=False)
print("TOKENS", [o.outputs[0].token_ids for o in out], llm.engine.compilation_cache_dir)
print("HITS", counts.get("/jax/compilation_cache/cache_hits", 0), "MISSES",
      counts.get("/jax/compilation_cache/cache_misses", 0), "AFTER_WARMUP", len(compiles) - warm)
"""


def run(env):
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    tokens = [line for line in res.stdout.splitlines() if line.startswith("TOKENS")][0]
    _, hits, _, misses, _, after = [line for line in res.stdout.splitlines() if line.startswith("HITS")][0].split()
    return tokens, int(hits), int(misses), int(after)


def test_second_process_reuses_compiled_steps(tmp_path):
    cache = tmp_path / "xla"
    env = dict(os.environ, JAXPAGED_COMPILE_CACHE=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    first, hits1, misses1, after1 = run(env)
    entries = set(os.listdir(cache))
    assert entries and str(cache) in first and misses1 >= 4  # 2 token buckets x 2 sampler variants, at least
    assert after1 == 0  # the greedy and the top-p request ran on executables the warm-up compiled
    second, hits2, misses2, after2 = run(env)
    assert second == first
    # The second process compiled nothing: every executable came from the cache (JAX's own counters).
    assert misses2 == 0 and hits2 >= misses1 and after2 == 0
    assert set(os.listdir(cache)) == entries
