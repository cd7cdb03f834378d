"""Tensor parallelism on several GPUs: Qwen3-8B shapes at tp=1 and tp=2, and a Qwen2.5-72B-shaped model
(too big for one H200 in bf16: ~145 GB of weights) at tp=2. Random bf16 weights, created already split
(``workloads.random_model(..., tensor_parallel_size=N)``: no device ever holds a whole matrix).

Parts (each in its own process, so one part's memory never counts against the next, with its own time
limit; a part that times out or fails is recorded as such and the others still run):

  8b-tp1, 8b-tp2  nano-vllm's workload (256 requests, ``workloads.nano_vllm_workload``): output tok/s
                  after warm-up; ITL at batch 1 (32-token prompt, 64 greedy tokens, 3 runs); memory per
                  GPU (weights, KV pool, peak bytes in use); scaling efficiency = tok/s(tp2) / (2 tok/s(tp1)).
  72b-tp2         a small workload (32 requests of nano-vllm's kind, prompts 100-512, outputs 100-128
                  tokens): tok/s, ITL at batch 1, memory per GPU.

Every part writes ``part_<name>.json`` into ``--out``; with ``--resume`` a part already there is not run
again. Parts can run one at a time (two GPUs of one host), their part files put in one folder, and the
table printed from them without running anything:

    python benchmarks/bench_tp.py --parts 8b-tp1 --out $OUT
    python benchmarks/bench_tp.py --parts 8b-tp2 --out $OUT
    python benchmarks/bench_tp.py --parts 72b-tp2 --out $OUT
    python benchmarks/bench_tp.py --resume --out DIR_WITH_THE_PART_FILES   # table + tp.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_tp.py --tiny --out /tmp/t

``--tiny``: the same parts with tiny shapes and a few short requests, on whatever devices there are
(CPU with forced host devices in the tests). The table comes last; everything is in ``tp.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PARTS = ("8b-tp1", "8b-tp2", "72b-tp2")
LIMITS_S = {"8b-tp1": 540, "8b-tp2": 540, "72b-tp2": 570}


def _latency_module():
    spec = importlib.util.spec_from_file_location("bench_latency", HERE / "bench_latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def part_setup(name: str, tiny: bool, num_seqs: int):
    """``(raw_config, tp, prompts, sampling params, engine kwargs)`` of a part."""
    from jaxpaged.workloads import QWEN2_5_72B, QWEN3_8B, nano_vllm_workload

    model, tp = name.split("-")
    tp = int(tp[2:])
    raw = QWEN3_8B if model == "8b" else QWEN2_5_72B
    if model == "8b":
        prompts, sps = nano_vllm_workload(num_seqs)
        engine = dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)
    else:
        prompts, sps = nano_vllm_workload(32, max_input_len=512, max_output_len=128)
        engine = dict(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=2048)
    if tiny:  # same structure, tiny numbers (ids < 10,000 as in nano-vllm's workload)
        raw = dict(raw, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=10240)
        prompts = [p[:20] for p in prompts[:4]]
        sps = [dataclasses.replace(sp, max_tokens=4) for sp in sps[:4]]
        engine = dict(max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=64)
    return raw, tp, prompts, sps, engine


def device_memory(devices) -> list[dict]:
    """Per device: allocator bytes in use, peak and limit (GiB; ``None`` where the platform has none)."""
    rows = []
    for d in devices:
        st = d.memory_stats() or {}
        gib = lambda k: st[k] / 2**30 if k in st else None  # noqa: E731
        rows.append(dict(device=str(d), in_use_gib=gib("bytes_in_use"), peak_gib=gib("peak_bytes_in_use"),
                         limit_gib=gib("bytes_limit")))
    return rows


def run_part(name: str, args) -> dict:
    import jax
    import numpy as np

    from jaxpaged import EngineConfig, LLMEngine, SamplingParams
    from jaxpaged.llm import run_to_completion
    from jaxpaged.models.sharding import per_device_bytes
    from jaxpaged.workloads import random_model

    raw, tp, prompts, sps, engine_kw = part_setup(name, args.tiny, args.num_seqs)
    dtype = "float32" if args.tiny else "bfloat16"
    t0 = time.perf_counter()
    params = random_model(raw, dtype, tensor_parallel_size=tp)
    jax.block_until_ready(params.state)
    load_s = time.perf_counter() - t0
    devices = list(params.mesh.devices.flat) if params.mesh is not None else [jax.devices()[0]]
    weights = per_device_bytes(params.state)
    config = EngineConfig(block_size=16, memory_fraction=0.9, attention_backend=args.backend,
                          tensor_parallel_size=tp, **engine_kw)
    engine = LLMEngine(params, config)
    pool = per_device_bytes(engine.kv_pool)
    compile_s = engine.warmup(use_tqdm=False)
    run_to_completion(engine, [prompts[0][:16]], SamplingParams(max_tokens=4))  # one small real request
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sps)
    seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    st = engine.stats()

    lat = _latency_module()
    rng = np.random.default_rng(0)
    itl_sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4 if args.tiny else 64)
    prompt_len = 16 if args.tiny else 32
    lat.run_batch(engine, [rng.integers(0, 10000, prompt_len).tolist()], itl_sp)  # warm
    runs = [lat.run_batch(engine, [rng.integers(0, 10000, prompt_len).tolist()], itl_sp) for _ in range(3)]
    itl = lat.summarise(runs)
    return dict(part=name, tp=tp, device_kind=devices[0].device_kind, num_devices=len(devices),
                params_b=sum(x.size for x in jax.tree.leaves(params.state)) / 1e9, load_s=load_s,
                requests=len(prompts), prompt_tokens=sum(map(len, prompts)), output_tokens=out_tokens,
                seconds=seconds, tok_per_s=out_tokens / seconds, warmup_compile_s=compile_s,
                steps=st["steps"], preemptions=st["preemptions"], num_blocks=st["num_blocks"],
                peak_kv_gib=st["peak_kv_bytes_in_use"] / 2**30,
                itl_b1_p50_ms=itl["itl_p50_ms"], itl_b1_p90_ms=itl["itl_p90_ms"], ttft_b1_p50_ms=itl["ttft_p50_ms"],
                weights_gib_per_device={k: v / 2**30 for k, v in weights.items()},
                kv_pool_gib_per_device={k: v / 2**30 for k, v in pool.items()},
                memory=device_memory(devices))


def launch(name: str, args, out: Path) -> dict:
    """Runs one part in a fresh process under its time limit; returns its result or the failure."""
    path = out / f"part_{name}.json"
    if args.resume and path.exists():
        return json.loads(path.read_text())
    cmd = [sys.executable, "-X", "faulthandler", __file__, "--run-part", name, "--out", str(out), "--num-seqs", str(args.num_seqs),
           "--backend", args.backend] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ)  # XLA's allocator limit: jaxpaged's 95% of the device unless set here
    limit = args.limit_s or LIMITS_S[name]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, env=env, timeout=limit, capture_output=True, text=True)
    except subprocess.TimeoutExpired as err:
        result = dict(part=name, error=f"timed out after {limit} s",
                      log_tail=((err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes)
                                else (err.stderr or ""))[-2000:])
    else:
        if res.returncode == 0 and path.exists():
            return json.loads(path.read_text())
        result = dict(part=name, error=f"exit code {res.returncode}", log_tail=(res.stdout + res.stderr)[-3000:])
    result["wall_s"] = time.perf_counter() - t0
    path.write_text(json.dumps(result, indent=2))
    return result


def table(results: dict) -> str:
    """The summary: one row per part, then the scaling efficiency."""
    lines = [f"{'part':8s} {'tp':>2s} {'tok/s':>8s} {'ITL b1 p50 ms':>13s} {'weights GiB/dev':>15s} "
             f"{'KV GiB/dev':>10s} {'peak GiB/dev':>12s} {'compile s':>9s}"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:8s} {'':>2s} {r['error']}")
            continue
        w = max(r["weights_gib_per_device"].values())
        kv = max(r["kv_pool_gib_per_device"].values())
        peaks = [m["peak_gib"] for m in r["memory"] if m["peak_gib"] is not None]
        peak = f"{max(peaks):12.1f}" if peaks else f"{'n/a':>12s}"
        lines.append(f"{name:8s} {r['tp']:2d} {r['tok_per_s']:8.0f} {r['itl_b1_p50_ms']:13.2f} {w:15.2f} "
                     f"{kv:10.2f} {peak} {r['warmup_compile_s']:9.1f}")
    eff = scaling(results)
    if eff is not None:
        lines.append(f"8B scaling efficiency tp=2 vs tp=1: {eff['throughput']:.2f} (throughput / 2), "
                     f"ITL speed-up {eff['itl_speedup']:.2f}x")
    return "\n".join(lines)


def scaling(results: dict) -> dict | None:
    a, b = results.get("8b-tp1"), results.get("8b-tp2")
    if not a or not b or "error" in a or "error" in b:
        return None
    return dict(throughput=b["tok_per_s"] / (2 * a["tok_per_s"]), itl_speedup=a["itl_b1_p50_ms"] / b["itl_b1_p50_ms"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--num-seqs", type=int, default=256, help="8B parts: requests of the nano-vllm workload")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, a few short requests (CPU tests)")
    ap.add_argument("--resume", action="store_true", help="keep parts already in --out")
    ap.add_argument("--limit-s", type=int, default=None, help="time limit per part (default: per part)")
    ap.add_argument("--run-part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run_part:
        random.seed(0)
        result = run_part(args.run_part, args)
        (out / f"part_{args.run_part}.json").write_text(json.dumps(result, indent=2))
        return result
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    results = {}
    for name in parts:
        results[name] = launch(name, args, out)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "log_tail"}), flush=True)
    for name in PARTS:  # parts of earlier commands into the same folder
        if name not in results and (out / f"part_{name}.json").exists():
            results[name] = json.loads((out / f"part_{name}.json").read_text())
    summary = dict(parts=results, scaling_8b=scaling(results), tiny=args.tiny)
    (out / "tp.json").write_text(json.dumps(summary, indent=2))
    print()
    print(table(results))
    return summary


if __name__ == "__main__":
    main()
