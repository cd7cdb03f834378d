"""The pitfall demonstrations under benchmarks/experiments/pitfalls/ run on a CPU and show what they claim."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PITFALLS = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments" / "pitfalls"


def load(name: str):
    sys.path.insert(0, str(PITFALLS))
    try:
        spec = importlib.util.spec_from_file_location(name, PITFALLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PITFALLS))


def test_timestamp_miss():
    r = load("timestamp_miss").main()
    assert r["inside"]["shared_full_blocks"] < 2 < r["moved"]["shared_full_blocks"]
    assert r["inside"]["hit_rate"] < 0.1 < 0.5 < r["moved"]["hit_rate"]
    assert r["moved"]["hit_blocks_per_request"][1:] == [r["moved"]["shared_full_blocks"]] * 3  # from 'hit' events


def test_tokenizer_trap():
    r = load("tokenizer_trap").main()
    for name in ("non-breaking space", "trailing space", "NFC vs NFD accent", "boundary"):
        assert not r[name]["tokens_equal"] and r[name]["first_diff_token"] is not None, name


def test_pool_too_small():
    r = load("pool_too_small").main()
    small, affinity, host, fixed = r.values()
    assert small["evictions"] == small["evict_events"] > 0
    assert fixed["evictions"] == 0 and fixed["prefill_tokens"] == fixed["unique_prompt_tokens"] < small["prefill_tokens"]
    assert affinity["prefix_hit_rate"] > small["prefix_hit_rate"]
    # The host tier keeps the evicted prefixes: as few prefill tokens as the big pool, from a small one.
    assert host["evictions"] > 0 and host["host_hit_tokens"] > 0
    assert host["prefill_tokens"] == fixed["prefill_tokens"]


def test_nan_reused_blocks():
    r = load("nan_reused_blocks").main()
    assert r["kernel"] == dict(ours_finite=True, naive_finite=False)
    assert r["engine"] == dict(poisoned_pool_same_tokens=True, reused_blocks_same_tokens=True)


def test_bf16_accumulation():
    rows = load("bf16_accumulation").main(["--lengths", "256", "4096"])["rows"]
    assert all(r["fp32_accumulation"] < 3e-3 for r in rows)
    assert rows[1]["bf16_accumulation"] > 2 * rows[0]["bf16_accumulation"] > 2 * rows[0]["fp32_accumulation"]
