"""Every experiment's ``--full`` code path (the design notes' workloads, as the H200 runs them) at tiny
sizes (``--tiny-override``), so it cannot rot; and the 7B shapes the ``--model qwen2.5-7b`` runs use."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")

from flax import nnx  # noqa: E402

from jaxpaged.models.config import QwenConfig  # noqa: E402
from jaxpaged.models.qwen import Qwen  # noqa: E402
from jaxpaged.workloads import QWEN2_5_7B  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    path = ROOT / "benchmarks" / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_rows(report: dict, experiments: set[str]) -> None:
    rows = report["design_notes_rows"]
    assert {r["experiment"] for r in rows} == experiments
    for r in rows:
        assert r["design_notes"] and r["ours"] and r["model"] == "tiny"


def test_qwen2_5_7b_shapes():
    cfg = QwenConfig.from_dict(QWEN2_5_7B)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (28, 3584, 28, 4, 128, 18944, 152064)
    assert not cfg.tie_word_embeddings
    assert cfg.kv_bytes_per_token(2) == 28 * 2 * 4 * 128 * 2  # 56 KiB of bf16 K/V per token
    abstract = nnx.eval_shape(lambda: Qwen(cfg, "bfloat16", rngs=nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))
    assert 7.5e9 < n < 7.7e9  # Qwen2.5-7B has 7.62B parameters


def test_exp_memory_full_path(tmp_path):
    report = load("exp_memory").main(["--full", "--tiny-override", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "memory.json").read_text()).keys() == report.keys()
    check_rows(report, {"memory_64x8", "memory_7b_32"})
    for w in report["workloads"].values():
        contiguous, paged, fp8 = w["results"]
        assert (contiguous["policy"], paged["policy"], fp8["policy"]) == ("max_len", "paged", "paged fp8")
        assert contiguous["output_tokens"] == paged["output_tokens"] == fp8["output_tokens"]
        assert fp8["peak_kv_allocated_bytes"] < paged["peak_kv_allocated_bytes"] < contiguous["peak_kv_allocated_bytes"]
        assert paged["kv_holding_tokens_at_peak_bytes"] <= paged["peak_kv_allocated_bytes"]
        for r in (contiguous, paged, fp8):
            assert r["device_memory"]["peak_bytes_in_use"] is None  # CPU: no allocator statistics
            assert r["weights_plus_peak_kv_bytes"] == r["weights_bytes"] + r["peak_kv_allocated_bytes"]


def test_exp_prefix_cache_full_path(tmp_path):
    report = load("exp_prefix_cache").main(["--full", "--tiny-override", "--out", str(tmp_path)])
    check_rows(report, {"prefix_ttft", "prefix_concurrency", "timestamp_miss"})
    by = {(p["caching"], p["concurrency"]): p for p in report["sweep"]}
    assert set(by) == {(c, n) for c in (False, True) for n in (1, 4)}
    for n in (1, 4):
        assert by[(True, n)]["prefill_tokens"] < by[(False, n)]["prefill_tokens"]
        assert by[(True, n)]["differ_from_caching_off"]["num_differ"] == 0  # float32
    assert by[(True, 1)]["prefix_hit_rate"] > 0.5
    ts = report["timestamp"]
    assert ts["first_diff_block"] == 2 and ts["hit_rate_inside"] < ts["hit_rate_moved"]
    # Cached prefixes at the same memory: round robin over 4 prefixes through a pool holding ~60% of
    # them evicts each before its turn; an fp8 pool of the same bytes keeps them all.
    full, fp8 = report["capacity"]["runs"]
    assert fp8["kv_dtype"] == "float8_e4m3fn" and fp8["kv_pool_bytes"] <= full["kv_pool_bytes"]
    assert fp8["num_blocks"] > 3 * full["num_blocks"]  # float32 tiny model: 4 bytes -> 1 (+ a scale row)
    assert full["prefix_hit_rate"] < 0.15 < 0.4 < fp8["prefix_hit_rate"]  # (a prefix's first blocks may outlive it)
    assert fp8["prefixes_cached"] >= 4 > full["prefixes_cached"]
    assert (tmp_path / "prefix_cache_tiny.png").is_file()


def test_exp_block_size_full_path(tmp_path):
    report = load("exp_block_size").main(["--full", "--tiny-override", "--out", str(tmp_path)])
    check_rows(report, {"block_size"})
    assert [m["block_size"] for m in report["mixed"]] == [16, 32] and report["outputs_identical"]
    assert report["mixed"][0]["mean_block_utilisation"] > report["mixed"][1]["mean_block_utilisation"]


def test_exp_prefix_affinity(tmp_path):
    report = load("exp_prefix_affinity").main(["--full", "--tiny-override", "--out", str(tmp_path)])
    check_rows(report, {"prefix_affinity"})
    fcfs, aff = report["results"]
    assert (fcfs["policy"], aff["policy"]) == ("fcfs", "prefix_affinity")
    assert aff["differ_from_fcfs"]["num_differ"] == 0  # float32: same tokens whatever the order
    assert fcfs["output_tokens"] == aff["output_tokens"]
    # Measured on this workload: hit rate 64.1% -> 67.8%, 465 -> 417 prefill tokens, 12 -> 9 evictions.
    assert aff["prefix_hit_rate"] > fcfs["prefix_hit_rate"] and aff["prefill_tokens"] < fcfs["prefill_tokens"]
    assert aff["evictions"] < fcfs["evictions"]
    assert 0 < aff["max_passes_observed"] <= 9 and fcfs["reordered_admissions"] == 0
    assert (tmp_path / "prefix_affinity.json").is_file() and (tmp_path / "prefix_affinity.png").is_file()


def test_exp_prefix_affinity_host_only_at_full_size():
    """The full-size schedule without a model (a second on a CPU): affinity computes far fewer
    prefill tokens and nothing waits longer than the bound allows."""
    fcfs, aff = load("exp_prefix_affinity").main(["--full", "--host-only"])["host_only"]
    assert aff["prefill_tokens"] < fcfs["prefill_tokens"] and aff["prefix_hit_rate"] > fcfs["prefix_hit_rate"]
    assert aff["steps"] < fcfs["steps"] and aff["ttft_steps_p99"] < fcfs["ttft_steps_p99"]


def test_run_design_notes_driver(tmp_path):
    """One job end to end at tiny sizes (a subprocess), then a job marked as timed out: the table
    holds our row, the failure in its cells, and '-' where nothing ran."""
    driver = load("run_design_notes")
    table = driver.main(["--out", str(tmp_path), "--tiny", "--only", "affinity-0.6b", "--limit", "120"])
    (tmp_path / "prefix-7b").mkdir()
    (tmp_path / "prefix-7b" / "status.json").write_text(json.dumps(dict(job="prefix-7b", status="TIMEOUT after 180 s")))
    table = driver.main(["--out", str(tmp_path), "--table-only"])
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()[2:]}
    assert set(rows) == set(driver.EXPERIMENTS)
    assert rows["prefix_affinity"][2].startswith("hit rate") and rows["prefix_affinity"][3] == "- |"
    assert rows["prefix_ttft"][3].startswith("TIMEOUT") and rows["prefix_ttft"][2] == "-"
    assert (tmp_path / "design_notes.md").read_text() == table
