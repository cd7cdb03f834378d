"""Numerics check (GPU): float32 that is float32, and batch invariance, measured back to back in one process.

Sections (``--sections``, all by default):
  precision     float32 dots vs a float64 numpy reference: the Pallas matmul and attention kernels and
                XLA's dot at its default and at HIGHEST. Relative error ~1e-6 means IEEE fp32, ~1e-4..1e-3
                means TF32 inputs. Settles on the device whether a kernel dot is really fp32.
  rows          bf16 ``[M, K] @ [K, N]`` at Qwen3-0.6B shapes for several M: is row i bitwise the same
                whatever M is? For the fixed-tile Pallas matmul (must be) and for XLA's ``x @ w`` (the
                source of variance in the default mode).
  arrangements  Qwen3-0.6B shapes, random bf16 weights; requests with shared prefixes (greedy and
                seeded sampling) run one at a time ("alone"), then batched, with the prefix cache cold and
                warm, in reversed and staggered arrival, at block sizes 8/32/64, with a small chunk
                budget, in a tiny pool that forces preemption, with async scheduling. Per arrangement:
                how many requests' tokens differ from alone, for batch_invariant False and True.
  hf            the tiny float32 checkpoints, Pallas backend: greedy tokens vs the transformers float32
                fixtures (tests/fixtures) in several engine settings, for batch_invariant False and True.
  throughput    nano-vllm's workload (benchmarks/bench_throughput.py's ``run_ours``), default vs
                batch_invariant=True in the same process.

A short table is printed last; everything goes to ``--out``/check_invariance.json.

    python benchmarks/check_invariance.py --out $OUT            # H200, about 6-8 minutes
    python benchmarks/check_invariance.py --tiny --out /tmp/x  # CPU smoke test (interpret mode)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_throughput import run_ours  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params  # noqa: E402
from jaxpaged.kernels.matmul import matmul  # noqa: E402
from jaxpaged.kernels.kv_write import pool_from_caches  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention  # noqa: E402
from jaxpaged.llm import run_to_completion  # noqa: E402
from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.workloads import QWEN3_0_6B, nano_vllm_workload, output_divergence, random_model  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SECTIONS = ("precision", "rows", "arrangements", "hf", "throughput")


def interpret() -> bool:
    return jax.default_backend() != "gpu"


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


# ---- precision -------------------------------------------------------------------------------------
def check_precision(tiny: bool) -> dict:
    rng = np.random.default_rng(0)
    m, k, n = (16, 64, 64) if tiny else (256, 1024, 3072)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    out = dict(
        pallas_matmul=rel_err(matmul(xj, wj, interpret=interpret()), ref),
        xla_default=rel_err(jax.jit(lambda a, b: a @ b)(xj, wj), ref),
        xla_highest=rel_err(jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))(xj, wj), ref))
    # Attention: one sequence of L tokens prefilled; dense float64 softmax attention as the reference.
    hq, hkv, d, bs, length = (4, 2, 32, 8, 40) if tiny else (16, 8, 128, 16, 1000)
    q = rng.standard_normal((length, hq, d)).astype(np.float32)
    kk = rng.standard_normal((length, hkv, d)).astype(np.float32)
    vv = rng.standard_normal((length, hkv, d)).astype(np.float32)
    nblk = -(-length // bs)
    pad = nblk * bs - length
    k_cache = np.pad(kk, ((0, pad), (0, 0), (0, 0))).reshape(nblk, bs, hkv, d)
    v_cache = np.pad(vv, ((0, pad), (0, 0), (0, 0))).reshape(nblk, bs, hkv, d)
    args = (jnp.asarray(q), pool_from_caches(jnp.asarray(k_cache), jnp.asarray(v_cache)), 0,
            jnp.asarray([0, length], jnp.int32),
            jnp.asarray([length], jnp.int32), jnp.arange(nblk, dtype=jnp.int32)[None])
    g = hq // hkv
    k64 = np.repeat(kk, g, axis=1).astype(np.float64)
    v64 = np.repeat(vv, g, axis=1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k64) / np.sqrt(d)
    s = np.where(np.tril(np.ones((length, length), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    att_ref = np.einsum("hqk,khd->qhd", p, v64)
    for bi in (False, True):
        out[f"pallas_attention{'_invariant' if bi else ''}"] = rel_err(
            paged_attention(*args, interpret=interpret(), batch_invariant=bi), att_ref)
    out["verdict"] = {name: ("ieee" if err < 1e-5 else "tf32?") for name, err in out.items()}
    return out


# ---- rows ------------------------------------------------------------------------------------------
def check_rows(tiny: bool) -> dict:
    rng = np.random.default_rng(1)
    k, n, ms = (64, 96, (1, 7, 64)) if tiny else (1024, 6144, (1, 7, 64, 256, 1000, 4096))
    x = jnp.asarray(rng.standard_normal((max(ms), k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
    fns = {"pallas_fixed_tile": lambda a: matmul(a, w, interpret=interpret()),
           "xla": jax.jit(lambda a: a @ w)}
    out = {}
    for name, fn in fns.items():
        full = np.asarray(fn(x).astype(jnp.float32))
        out[name] = {str(m): int(np.sum(np.any(np.asarray(fn(x[:m]).astype(jnp.float32)) != full[:m], axis=1)))
                     for m in ms}  # rows of the first m whose bits differ from the max-M run
    return out


# ---- arrangements ----------------------------------------------------------------------------------
def shared_prefix_requests(n: int, vocab: int, tiny: bool, max_tokens: int, seed: int = 0):
    r = random.Random(seed)
    groups = 4 if tiny else 12
    prefixes = [[r.randrange(1, vocab) for _ in range(r.randint(16, 40) if tiny else r.randint(64, 512))]
                for _ in range(groups)]
    prompts, sps = [], []
    for i in range(n):
        pre = prefixes[r.randrange(groups)]
        cut = len(pre) if r.random() < 0.7 else r.randint(1, len(pre))  # some share only part of it
        prompts.append(pre[:cut] + [r.randrange(1, vocab) for _ in range(r.randint(1, 8 if tiny else 64))])
        sps.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) if i % 2 == 0 else
                   SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=i, ignore_eos=True))
    return prompts, sps


def arrangement_list(tiny: bool, kv_tokens: int, max_model_len: int, block_sizes=None):
    per_seq = -(-max_model_len // 16)
    tiny_pool = per_seq + 2 if tiny else 3 * per_seq  # a few requests at a time: decode growth preempts
    if block_sizes is None:
        block_sizes = (8,) if tiny else (8, 32, 64)  # each pool shape compiles the step again
    return [
        ("batched, cache off", dict(enable_prefix_caching=False), "batched"),
        ("batched, cache cold", {}, "batched"),
        ("batched, cache warm", {}, "warm"),
        ("reversed arrival", {}, "reversed"),
        ("staggered arrival", {}, "staggered"),
        *((f"block size {b}", dict(block_size=b, num_blocks=kv_tokens // b), "batched") for b in block_sizes),
        ("chunk budget", dict(max_num_batched_tokens=8 if tiny else 128), "batched"),
        ("tiny pool (preempts)", dict(num_blocks=tiny_pool, enable_prefix_caching=False), "batched"),
        ("sync scheduling", dict(async_scheduling=False), "batched"),
    ]


def run_arrangement(engine: LLMEngine, prompts, sps, mode: str) -> list[list[int]]:
    if mode == "reversed":
        return [o.outputs[0].token_ids for o in run_to_completion(engine, prompts[::-1], sps[::-1])][::-1]
    if mode == "staggered":
        pending, rids, got = list(range(len(prompts))), {}, {}
        while pending or engine.has_unfinished_requests():
            for _ in range(min(len(pending), 8)):
                i = pending.pop(0)
                rids[engine.add_request(prompts[i], sps[i])] = i
            for out in engine.step():
                got[rids[out.request_id]] = out.outputs[0].token_ids
        return [got[i] for i in range(len(prompts))]
    outs = run_to_completion(engine, prompts, sps)
    if mode == "warm":
        outs = run_to_completion(engine, prompts, sps)
    return [o.outputs[0].token_ids for o in outs]


def check_arrangements(args) -> dict:
    params = (load_params(tiny_checkpoint_path("qwen3"), "bfloat16", use_cache=False) if args.tiny
              else random_model(QWEN3_0_6B))
    prompts, sps = shared_prefix_requests(args.requests, params.config.vocab_size, args.tiny, args.max_tokens)
    longest = max(len(p) for p in prompts) + args.max_tokens
    max_model_len = -(-longest // 64) * 64
    kv_tokens = max(args.kv_tokens, 2 * max_model_len)
    # (tiny: steps of at most 16 tokens, the CPU's one token bucket: each pool's step compiles once)
    base = dict(block_size=16, num_blocks=kv_tokens // 16, max_model_len=max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=16 if args.tiny else 1024,
                attention_backend="triton")
    result = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_tokens": args.max_tokens,
              "modes": {}}
    for bi in args.modes:
        t0 = time.perf_counter()
        alone_engine = LLMEngine(params, EngineConfig(**base, enable_prefix_caching=False, batch_invariant=bi))
        alone = [run_to_completion(alone_engine, [p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, sps)]
        rows = {"alone_seconds": time.perf_counter() - t0}
        for name, overrides, mode in arrangement_list(args.tiny, kv_tokens, max_model_len, args.block_sizes):
            if name in args.skip_arrangements:
                continue
            t0 = time.perf_counter()
            engine = LLMEngine(params, EngineConfig(**{**base, **overrides, "batch_invariant": bi}))
            got = run_arrangement(engine, prompts, sps, mode)
            st = engine.stats()
            div = output_divergence(alone, got)
            rows[name] = dict(num_differ=div["num_differ"], first_divergence=div["first_divergence"],
                              seconds=time.perf_counter() - t0, preemptions=st["preemptions"],
                              prefix_hit_tokens=st["prefix_hit_tokens"])
            print(f"batch_invariant={bi} {name}: {div['num_differ']}/{len(prompts)} differ from alone "
                  f"({rows[name]['seconds']:.1f} s, {st['preemptions']} preemptions)", flush=True)
        result["modes"][str(bi)] = rows
    return result


# ---- hf --------------------------------------------------------------------------------------------
def check_hf(tiny: bool) -> dict:
    settings = {"bs8": dict(block_size=8), "bs16 chunk16": dict(block_size=16, max_num_batched_tokens=16),
                "bs32 caching off": dict(block_size=32, enable_prefix_caching=False)}
    if tiny:
        settings = {"bs8": settings["bs8"]}
    out = {}
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for model in ("qwen2", "qwen3") if not tiny else ("qwen3",):
        params = load_params(tiny_checkpoint_path(model), "float32", use_cache=False)
        ref = np.load(FIXTURES / f"hf_reference_{model}.npz")
        prompts = [list(map(int, ref[f"prompt_{i}"])) for i in range(4)]
        want = [list(map(int, ref[f"greedy_{i}"])) for i in range(4)]
        for bi in (False, True):
            for name, kw in settings.items():
                cfg = EngineConfig(**{"num_blocks": 4096 // kw["block_size"], "max_model_len": 128,
                                      "max_num_batched_tokens": 64, "attention_backend": "triton",
                                      "batch_invariant": bi, **kw})
                engine = LLMEngine(params, cfg)
                got = [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, sp)]
                div = output_divergence(want, got)
                out[f"{model} {name} batch_invariant={bi}"] = dict(num_differ=div["num_differ"],
                                                                   first_divergence=div["first_divergence"])
    return out


# ---- throughput ------------------------------------------------------------------------------------
def check_throughput(args) -> dict:
    if args.tiny:
        params = load_params(tiny_checkpoint_path("qwen3"), "bfloat16", use_cache=False)
        r = random.Random(0)  # nano-vllm's workload in miniature (its prompts are >= 100 tokens)
        prompts = [[r.randrange(params.config.vocab_size) for _ in range(r.randint(8, 24))] for _ in range(4)]
        sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.randint(2, 4)) for _ in range(4)]
        ns = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=32, backend="triton", max_model_len=64)
    else:
        params = random_model(QWEN3_0_6B)
        prompts, sps = nano_vllm_workload(args.throughput_seqs)
        ns = dict(block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, backend="auto", max_model_len=2048)
    out = {}
    for bi in (False, True):
        r = run_ours(params, prompts, sps, argparse.Namespace(**ns, async_scheduling=True, batch_invariant=bi))
        out[str(bi)] = {k: r[k] for k in ("tok_per_s", "seconds", "output_tokens", "steps", "warmup_compile_s")}
        print(f"throughput batch_invariant={bi}: {r['tok_per_s']:.0f} tok/s ({r['seconds']:.1f} s)", flush=True)
    out["invariant_over_default"] = out["True"]["tok_per_s"] / out["False"]["tok_per_s"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny checkpoint, a few requests")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--requests", type=int, default=None, help="arrangements: requests (200; tiny 6)")
    ap.add_argument("--modes", type=lambda v: v == "True", nargs="+", default=[False, True],
                    help="arrangements: batch_invariant values to run (False True)")
    ap.add_argument("--skip-arrangements", nargs="*", default=[], help="arrangement names to leave out")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=None,
                    help="arrangements: block sizes besides 16 (8 32 64; tiny 8); each compiles the step again")
    ap.add_argument("--max-tokens", type=int, default=None, help="arrangements: tokens per request (24; tiny 4)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="arrangements (64; tiny 4)")
    ap.add_argument("--kv-tokens", type=int, default=None, help="arrangements: KV slots (65536; tiny 1024)")
    ap.add_argument("--throughput-seqs", type=int, default=256, help="nano-vllm workload size")
    args = ap.parse_args(argv)
    for name, full, tiny in (("requests", 200, 6), ("max_tokens", 24, 4), ("max_num_seqs", 64, 4),
                             ("kv_tokens", 65536, 1024)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(args)}
    t_start = time.perf_counter()
    for section in args.sections:
        t0 = time.perf_counter()
        fn = {"precision": lambda: check_precision(args.tiny), "rows": lambda: check_rows(args.tiny),
              "arrangements": lambda: check_arrangements(args), "hf": lambda: check_hf(args.tiny),
              "throughput": lambda: check_throughput(args)}[section]
        report[section] = fn()
        report[f"{section}_seconds"] = time.perf_counter() - t0
        print(f"[{section}] done in {report[f'{section}_seconds']:.1f} s", flush=True)
    report["total_seconds"] = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "check_invariance.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    print_table(report)
    return report


def print_table(report: dict) -> None:
    print(f"\n== numerics check on {report['device']} ({report['total_seconds']:.0f} s) ==")
    if "precision" in report:
        p = report["precision"]
        print("float32 rel. error vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in p.items() if k != "verdict"))
    if "rows" in report:
        for name, per_m in report["rows"].items():
            print(f"bf16 rows differing from the max-M run, {name}: " + ", ".join(f"M={m}: {c}" for m, c in per_m.items()))
    if "arrangements" in report:
        a = report["arrangements"]
        modes = a["modes"]
        names = [k for k in next(iter(modes.values())) if k != "alone_seconds"]
        cell = lambda mode, n: f"{modes[mode][n]['num_differ']:d}" if mode in modes else "-"  # noqa: E731
        print(f"\nrequests differing from alone ({a['requests']} requests, {a['max_tokens']} tokens each, bf16):")
        print(f"{'arrangement':24s} {'default':>8s} {'invariant':>9s} {'preempt':>7s}")
        for n in names:
            last = modes[list(modes)[-1]][n]
            print(f"{n:24s} {cell('False', n):>8s} {cell('True', n):>9s} {last['preemptions']:7d}")
    if "hf" in report:
        bad = {k: v["num_differ"] for k, v in report["hf"].items() if v["num_differ"]}
        print(f"\nfloat32 vs transformers (greedy, Pallas): {len(report['hf']) - len(bad)}/{len(report['hf'])} "
              f"settings match" + (f"; differing: {bad}" if bad else ""))
    if "throughput" in report:
        t = report["throughput"]
        print(f"throughput (nano-vllm workload): default {t['False']['tok_per_s']:.0f} tok/s, batch_invariant "
              f"{t['True']['tok_per_s']:.0f} tok/s ({t['invariant_over_default']:.0%} of default)")


if __name__ == "__main__":
    main()
