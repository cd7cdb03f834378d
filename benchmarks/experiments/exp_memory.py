"""Experiment: paged KV blocks vs. max-length reservation, same model, same kernel, same requests.

Only the allocator differs: ``paged`` hands out a block when the last one fills; ``max_len`` reserves
``ceil(max_model_len / block_size)`` contiguous blocks per request at admission, as a contiguous KV
cache does. With the pool fixed, the question is how many requests run at once, how many steps the
workload takes, and how much of the allocated KV memory holds tokens. A third run, ``paged fp8``,
stores the KV in 8 bits (``kv_cache_dtype="fp8"``) in a pool of the same bytes: about twice the blocks,
so more requests at once where memory is what limits them, and half the KV bytes per token held.

    python benchmarks/experiments/exp_memory.py [--out DIR]                       # tiny model, CPU: the trend
    python benchmarks/experiments/exp_memory.py --full [--model qwen2.5-7b] --out DIR  # the design notes' workloads (GPU)

``--full`` runs the design notes' workloads instead (``full_workloads``): (1) 64 requests of 32-1,024
tokens, 8 concurrent, at Qwen3-0.6B shapes; (2) 32 requests of 256-2,048 prompt tokens + 128
generated, all concurrent, at Qwen3-0.6B and (``--model qwen2.5-7b``) Qwen2.5-7B shapes. Each prints
our number next to the design notes'. Memory is reported the way users read it:

* JAX's allocator (``jax.devices()[0].memory_stats()``: ``peak_bytes_in_use``; none on a CPU). The
  pool is allocated whole when the engine is made, so this counts weights + the *whole* pool +
  activations, the same for both policies;
* the KV actually allocated, from our block counters: peak blocks held by block tables x block bytes
  (``engine.stats()["peak_kv_bytes_in_use"]``), and how much of it held tokens at that step; plus
  "weights + peak KV allocated": the device memory a pool sized exactly for the workload would need.

``--tiny-override`` runs the ``--full`` code path with tiny sizes (for the CPU tests).

Writes ``memory.json`` (and ``memory.png`` when matplotlib is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import jax

from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import EXPERIMENT_MODELS, device_memory, experiment_params, params_bytes

GiB = 2**30


def workload(n: int, max_prompt: int, max_out: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, max_prompt))] for _ in range(n)]
    sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(16, max_out)) for _ in range(n)]
    return prompts, sps


def run(params, policy: str, prompts, sps, args, *, num_blocks: int | None = None, max_model_len: int | None = None,
        max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, block_size: int | None = None,
        pool_bytes: int | None = None) -> dict:
    """Runs the requests under one reservation policy; returns steps, batch sizes and memory use.

    ``policy``: ``paged``, ``max_len``, or ``paged fp8`` (paged over an fp8 pool of ``pool_bytes``,
    the bytes of the other runs' pool: as many blocks as fit)."""
    bs = block_size or args.block_size
    kv_cache_dtype = "auto"
    if policy == "paged fp8":
        kv_cache_dtype = "fp8"  # one byte an element, plus a scale row a block (jaxpaged/kernels/fp8.py)
        block_bytes = params.config.kv_bytes_per_token(1) * (bs + 1)
        num_blocks = pool_bytes // block_bytes  # as many as fit
    cfg = EngineConfig(block_size=bs, num_blocks=num_blocks or args.num_blocks,
                       max_model_len=max_model_len or args.max_model_len, max_num_seqs=max_num_seqs,
                       reservation=policy.split()[0], enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
                       max_num_batched_tokens=max_num_batched_tokens or args.max_num_batched_tokens)
    engine = LLMEngine(params, cfg)
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sps)
    seconds = time.perf_counter() - t0
    cols = engine.metrics.as_columns()
    s = engine.stats()
    # KV allocated (held by block tables) and KV holding tokens, per step, from our counters.
    allocated = cols["kv_bytes_in_use"]
    holding = [a * u for a, u in zip(allocated, cols["block_utilisation"])]
    peak_step = max(range(len(allocated)), key=allocated.__getitem__)
    weights = params_bytes(params)
    result = dict(policy=policy, kv_cache_dtype=str(engine.kv_dtype), num_blocks=engine.num_blocks, seconds=seconds, compile_seconds=s["compile_seconds"], steps=s["steps"], output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                  peak_running=max(cols["num_seqs"]), mean_running=sum(cols["num_seqs"]) / len(cols["num_seqs"]),
                  mean_block_utilisation=sum(cols["block_utilisation"]) / len(cols["block_utilisation"]),
                  peak_blocks_used=s["peak_blocks_used"], preemptions=s["preemptions"],
                  admission_refusals=s["max_len_admission_failures"],
                  fragmentation_refusals=s["max_len_fragmentation_failures"],
                  weights_bytes=weights, kv_pool_bytes=s["kv_pool_bytes"], kv_bytes_per_token=s["kv_bytes_per_token"],
                  peak_kv_allocated_bytes=s["peak_kv_bytes_in_use"], kv_holding_tokens_at_peak_bytes=holding[peak_step],
                  peak_kv_holding_tokens_bytes=max(holding),
                  weights_plus_peak_kv_bytes=weights + s["peak_kv_bytes_in_use"], device_memory=device_memory(),
                  series=cols)
    del engine  # the pool goes with the engine
    return result


# The design notes' numbers (a walkthrough of nano-vllm), one entry per workload.
DESIGN_NOTES = {
    "memory_64x8": "contiguous max-length reservation ~5.6 GB of KV vs paged ~2.1 GB; no fragmentation failure",
    "memory_7b_32": "peak GPU memory ~15 GB contiguous vs ~8.5 GB paged (a 7B model)",
}


def full_workloads(model: str, tiny: bool) -> list[dict]:
    """The design notes' memory workloads for ``model`` (``tiny``: same shape of workload, small sizes).

    ``memory_64x8``: 64 requests of 32-1,024 tokens (prompt 32-896 + 128 generated), 8 concurrent,
    block size 16; the pool holds exactly 8 max-length reservations (512 blocks), so the contiguous
    policy can run its 8 requests. ``memory_7b_32``: 32 requests of 256-2,048 prompt tokens + 128
    generated, all 32 concurrent; the pool holds 32 reservations of 2,176 tokens (4,352 blocks).
    """
    w1 = dict(name="memory_64x8", requests=64, prompt=(32, 896), max_tokens=128, max_model_len=1024,
              max_num_seqs=8, num_blocks=8 * 1024 // 16, max_num_batched_tokens=1024)
    w2 = dict(name="memory_7b_32", requests=32, prompt=(256, 2048), max_tokens=128, max_model_len=2048 + 128,
              max_num_seqs=32, num_blocks=32 * (2048 + 128) // 16, max_num_batched_tokens=8192)
    if tiny:  # the same code path at CPU sizes; both workloads on one engine shape: the second finds its steps compiled
        w1.update(requests=12, prompt=(8, 48), max_tokens=8, max_model_len=64, max_num_seqs=4, num_blocks=16,
                  max_num_batched_tokens=64)
        w2.update(requests=4, prompt=(16, 56), max_tokens=8, max_model_len=64, max_num_seqs=4, num_blocks=16,
                  max_num_batched_tokens=64)
    return [w2] if model == "qwen2.5-7b" else [w1, w2]


def run_full(params, model: str, args) -> dict:
    """The design notes' workloads, both policies each; our numbers next to theirs."""
    rows, workloads = [], {}
    for w in full_workloads(model, args.tiny_override):
        rng = random.Random(0)
        vocab = params.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*w["prompt"]))] for _ in range(w["requests"])]
        sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=w["max_tokens"])] * w["requests"]
        sizes = dict(block_size=16, max_model_len=w["max_model_len"], max_num_seqs=w["max_num_seqs"],
                     max_num_batched_tokens=w["max_num_batched_tokens"])
        c, p = (run(params, policy, prompts, sps, args, num_blocks=w["num_blocks"], **sizes)
                for policy in ("max_len", "paged"))
        p8 = run(params, "paged fp8", prompts, sps, args, pool_bytes=p["kv_pool_bytes"], **sizes)
        if w["name"] == "memory_64x8":
            ours = (f"KV allocated at peak: contiguous {fmt_bytes(c['peak_kv_allocated_bytes'])} vs paged "
                    f"{fmt_bytes(p['peak_kv_allocated_bytes'])} (holding tokens {fmt_bytes(p['kv_holding_tokens_at_peak_bytes'])}); "
                    f"fragmentation refusals {c['fragmentation_refusals']}; paged fp8 {fmt_bytes(p8['peak_kv_allocated_bytes'])}")
        else:
            ours = (f"weights + peak KV allocated: contiguous {fmt_bytes(c['weights_plus_peak_kv_bytes'])} vs paged "
                    f"{fmt_bytes(p['weights_plus_peak_kv_bytes'])} (weights {fmt_bytes(p['weights_bytes'])}), paged fp8 "
                    f"{fmt_bytes(p8['weights_plus_peak_kv_bytes'])}; "
                    f"JAX peak_bytes_in_use {fmt_gib(p['device_memory']['peak_bytes_in_use'])} (whole pool preallocated)")
        rows.append(dict(experiment=w["name"], design_notes=DESIGN_NOTES[w["name"]], model=model, ours=ours))
        workloads[w["name"]] = dict(workload={k: v for k, v in w.items()}, results=[c, p, p8])
    return dict(design_notes_rows=rows, workloads=workloads)


def fmt_gib(n) -> str:
    return "n/a (CPU)" if n is None else fmt_bytes(n)


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def print_full(full: dict) -> None:
    print("KV allocated comes from our block counters (blocks held by block tables x block bytes): the pool is "
          "allocated whole when the engine is made, so JAX's allocator sees weights + the whole pool.")
    for name, w in full["workloads"].items():
        print(f"-- {name}: {w['workload']}")
        print(f"{'policy':9s} {'steps':>6s} {'peak batch':>10s} {'peak KV alloc GiB':>17s} {'holding tok GiB':>15s} "
              f"{'KV util':>7s} {'weights+KV GiB':>14s} {'JAX peak GiB':>12s} {'refusals':>8s} {'frag':>5s}")
        for r in w["results"]:
            peak = r["device_memory"]["peak_bytes_in_use"]
            print(f"{r['policy']:9s} {r['steps']:6d} {r['peak_running']:10d} {r['peak_kv_allocated_bytes'] / GiB:17.3f} "
                  f"{r['kv_holding_tokens_at_peak_bytes'] / GiB:15.3f} {r['mean_block_utilisation']:7.1%} "
                  f"{r['weights_plus_peak_kv_bytes'] / GiB:14.2f} {'n/a' if peak is None else f'{peak / GiB:.2f}':>12s} "
                  f"{r['admission_refusals']:8d} {r['fragmentation_refusals']:5d}")
    for row in full["design_notes_rows"]:
        print(f"[{row['experiment']}] design notes: {row['design_notes']}\n    ours ({row['model']}): {row['ours']}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--full", action="store_true", help="the design notes' workloads at --model shapes (GPU)")
    ap.add_argument("--model", choices=sorted(EXPERIMENT_MODELS), default=None,
                    help="default: qwen3-0.6b with --full, else tiny")
    ap.add_argument("--tiny-override", action="store_true", help="--full's code path at tiny sizes (CPU tests)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    model = args.model or ("tiny" if args.tiny_override or not args.full else "qwen3-0.6b")
    params = experiment_params(args.full, model)
    os.makedirs(args.out, exist_ok=True)
    if args.full:
        full = run_full(params, model, args)
        report = {"device": str(jax.devices()[0]), "args": vars(args), "model": model, **full}
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump(report, f)
        print_full(full)
        return report
    prompts, sps = workload(args.requests, args.max_model_len // 2, args.max_model_len // 2, params.config.vocab_size)
    results = [run(params, policy, prompts, sps, args) for policy in ("paged", "max_len")]
    results.append(run(params, "paged fp8", prompts, sps, args, pool_bytes=results[0]["kv_pool_bytes"]))
    report = {"device": str(jax.devices()[0]), "args": vars(args), "results": results}
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump(report, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
        for r in results:
            axes[0].plot(r["series"]["num_seqs"], label=r["policy"])
            axes[1].plot(r["series"]["block_utilisation"], label=r["policy"])
        axes[0].set(xlabel="step", ylabel="requests in the batch", title=f"pool of {args.num_blocks} blocks")
        axes[1].set(xlabel="step", ylabel="filled / allocated KV slots", ylim=(0, 1.05))
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "memory.png"), dpi=120)
    except ImportError:
        pass
    # Wall seconds of the whole run, including the compilation of each step shape it met first (no
    # warm-up: the two policies meet different shapes), which is also given alone.
    print(f"{'policy':9s} {'blocks':>6s} {'steps':>6s} {'wall s':>8s} {'of which compile s':>18s} {'peak batch':>10s} "
          f"{'mean batch':>10s} {'KV utilisation':>14s} {'refusals':>8s} {'preempted':>9s}")
    for r in results:
        print(f"{r['policy']:9s} {r['num_blocks']:6d} {r['steps']:6d} {r['seconds']:8.2f} {r['compile_seconds']:18.2f} "
              f"{r['peak_running']:10d} {r['mean_running']:10.1f} {r['mean_block_utilisation']:14.1%} "
              f"{r['admission_refusals']:8d} {r['preemptions']:9d}")
    return report


if __name__ == "__main__":
    main()
