"""Start-up: how long a new process takes from ``import jaxpaged`` to a warmed-up engine, where the warm-up's
time goes, and the first request's TTFT against a request of the same length in steady state (fresh tokens
each time, so the prefix cache never hits): back to back, and each after 100 ms of idle (a request after
idle pays more host time to launch its step, the host's CPU waking, however many came before; so that is
what a first request is compared with to see what start-up itself leaves behind).

Each measurement is a fresh Python process (what a user restarting a notebook or a server meets), run
twice over one compilation-cache folder: ``cold`` (empty cache) and ``cached`` (a second process).

    python benchmarks/bench_startup.py --model qwen3-0.6b --out $OUT     # GPU
    python benchmarks/bench_startup.py --model tiny                       # CPU or GPU: LLM(tiny checkpoint)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxpaged.llm import format_bytes  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jax
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.append(secs) if name == "/jax/core/compile/backend_compile_duration" else None)
import numpy as np
import jaxpaged
from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import LLM, run_to_completion
model, max_model_len, kv_cache_dtype, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
t_import = time.perf_counter()
if model == "tiny":
    from jaxpaged.models.tiny import tiny_checkpoint_path
    t_params = t_import  # the checkpoint is read inside LLM(...)
    llm = LLM(tiny_checkpoint_path("qwen3"), max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
              attention_backend=backend)
    engine = llm.engine
    t_engine = t_ready = time.perf_counter()
else:
    from jaxpaged.workloads import QWEN2_5_7B, QWEN3_0_6B, random_model
    params = random_model({"qwen3-0.6b": QWEN3_0_6B, "qwen2.5-7b": QWEN2_5_7B}[model])
    jax.block_until_ready(params.state)
    t_params = time.perf_counter()
    engine = LLMEngine(params, EngineConfig(max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
                                              attention_backend=backend))
    t_engine = time.perf_counter()
    engine.warmup(use_tqdm=False)
    t_ready = time.perf_counter()
warm_compiles = len(compiles)
sp = SamplingParams(temperature=0, max_tokens=1)
rng = np.random.default_rng(0)
def ttft():
    prompt = [int(t) for t in rng.integers(1, min(1000, engine.params.config.vocab_size), 32)]  # fresh: no prefix hit
    t = time.perf_counter()
    run_to_completion(engine, [prompt], sp)
    return time.perf_counter() - t
first = ttft()
steady = [ttft() for _ in range(20)]
after_idle = []
for _ in range(10):
    time.sleep(0.1)
    after_idle.append(ttft())
print("RESULT", json.dumps(dict(
    import_s=t_import - t0, weights_s=t_params - t_import, engine_s=t_engine - t_params, warmup_s=t_ready - t_engine,
    engine_start_s=t_ready - t_params, start_s=t_ready - t0,
    warmup=engine.warmup_profile, first_ttft_ms=first * 1e3, steady_ttft_ms=float(np.median(steady)) * 1e3,
    after_idle_ttft_ms=float(np.median(after_idle)) * 1e3,
    compiles_during_warmup=warm_compiles, compiles_after_warmup=len(compiles) - warm_compiles,
    attention_backend=engine.runner.attention_backend, num_blocks=engine.num_blocks, kv_pool_gib=engine.stats()["kv_pool_bytes"] / 2**30)))
"""


def run_child(model: str, max_model_len: int, cache: str, kv_cache_dtype: str = "auto",
              backend: str = "auto") -> dict:
    env = dict(os.environ, JAXPAGED_COMPILE_CACHE=cache, PYTHONUNBUFFERED="1")
    res = subprocess.run([sys.executable, "-c", CHILD, model, str(max_model_len), kv_cache_dtype, backend], env=env, capture_output=True,
                         text=True)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    out["warnings"] = [ln for ln in res.stderr.splitlines() if "W" in ln[:1] or "Warning" in ln][:20]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("qwen3-0.6b", "qwen2.5-7b", "tiny"), default="qwen3-0.6b")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 4096 (128 for tiny)")
    ap.add_argument("--cache", default=None, help="compilation cache folder (default: a fresh temporary one)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig(kv_cache_dtype=...): auto, fp8, ...")
    ap.add_argument("--backend", default="auto", help="EngineConfig(attention_backend=...)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    max_len = args.max_model_len or (128 if args.model == "tiny" else 4096)
    cache = args.cache or tempfile.mkdtemp(prefix="jaxpaged-startup-")
    rows = {kind: run_child(args.model, max_len, cache, args.kv_cache_dtype, args.backend) for kind in ("cold", "cached")}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"startup_{args.model}{''.join('_' + a for a in (args.kv_cache_dtype, args.backend) if a != 'auto')}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\nstart-up, {args.model}, kv_cache_dtype {args.kv_cache_dtype}, {rows['cold']['attention_backend']} "
          f"attention, max_model_len {max_len}, pool {rows['cold']['num_blocks']} blocks "
          f"({format_bytes(int(rows['cold']['kv_pool_gib'] * 2**30))})")
    print("run     import s  weights s  engine s  warm-up s (lower / XLA after / run)  engine + warm-up s  start s"
          "  first TTFT ms  steady TTFT ms  after-idle TTFT ms  compiles after warm-up  warnings")
    for kind, r in rows.items():
        w = r["warmup"] or {}
        split = f"{w.get('lower_seconds', 0):.1f} / {w.get('compile_seconds', 0):.1f} / {w.get('run_seconds', 0):.1f}"
        print(f"{kind:7} {r['import_s']:8.1f} {r['weights_s']:10.1f} {r['engine_s']:9.1f} {r['warmup_s']:9.1f}"
              f" ({split:>17}) {r['engine_start_s']:18.1f} {r['start_s']:8.1f} {r['first_ttft_ms']:14.2f}"
              f" {r['steady_ttft_ms']:15.2f} {r['after_idle_ttft_ms']:19.2f}"
              f" {r['compiles_after_warmup']:23d} {len(r['warnings']):9d}")
    for kind, r in rows.items():
        w = r["warmup"] or {}
        if "trace_seconds" in w:
            print(f"{kind}: of the lowering, {w['trace_seconds']:.1f} s tracing the steps and "
                  f"{w['kernel_export_seconds']:.1f} s exporting their Mosaic GPU kernels in worker processes")
    for kind, r in rows.items():
        for line in r["warnings"]:
            print(f"{kind} warning: {line[:300]}")


if __name__ == "__main__":
    main()
