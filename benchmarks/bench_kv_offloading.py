"""The host tier (``kv_offloading_size``) on an agent workload whose prefixes do not fit the device pool.

Three measurements, one process (run in the order 3, 2, 1):

1. **Agent workload**, with the tier and without: ``--agents`` system prompts of ``--prefix-len``
   tokens; ``--requests`` requests, each a random agent's prompt + a 16-64-token question, 32 output
   tokens (greedy, ``ignore_eos``), ``--concurrency`` requests in flight (a new one as soon as one
   finishes: agents waiting on replies). The device pool holds ``--pool-share`` of all system prompts
   (plus room for the requests in flight); the host tier holds them all (``--host-share``). Reported
   per run: prefix hit rate (and the host's part), prefill tokens computed, output and total tok/s,
   TTFT p50/p99 (from ``add_request``), blocks offloaded and reloaded; outputs compared.
2. **TTFT of one request** (batch 1) whose ``--ttft-prefix``-token prefix is on the host tier, against
   the same request recomputed (no cache) and the same request with its prefix on the device: median of
   ``--repeats``.
3. **Copy bandwidth**: reloading and offloading 128 blocks through ``KVTransfers`` (timed to completion),
   against one ``device_put`` of a contiguous pinned host buffer of the same size, host to device and
   back, in the same process.

    python benchmarks/bench_kv_offloading.py --model qwen2.5-7b --out $OUT   # GPU
    python benchmarks/bench_kv_offloading.py --model tiny --out /tmp/o     # CPU, small sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from jaxpaged.engine.kv_transfer import MAX_BLOCKS, KVTransfers, host_memory_kind  # noqa: E402
from jaxpaged.engine.metrics import percentile  # noqa: E402
from jaxpaged.kv.host_tier import Transfer  # noqa: E402
from jaxpaged.models.kv_pool import bytes_per_token_per_device, make_kv_pool  # noqa: E402
from jaxpaged.workloads import (EXPERIMENT_MODELS, agent_workload, experiment_params,  # noqa: E402
                                output_divergence, outputs_guaranteed_identical, random_model)

SIZES = {
    "tiny": dict(agents=8, prefix_len=(48, 96), requests=48, concurrency=2, ttft_prefix=96, max_num_batched_tokens=256),
    "full": dict(agents=64, prefix_len=(2000, 4000), requests=512, concurrency=8, ttft_prefix=2000,
                 max_num_batched_tokens=8192),
}
QUESTION_LEN = (16, 64)
BLOCK_SIZE = 16


def closed_loop(engine: LLMEngine, prompts, sp: SamplingParams, concurrency: int):
    """Keeps ``concurrency`` requests in flight until all are done; returns outputs in prompt order."""
    todo = list(enumerate(prompts))[::-1]
    index, outs = {}, {}
    while todo or engine.has_unfinished_requests():
        while todo and len(index) - len(outs) < concurrency:
            i, p = todo.pop()
            index[engine.add_request(p, sp)] = i
        for out in engine.step():
            if out.finished:
                outs[index[out.request_id]] = out
    return [outs[i] for i in range(len(prompts))]


def workload_run(params, config: EngineConfig, prompts, sp, concurrency: int) -> tuple[dict, list]:
    engine = LLMEngine(params, config)
    compile_s = engine.warmup(use_tqdm=False)
    t0 = time.perf_counter()
    outs = closed_loop(engine, prompts, sp, concurrency)
    seconds = time.perf_counter() - t0
    engine.kv.check_invariants()
    s = engine.stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    ttft = [o.metrics.time_to_first_token * 1e3 for o in outs]
    row = dict(kv_offloading_size_gib=config.kv_offloading_size, seconds=seconds, compile_seconds=compile_s,
               output_tok_s=out_tokens / seconds, total_tok_s=(out_tokens + prompt_tokens) / seconds,
               prefix_hit_rate=s["prefix_hit_rate"], host_hit_rate=s["host_hit_tokens"] / s["prefix_query_tokens"],
               prefill_tokens=s["prefix_query_tokens"] - s["prefix_hit_tokens"],
               ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
               evictions=s["evictions"], preemptions=s["preemptions"], num_blocks=s["num_blocks"],
               host_blocks=s["host_blocks"], blocks_offloaded=s["blocks_offloaded"],
               blocks_reloaded=s["blocks_reloaded"], host_hits_recomputed=s["host_hits_recomputed"],
               reload_cost=dataclasses.asdict(engine.reload_cost) if engine.reload_cost else None,
               **{k: s[k] for k in ("offload_bytes", "reload_bytes", "offload_gbps", "reload_gbps",
                                    "host_reserve_seconds") if k in s})
    return row, [o.outputs[0].token_ids for o in outs]


def block_bytes(params) -> int:
    """Bytes of one block of the model's KV (every layer, K and V) in the weights' dtype, one device."""
    return BLOCK_SIZE * bytes_per_token_per_device(params, params.dtype)


def ttft_one(engine: LLMEngine, prompt, sp) -> float:
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, sp)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
                while engine.has_unfinished_requests():
                    engine.step()
                return ttft * 1e3


def ttft_by_tier(params, prefix_len: int, repeats: int, vocab: int, budget: int) -> dict:
    """Batch 1: a prefix on the host tier vs recomputed vs on the device (medians of ``repeats``). The
    pool holds one request: two other prompts evict the prefix to the host."""
    rng = np.random.default_rng(5)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefix_blocks = -(-prefix_len // BLOCK_SIZE)
    num_blocks = prefix_blocks + 4
    max_model_len = num_blocks * BLOCK_SIZE
    engine = LLMEngine(params, EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_model_len=max_model_len,
                                            max_num_batched_tokens=budget, max_num_seqs=8,
                                            kv_offloading_size=4 * prefix_blocks * block_bytes(params) / 2**30))
    engine.warmup(use_tqdm=False)

    def rand(n):
        return [int(t) for t in rng.integers(1, vocab, n)]

    times = {"recomputed": [], "host": [], "device": []}
    for _ in range(repeats + 1):  # the first round warms every path up and is dropped
        prefix = rand(prefix_len)
        times["recomputed"].append(ttft_one(engine, prefix + rand(32), sp))  # computes and caches the prefix
        times["device"].append(ttft_one(engine, prefix + rand(32), sp))  # hit on the device
        for _ in range(2):  # other prompts evict the prefix to the host tier
            ttft_one(engine, rand(prefix_len), sp)
        assert engine.kv.trie.path(prefix)[0].tier == "host"
        times["host"].append(ttft_one(engine, prefix + rand(32), sp))
    s = engine.stats()
    row = {f"ttft_{k}_ms": float(np.median(v[1:])) for k, v in times.items()}
    row.update(prefix_tokens=prefix_len, repeats=repeats, blocks_reloaded=s["blocks_reloaded"],
               host_over_recomputed=row["ttft_host_ms"] / row["ttft_recomputed_ms"])
    return row


def bandwidth(params, blocks: int = MAX_BLOCKS, repeats: int = 5) -> dict:
    """Reload / offload of ``blocks`` blocks through KVTransfers vs one contiguous device_put each way."""
    pool = make_kv_pool(params, 2 * blocks, BLOCK_SIZE, params.dtype)
    t = KVTransfers(pool, num_slots=blocks)
    t.warmup(pool)
    device = jax.local_devices()[0]
    kind = host_memory_kind(device)
    nbytes = blocks * t.block_bytes
    contiguous = jnp.zeros((nbytes // 2,), jnp.bfloat16, device=device)
    host_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
    dev_sharding = jax.sharding.SingleDeviceSharding(device)
    host = jax.device_put(contiguous, host_sharding).block_until_ready()
    res = {"h2d": [], "d2h": [], "reload": [], "offload": []}
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        jax.device_put(host, dev_sharding).block_until_ready()
        res["h2d"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.device_put(contiguous, host_sharding).block_until_ready()
        res["d2h"].append(time.perf_counter() - t0)
        pool.block_until_ready()
        t0 = time.perf_counter()
        pool = t.run(pool, [Transfer("offload", b, b) for b in range(blocks)])
        t.finish_offloads()
        jax.block_until_ready([t.slots[b] for b in range(blocks)])
        res["offload"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pool = t.run(pool, [Transfer("reload", blocks + b, b) for b in range(blocks)])
        pool.block_until_ready()
        res["reload"].append(time.perf_counter() - t0)
    gbps = {k: nbytes / float(np.median(v[1:])) / 1e9 for k, v in res.items()}
    return dict(blocks=blocks, bytes=nbytes, memory_kind=kind, **{f"{k}_gbps": v for k, v in gbps.items()},
                reload_over_h2d=gbps["reload"] / gbps["h2d"], offload_over_d2h=gbps["offload"] / gbps["d2h"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=sorted(EXPERIMENT_MODELS))
    ap.add_argument("--agents", type=int)
    ap.add_argument("--prefix-len", type=int, nargs=2)
    ap.add_argument("--requests", type=int)
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--pool-share", type=float, default=0.25, help="of all system prompts' blocks")
    ap.add_argument("--host-share", type=float, default=1.25, help="of all system prompts' bytes")
    ap.add_argument("--ttft-prefix", type=int)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=(), choices=("workload", "ttft", "bandwidth"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    size = dict(SIZES["tiny" if args.model == "tiny" else "full"])
    for k in ("agents", "prefix_len", "requests", "concurrency", "ttft_prefix"):
        if getattr(args, k) is not None:
            size[k] = tuple(getattr(args, k)) if k == "prefix_len" else getattr(args, k)
    params = experiment_params(full=False) if args.model == "tiny" else random_model(EXPERIMENT_MODELS[args.model])
    vocab = params.config.vocab_size
    max_tokens = 32 if args.model != "tiny" else 4
    max_model_len = size["prefix_len"][1] + QUESTION_LEN[1] + max_tokens
    max_model_len = -(-max_model_len // BLOCK_SIZE) * BLOCK_SIZE
    result = dict(model=args.model, device=jax.devices()[0].device_kind, jax=jax.__version__, size=size)
    print(f"device {result['device']}, jax {jax.__version__}, model {args.model}", flush=True)

    if "ttft" not in args.skip:
        result["ttft"] = ttft_by_tier(params, size["ttft_prefix"], args.repeats, vocab, size["max_num_batched_tokens"])
        print(json.dumps(result["ttft"]), flush=True)
    if "bandwidth" not in args.skip:
        result["bandwidth"] = bandwidth(params)
        print(json.dumps(result["bandwidth"]), flush=True)

    if "workload" not in args.skip:
        prompts, _, systems = agent_workload(size["agents"], size["prefix_len"], QUESTION_LEN, size["requests"], vocab)
        prefix_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in systems)
        in_flight = size["concurrency"] * -(-max_model_len // BLOCK_SIZE)
        num_blocks = int(args.pool_share * prefix_blocks) + in_flight
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        base = dict(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_model_len=max_model_len,
                    max_num_seqs=size["concurrency"], max_num_batched_tokens=size["max_num_batched_tokens"])
        host_gib = args.host_share * prefix_blocks * block_bytes(params) / 2**30
        rows, tokens = [], []
        for gib in (0, host_gib):
            row, toks = workload_run(params, EngineConfig(**base, kv_offloading_size=gib), prompts, sp, size["concurrency"])
            rows.append(row)
            tokens.append(toks)
            print(json.dumps(row), flush=True)
        result["workload"] = dict(rows=rows, prefix_blocks=prefix_blocks, num_blocks=num_blocks,
                                  outputs_identical=tokens[0] == tokens[1],
                                  requests_differing=output_divergence(tokens[0], tokens[1])["num_differ"],
                                  identical_guaranteed=outputs_guaranteed_identical(params.dtype, False),
                                  speedup=rows[1]["output_tok_s"] / rows[0]["output_tok_s"])
    print("\n| measurement | without tier | with tier |\n|---|---|---|")
    if "workload" in result:
        a, b = result["workload"]["rows"]
        for k, fmt in (("prefix_hit_rate", "{:.1%}"), ("host_hit_rate", "{:.1%}"), ("prefill_tokens", "{:,}"),
                       ("output_tok_s", "{:,.0f}"), ("total_tok_s", "{:,.0f}"), ("ttft_p50_ms", "{:.1f}"),
                       ("ttft_p99_ms", "{:.1f}"), ("blocks_offloaded", "{:,}"), ("blocks_reloaded", "{:,}"),
                       ("host_hits_recomputed", "{:,}")):
            print(f"| {k} | {fmt.format(a[k])} | {fmt.format(b[k])} |")
        print(f"| speedup (output tok/s) | | {result['workload']['speedup']:.2f}x |")
        w = result["workload"]
        print(f"| requests with other tokens | | {w['requests_differing']} of {len(a) and size['requests']} "
              f"({'must be 0' if w['identical_guaranteed'] else params.dtype + ': not guaranteed, batching differs'}) |")
    if "ttft" in result:
        r = result["ttft"]
        print(f"| TTFT, {r['prefix_tokens']}-token prefix (ms) | recomputed {r['ttft_recomputed_ms']:.2f} | "
              f"host {r['ttft_host_ms']:.2f} ({r['host_over_recomputed']:.2f}x), device {r['ttft_device_ms']:.2f} |")
    if "bandwidth" in result:
        r = result["bandwidth"]
        print(f"| copy GB/s ({r['bytes'] / 2**20:.0f} MiB) | h2d {r['h2d_gbps']:.1f}, d2h {r['d2h_gbps']:.1f} | "
              f"reload {r['reload_gbps']:.1f} ({r['reload_over_h2d']:.0%}), offload {r['offload_gbps']:.1f} "
              f"({r['offload_over_d2h']:.0%}) |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"kv_offloading_{args.model}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
