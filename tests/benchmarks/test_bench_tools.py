"""The benchmarks and tools/profile_step.py run end to end on the tiny checkpoint (CPU) and report what they promise."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name: str, folder: str = "benchmarks"):
    if str(ROOT / "benchmarks") not in sys.path:  # the benchmarks import their helpers (floor.py) as scripts do
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_step_tiny(tmp_path, capsys):
    mod = load("profile_step", "tools")
    result = mod.main(["--model", "tiny", "--batch", "4", "--ctx", "24", "--steps", "3", "--warmup-steps", "1",
                       "--step-executables", "3", "--copies-max-tokens", "64", "--out", str(tmp_path)])
    assert result["steady"]["prefill_steps"] >= 1
    # The command line's StepTuning over the CPU's defaults (bucket 16, no cuBLAS).
    assert result["tuning"] == dict(min_token_bucket=16, step_executables=3, cublas_max_tokens=0,
                                    copies_max_tokens=64)
    # Three copies used in turn for the 16-token decode steps (bucket 16 on the CPU): two more executables.
    assert result["compiled_executables"] >= result["compiled_shapes"] + 2
    assert len(result["untraced"]["wall_s"]) == 3 and result["untraced"]["wall_median_s"] > 0
    assert result["untraced"]["recompiles"] == 0 and result["traced"]["recompiles"] == 0
    trace = result["trace"]
    assert trace is not None and Path(result["trace_file"]).exists()
    assert trace["marked_steps"] == 3  # every traced step's annotation is in the trace
    saved = json.loads((tmp_path / "profile_step.json").read_text())
    assert saved["batch"] == 4 and saved["ctx"] == 24
    assert "wall per step, untraced" in capsys.readouterr().out


def test_trace_analysis_on_a_synthetic_gpu_trace():
    mod = load("profile_step", "tools")
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    ev = []
    for step in range(2):
        base = step * 1000.0
        ev.append({"ph": "X", "pid": 1, "tid": 1, "ts": base, "dur": 900.0, "name": f"profile_step:engine.step #{step}"})
        ev.append({"ph": "X", "pid": 2, "tid": 7, "ts": base + 100, "dur": 2.0, "name": "MemcpyH2D"})
        ev.append({"ph": "X", "pid": 2, "tid": 7, "ts": base + 200, "dur": 100.0, "name": "loop_add_fusion_3"})
        ev.append({"ph": "X", "pid": 2, "tid": 7, "ts": base + 250, "dur": 100.0, "name": "loop_add_fusion.12"})
        ev.append({"ph": "X", "pid": 2, "tid": 7, "ts": base + 400, "dur": 50.0, "name": "paged_attention_kernel"})
        ev.append({"ph": "X", "pid": 2, "tid": 7, "ts": base + 500, "dur": 1.0, "name": "MemcpyD2H"})
        ev.append({"ph": "X", "pid": 2, "tid": 9, "ts": base + 200, "dur": 300.0, "name": "add.3"})  # derived line
    a = mod.analyse_trace(meta + ev, steps=2)
    assert a["device"] == "/device:GPU:0" and a["stream_lines"] == ["Stream #7(Compute)"]
    assert a["kernel_count_per_step"] == 3
    assert a["kernel_us_per_step"] == 250.0  # 100 + 100 + 50 per step: the sum, overlaps counted in full
    assert a["kernel_busy_us_per_step"] == pytest.approx(200.0)  # the two fusions overlap by 50 us
    assert a["busy_us_per_step"] == pytest.approx(203.0)
    assert a["top"][0]["name"] == "loop_add_fusion" and a["top"][0]["calls_per_step"] == 2
    assert a["copies"]["h2d"]["count_per_step"] == 1 and a["copies"]["d2h"]["count_per_step"] == 1
    assert [s["h2d"] for s in a["step_windows"]] == [1, 1]
    assert a["step_windows"][0]["first_device_work_after_us"] == pytest.approx(100.0)


def test_bench_latency_tiny(tmp_path, capsys):
    mod = load("bench_latency")
    result = mod.main(["--model", "tiny", "--batches", "1,3", "--prompts", "8,20", "--max-tokens", "4",
                       "--repeats", "1", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["batch"], r["prompt_len"]) for r in rows] == [(1, 8), (3, 8), (1, 20), (3, 20)]
    for r in rows:
        run = r["raw"][0]
        assert len(run["ttft"]) == r["batch"] and len(run["token_ids"]) == r["batch"]
        assert all(len(t) == 4 for t in run["token_ids"]) and run["output_tokens"] == 4 * r["batch"]
        assert len(run["itl"]) == r["batch"] * 3  # 4 tokens -> 3 gaps per request
        assert run["decode_steps"] == 3  # the batch decodes together: one ITL sample per request a step
        assert r["recompiles_while_measuring"] == 0 and r["runs"] == 1
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] and r["itl_p50_ms"] <= r["itl_p90_ms"]
    assert json.loads((tmp_path / "latency.json").read_text())["rows"][0]["batch"] == 1
    assert "TTFT p50" in capsys.readouterr().out
    assert result["max_num_seqs"] == 3  # the largest batch, unless --max-num-seqs says otherwise
    assert [mod.repeats_for(b, None) for b in (1, 8, 64)] == [30, 4, 3]  # >= 30 first tokens, >= 3 runs
    assert mod.repeats_for(1, 5) == 5
    with pytest.raises(SystemExit, match="smaller than the largest batch"):
        mod.main(["--model", "tiny", "--batches", "1,3", "--max-num-seqs", "2", "--out", str(tmp_path)])


def test_bench_latency_backends_in_turn(tmp_path, capsys):
    """Two backends in one process: a row each per configuration, measured on the same prompts run by
    run, their greedy tokens compared request by request (the reference and the Triton kernel agree on the
    tiny float32 model), and the same backend named twice refused. Weights compared alike: float32 and
    fp8, two engines."""
    mod = load("bench_latency")
    result = mod.main(["--model", "tiny", "--backend", "reference,triton", "--batches", "2", "--prompts", "8",
                       "--max-tokens", "3", "--repeats", "2", "--out", str(tmp_path)])
    rows = result["rows"]
    assert result["variants"] == ["reference", "triton"] and [r["variant"] for r in rows] == result["variants"]
    ref, tri = rows
    assert ref["runs"] == tri["runs"] == 2 and ref["recompiles_while_measuring"] == tri["recompiles_while_measuring"] == 0
    assert [r["token_ids"] for r in ref["raw"]] == [r["token_ids"] for r in tri["raw"]]
    assert result["greedy_agreement"] == {"triton": 1.0}
    out = capsys.readouterr().out
    assert "TTFT / ITL p50 vs reference" in out and "greedy tokens equal to reference's: triton 100.0%" in out
    with pytest.raises(SystemExit, match="twice"):
        mod.main(["--model", "tiny", "--backend", "triton,triton", "--out", str(tmp_path)])
    result = mod.main(["--model", "tiny", "--backend", "reference", "--quantization", "none,fp8", "--batches", "1",
                       "--prompts", "8", "--max-tokens", "3", "--repeats", "2", "--no-floor", "--out", str(tmp_path)])
    assert result["variants"] == ["reference float32", "reference fp8"]
    assert [r["quantization"] for r in result["rows"]] == [None, "fp8"]
    assert set(result["greedy_agreement"]) == {"reference fp8"}


def test_bench_latency_tokens_equal_llm_generate():
    """The latency loop's tokens are the engine's: the same greedy requests through ``LLM.generate``."""
    from jaxpaged import LLM, EngineConfig, LLMEngine, SamplingParams
    from jaxpaged.models.tiny import tiny_checkpoint_path

    mod = load("bench_latency")
    prompts = [[5, 17, 99, 3, 250, 8, 41, 7], [300, 2, 2, 61, 9], [1, 2, 3]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    llm = LLM(tiny_checkpoint_path("qwen3"), dtype="float32", **kw)
    run = mod.run_batch(LLMEngine(llm.params, EngineConfig(**kw)), prompts, sp)  # (shares the compiled steps)
    want = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                use_tqdm=False)]
    assert run["token_ids"] == want
    assert len(run["itl"]) == 3 * 5 and run["decode_steps"] == 5 and len(run["tpot"]) == 3


def test_check_step_hlo_tiny(tmp_path):
    """The compiled step of a decode-like and a prefill step: one aliased pool, no copy, no layer slice."""
    rows = load("check_step_hlo").main(["--model", "tiny", "--out", str(tmp_path), "--dump-hlo"])
    assert [r["step"] for r in rows] == ["decode-like b4", "prefill"]
    for r in rows:
        assert r["pool_aliased"] == 1 and r["pool_copies"] == 0 and r["layer_slices"] == 0, r
        assert r["input_readers"] == 1 and r["prev_token_readers"] == 1, r
    assert "ENTRY" in (tmp_path / "decode_b4.hlo.txt").read_text()


def test_bench_attention_big_pool_check_interpret():
    """The GPU check of a many-layer pool read at its last layer from its highest blocks (tiny here)."""
    rec = load("bench_attention").big_pool_check(interpret=True)
    assert rec["ok"] and rec["layer"] == 2, rec


def test_throughput_gpu_summary_of_a_synthetic_trace(capsys):
    mod = load("bench_throughput")
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
    ]
    for i in range(4):  # four steps of 1 ms wall: attention 300 us, a GEMM 100 us, one H2D copy
        base = i * 1000.0
        events += [{"ph": "X", "pid": 2, "tid": 7, "ts": base, "dur": 5.0, "name": "MemcpyH2D"},
                   {"ph": "X", "pid": 2, "tid": 7, "ts": base + 10, "dur": 300.0, "name": "ragged_paged_attention_m16"},
                   {"ph": "X", "pid": 2, "tid": 7, "ts": base + 400, "dur": 100.0, "name": f"gemm_fusion_dot.{i}"}]
    g = mod.workload_gpu_summary(events, wall_s=0.004)
    assert g["gpu_busy_s"] == pytest.approx(4 * 405e-6) and g["busy_fraction"] == pytest.approx(0.405)
    assert g["kernel_count"] == 8 and g["kernel_s"] == pytest.approx(4 * 400e-6)
    assert [(k["name"], k["calls"]) for k in g["kernels"]] == [("ragged_paged_attention_m16", 4), ("gemm_fusion_dot", 4)]
    assert g["kernels"][0]["share"] == pytest.approx(0.75) and g["copies"]["h2d"]["count"] == 4
    mod.print_gpu_summary(g)
    assert "busy 0.002 s of 0.004 s wall (40%)" in capsys.readouterr().out


def test_throughput_run_under_the_profiler_tiny(tmp_path):
    """``--trace``'s path end to end on the tiny model (CPU: the trace has no GPU lines, so the summary
    is empty but well formed)."""
    import argparse

    from jaxpaged import SamplingParams, load_params
    from jaxpaged.models.tiny import tiny_checkpoint_path

    mod = load("bench_throughput")
    ps = mod.trace_tools()  # tools/profile_step.py
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    args = argparse.Namespace(block_size=16, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                              backend="auto", async_scheduling=True, trace_dir=str(tmp_path / "trace"))
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    r = mod.run_ours(params, prompts, [SamplingParams(max_tokens=5, ignore_eos=True)] * 2, args)
    assert r["traced"] and r["output_tokens"] == 10
    path = ps.find_trace_file(args.trace_dir)
    assert path is not None
    g = mod.workload_gpu_summary(ps.load_trace(path), r["seconds"])
    assert g["wall_s"] == r["seconds"] and g["gpu_busy_s"] >= 0.0 and isinstance(g["kernels"], list)


def test_throughput_trace_windows_tiny(tmp_path, capsys):
    """``--trace-steps``: the untraced run records when each step ends, a second run traces only the
    windows' steps, and each window gets the untraced wall per step (CPU: no GPU lines, busy 0)."""
    import argparse

    from jaxpaged import SamplingParams, load_params
    from jaxpaged.models.tiny import tiny_checkpoint_path

    mod = load("bench_throughput")
    assert mod.parse_windows("2:4, 5:7") == [(2, 4), (5, 7)] and mod.parse_windows(None) == []
    with pytest.raises(SystemExit, match="bad window"):
        mod.parse_windows("4:4")
    with pytest.raises(SystemExit, match="overlap"):
        mod.parse_windows("1:5,4:8")
    for bad in ("5", "0:3", "a:b"):
        with pytest.raises(SystemExit, match="bad window"):
            mod.parse_windows(bad)
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    args = argparse.Namespace(block_size=16, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                              backend="auto", async_scheduling=True)
    prompts, sps = [[1, 2, 3, 4, 5, 6], [7, 8, 9]], [SamplingParams(max_tokens=6, ignore_eos=True)] * 2
    untraced = mod.run_ours(params, prompts, sps, args)
    ends = untraced["step_end_s"]
    assert not untraced["traced"] and len(ends) >= 6 and ends == sorted(ends) and ends[-1] <= untraced["seconds"]
    root = str(tmp_path / "w")
    windows = [(2, 4), (5, 99)]  # the second one outlives the run: stopped at its end
    traced = mod.run_ours(params, prompts, sps, argparse.Namespace(**vars(args), trace_windows=windows,
                                                                    window_trace_root=root))
    assert traced["traced"] and traced["output_tokens"] == untraced["output_tokens"] == 12
    rows = mod.window_summaries(untraced, traced, windows, root)
    assert rows[0]["window"] == [2, 4] and rows[0]["untraced_wall_ms"] == pytest.approx((ends[3] - ends[1]) / 2 * 1e3)
    assert rows[0]["gpu_busy_ms"] == 0.0 and "error" in rows[1]  # no GPU on CI; window past the run's end
    mod.print_window_summaries(rows)
    assert "untraced wall per step vs GPU busy" in capsys.readouterr().out


def test_throughput_defaults_fit_every_model():
    """Every ``--model`` the help offers runs with the defaults: the workload fits ``max_model_len``
    and the model's positions; tiny's is small (CPU) and has no Hugging Face baseline."""
    mod = load("bench_throughput")
    positions = {"qwen3-0.6b": 40960, "qwen2.5-0.5b": 32768, "qwen2.5-7b": 32768, "qwen3-30b-a3b": 40960,
                 "tiny": json.loads((ROOT / "models/tiny/qwen3/config.json").read_text())["max_position_embeddings"]}
    assert set(mod.MODELS) == set(positions)
    for model, limit in positions.items():
        args = mod.parse_args(["--model", model])
        assert args.max_input_len + args.max_output_len <= args.max_model_len <= limit, model
        assert args.temperature == 0.6 and args.max_num_seqs <= args.num_seqs
    tiny = mod.parse_args(["--model", "tiny"])
    assert (tiny.num_seqs, tiny.max_model_len, tiny.hf_requests) == (16, 256, 0)
    full = mod.parse_args(["--model", "qwen2.5-7b", "--num-seqs", "8"])
    assert (full.num_seqs, full.max_input_len, full.max_model_len, full.max_num_batched_tokens) == (8, 1024, 2048, 8192)
    with pytest.raises(SystemExit, match=">= 100"):
        mod.parse_args(["--model", "tiny", "--max-input-len", "50"])


@pytest.mark.slow  # ~30 s on a CPU
def test_throughput_tiny(tmp_path, capsys):
    """``--model tiny``: nano-vllm's workload in small (prompts and outputs of 100..128 tokens; 16
    requests by default, 4 here, in steps of at most 256 tokens: the engine of ``jaxpaged bench --model
    tiny``, whose warmed-up steps the two share through the run's compilation cache), every request's
    ``max_tokens`` generated."""
    mod = load("bench_throughput")
    result = mod.main(["--model", "tiny", "--num-seqs", "4", "--max-num-batched-tokens", "256", "--out", str(tmp_path)])
    args = mod.parse_args(["--model", "tiny", "--num-seqs", "4"])
    assert mod.parse_args(["--model", "tiny"]).num_seqs in (None, 16)
    prompts, sps = mod.workload(args, 512)
    assert len(prompts) == 4 and all(100 <= len(p) <= 128 and max(p) < 512 for p in prompts)
    assert all(sp.temperature == 0.6 and sp.ignore_eos and 100 <= sp.max_tokens <= 128 for sp in sps)
    r = result["ours_full"]
    assert r["output_tokens"] == sum(sp.max_tokens for sp in sps) and r["preemptions"] == 0
    assert len(r["step_end_s"]) >= max(sp.max_tokens for sp in sps) and "hf_subset" not in result
    assert json.loads((tmp_path / "throughput.json").read_text())["ours_full"]["output_tokens"] == r["output_tokens"]
    assert "jaxpaged " in capsys.readouterr().out


def test_time_variants_rounds(capsys):
    """Kernel A/Bs compile each variant once and time the variants in turn over several rounds: every
    variant gets one time a round (the mean returned), its output from one run, and a variant that
    fails is reported and left out while the others are timed."""
    mod = load("bench_attention")
    from jaxpaged.kernels.paged_attention_reference import paged_attention_reference

    def broken(*args):
        raise ValueError("unsupported here")

    q, pool, cu, kl, table = mod.random_paged_batch([1, 3], [15, 40], 4, 2, 64, 16, 8)
    fns = {"reference": paged_attention_reference, "again": lambda *a: paged_attention_reference(*a),
           "broken": broken}
    each, compiled = {}, {}
    times, outs = mod.time_variants(fns, q, pool, cu, kl, table, reps=1, chain=2, where="tiny", rounds=3,
                                    each_round=each, compiled=compiled)
    assert set(times) == set(outs) == set(each) == set(compiled) == {"reference", "again"}
    assert compiled["again"](q, (pool, cu, kl), table).shape == q.shape  # the chained jit, for a trace
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in each.values())
    assert times["again"] == pytest.approx(sum(each["again"]) / 3)
    assert outs["reference"].shape == (8, 4, 64) and (outs["reference"] == outs["again"]).all()
    assert "FAILED tiny broken ValueError unsupported here" in capsys.readouterr().out
