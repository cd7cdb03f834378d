"""benchmarks/check_invariance.py in its --tiny CPU mode: every section runs and reports."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import check_invariance  # noqa: E402
import pytest  # noqa: E402


# The arrangements the script checks one by one are the engine's own batch-invariance tests
# (tests/engine/test_batch_invariance.py); here one of them, in the invariant mode, proves the section works.
SKIP = ["batched, cache off", "batched, cache cold", "batched, cache warm", "reversed arrival", "block size 8",
        "chunk budget", "sync scheduling", "tiny pool (preempts)"]


@pytest.mark.slow  # tens of seconds on a CPU (interpret-mode Pallas kernels)
def test_check_invariance_tiny(tmp_path):
    # (the throughput section is bench_throughput's own run, tested in test_bench_tools.py; the hf section's
    # comparison with transformers is tests/models/test_model_vs_hf.py's)
    report = check_invariance.main(["--tiny", "--requests", "2", "--max-tokens", "2", "--modes", "True", "--skip-arrangements", *SKIP,
                                    "--sections", "precision", "rows", "arrangements", "--out", str(tmp_path)])
    assert (tmp_path / "check_invariance.json").exists()
    assert report["precision"]["pallas_matmul"] < 1e-5 and report["precision"]["pallas_attention_invariant"] < 1e-5
    assert all(c == 0 for c in report["rows"]["pallas_fixed_tile"].values())
    invariant = report["arrangements"]["modes"]["True"]
    assert set(invariant) == {"alone_seconds", "staggered arrival"}
    assert all(v["num_differ"] == 0 for k, v in invariant.items() if k != "alone_seconds")
    assert "hf" not in report and "throughput" not in report
