"""Checks the compiled step on the real pool: one aliased pool array, never copied, no layer sliced out,
the step's inputs and previous tokens each read by one instruction (``readers``: else every launch
patches the CUDA graph's nodes that read them), and what XLA's memory analysis says the step needs
beside it. Qwen3-0.6B shapes, random bf16 weights, the engine's default pool (most of the GPU), a decode step of 256 sequences and a prefill step of 8,192
tokens (8 x 1,024).

    python benchmarks/check_step_hlo.py [--model tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its helper modules)

from jaxpaged import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jaxpaged.engine.step_inputs import build_step_inputs  # noqa: E402
import jax  # noqa: E402

from hlo_report import entry_param_readers, pool_hlo_report  # noqa: E402
from jaxpaged.workloads import BENCHMARK_MODELS, benchmark_params  # noqa: E402


def check(engine: LLMEngine, prompts: list[list[int]], dump: str | None = None) -> dict:
    """Schedules ``prompts`` (one step), compiles that step and inspects it; ``dump``: also write the
    compiled (optimised) HLO text there, to see which fusion or kernel each op became."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=2))
    scheduled = engine.scheduler.schedule()
    inputs = build_step_inputs(scheduled, engine.kv.tables, engine.config.block_size, width=engine._table_width,
                               max_seqs=engine.config.max_num_seqs,
                               eos_token_ids=engine.params.config.eos_token_id, min_tokens=engine.runner.tuning.min_token_bucket)
    compiled = engine.runner.compiled(engine.params.state, engine.kv_pool, inputs)
    text = compiled.as_text()
    if dump:
        with open(dump, "w") as f:
            f.write(text)
    report = pool_hlo_report(text, engine.kv_pool.shape)
    n = len(jax.tree.leaves(engine.params.state))  # parameters: (leaves..., pool, packed inputs, prev tokens)
    readers = entry_param_readers(text, [n + 1, n + 2])
    mem = compiled.memory_analysis()
    for seq, _ in scheduled:  # leave the engine empty for the next check
        engine.abort_request(seq.parent.request_id)
    return dict(tokens=int(inputs.token_ids.shape[0]), seqs=len(scheduled),
                pool_aliased=report["aliased"], pool_copies=report["copies"], layer_slices=report["slices"],
                input_readers=readers.get(n + 1, -1), prev_token_readers=readers.get(n + 2, -1),
                pool_gib=engine.kv_pool.nbytes / 2**30,
                argument_gib=mem.argument_size_in_bytes / 2**30, output_gib=mem.output_size_in_bytes / 2**30,
                alias_gib=mem.alias_size_in_bytes / 2**30, temp_gib=mem.temp_size_in_bytes / 2**30)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=BENCHMARK_MODELS, default="qwen3-0.6b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--decode-batches", default="256", help="comma list: a decode-like step per batch size")
    ap.add_argument("--dump-hlo", action="store_true", help="write each step's compiled HLO to --out")
    args = ap.parse_args(argv)
    tiny = args.model == "tiny"
    engine = LLMEngine(benchmark_params(args.model), EngineConfig(
        block_size=16, max_model_len=512 if tiny else 2048, max_num_seqs=16 if tiny else 256,
        max_num_batched_tokens=128 if tiny else 8192, **(dict(num_blocks=256) if tiny else {})))
    rng = np.random.default_rng(0)
    n_pre, plen = (2, 64) if tiny else (8, 1024)
    decode_batches = [4] if tiny else [int(b) for b in args.decode_batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    dump = (lambda name: os.path.join(args.out, f"{name}.hlo.txt")) if args.dump_hlo else (lambda name: None)
    rows = [dict(step=f"decode-like b{n}", **check(engine, [list(rng.integers(1, 500, 1)) for _ in range(n)],
                                                   dump(f"decode_b{n}"))) for n in decode_batches]
    rows.append(dict(step="prefill", **check(engine, [list(rng.integers(1, 500, plen)) for _ in range(n_pre)],
                                             dump("prefill"))))
    with open(os.path.join(args.out, "step_hlo.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'step':16s} {'tokens':>6s} {'seqs':>4s} {'aliased':>7s} {'copies':>6s} {'slices':>6s} "
          f"{'readers':>7s} {'pool GiB':>8s} {'args GiB':>8s} {'out GiB':>8s} {'alias GiB':>9s} {'temp GiB':>8s}")
    for r in rows:
        print(f"{r['step']:16s} {r['tokens']:6d} {r['seqs']:4d} {r['pool_aliased']:7d} {r['pool_copies']:6d} "
              f"{r['layer_slices']:6d} {r['input_readers']:3d}/{r['prev_token_readers']:<3d} {r['pool_gib']:8.2f} {r['argument_gib']:8.2f} {r['output_gib']:8.2f} "
              f"{r['alias_gib']:9.2f} {r['temp_gib']:8.2f}")
    return rows


if __name__ == "__main__":
    main()
