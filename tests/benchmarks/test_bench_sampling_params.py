"""benchmarks/bench_sampling_params.py runs end to end in its tiny CPU mode and writes its report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~20 s on a CPU
def test_bench_sampling_params_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_sampling_params",
                                                  ROOT / "benchmarks" / "bench_sampling_params.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # The default step twice and one variant that compiles its own step (the others are the engine's
    # sampling tests' subject: tests/sampling/).
    variants = ["baseline", "logprobs=5", "baseline2"]
    report = mod.main(["--model", "tiny", "--num-seqs", "4", "--out", str(tmp_path), "--variants", ",".join(variants)])
    assert set(report["variants"]) == set(variants) <= set(mod.VARIANTS)
    tokens = {r["output_tokens"] for r in report["variants"].values()}
    # ignore_eos: every variant generates every request's max_tokens (8 + i % 5 in the tiny mode)
    assert tokens == {sum(8 + i % 5 for i in range(4))}
    assert report["variants"]["baseline2"]["new_shapes"] == 0  # nothing new to compile for the default step
    assert report["variants"]["logprobs=5"]["new_shapes"] > 0  # a variant of its own
    assert json.loads((tmp_path / "bench_sampling_params.json").read_text())["num_seqs"] == 4
    assert capsys.readouterr().out.splitlines()[-1 - len(variants)].startswith("variant")  # the table
