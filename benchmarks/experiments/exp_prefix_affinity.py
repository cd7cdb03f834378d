"""Experiment: prefix-affinity scheduling vs FCFS on a mixed agent workload.

Several agents, each with its own long system prompt, send requests whose arrivals interleave
(request ``i`` picks a random agent); ``--arrivals-per-step`` new requests join the queue before each
engine step (arrivals paced by steps, not seconds, so a run is deterministic and its rehearsal
compiles exactly the shapes it uses). The KV pool is too small to keep every agent's prefix cached
while requests run, so under FCFS prefixes evict each other between uses. ``prefix_affinity``
(``EngineConfig(scheduling_policy="prefix_affinity")``, ``jaxpaged/scheduling_policy.py``) admits
requests whose prefix is cached or being computed first, with a bounded wait. Reported per policy:
prefix hit rate, prefill tokens, evictions, preemptions, output tokens/s, TTFT p50/p99 (from
arrival), the most steps a request was passed over; greedy outputs are compared across policies.

    python benchmarks/experiments/exp_prefix_affinity.py [--out DIR]                   # tiny model, CPU
    python benchmarks/experiments/exp_prefix_affinity.py --full [--model ...] --out DIR  # Qwen3-0.6B shapes (GPU)

``--full``: 8 agents with 1,024-1,536-token system prompts, 192 requests (16-64-token questions, 32
generated tokens), 4 arrivals per step, 32 concurrent requests, a pool of 512 blocks of 16 (8,192
tokens: about 5 of the 8 prefixes). ``--host-only`` runs the scheduler and KV manager alone at the
chosen sizes with a stand-in model (every sampled token is 7): hit rate, prefill tokens, steps and TTFT
in steps, in about a second on a CPU, whatever the model. Writes ``prefix_affinity.json`` (and a PNG with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

from jaxpaged.engine.metrics import percentile
from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.workloads import EXPERIMENT_MODELS, agent_workload, experiment_params, output_divergence, outputs_guaranteed_identical

POLICIES = ("fcfs", "prefix_affinity")
DESIGN_NOTES = "prefix-affinity queueing (requests sharing a prefix run close together) named as the next optimisation"

SIZES = {  # name -> settings; "tiny" is the CPU default and what --tiny-override gives --full
    "tiny": dict(agents=4, prefix_len=(40, 56), question_len=(2, 9), requests=24, max_tokens=4, arrivals_per_step=2,
                 max_num_seqs=4, num_blocks=14, max_num_batched_tokens=64, block_size=16),
    "full": dict(agents=8, prefix_len=(1024, 1536), question_len=(16, 64), requests=192, max_tokens=32,
                 arrivals_per_step=4, max_num_seqs=32, num_blocks=512, max_num_batched_tokens=2048, block_size=16),
}


def agent_prompts(s: dict, vocab: int, seed: int = 0) -> list[list[int]]:
    """``requests`` prompts: the system prompt of a random agent + a distinct question."""
    return agent_workload(s["agents"], s["prefix_len"], s["question_len"], s["requests"], vocab, seed)[0]


def paced(engine: LLMEngine, prompts, sp: SamplingParams, per_step: int):
    """Adds ``per_step`` prompts before each engine step until all are queued; outputs in order."""
    todo = list(enumerate(prompts))[::-1]
    index, outs = {}, {}
    while todo or engine.has_unfinished_requests():
        for _ in range(min(per_step, len(todo))):
            i, p = todo.pop()
            index[engine.add_request(p, sp)] = i
        for out in engine.step():
            outs[index[out.request_id]] = out
    return [outs[i] for i in range(len(prompts))]


def run(params, s: dict, policy: str, prompts, sp, max_model_len: int) -> dict:
    cfg = EngineConfig(block_size=s["block_size"], num_blocks=s["num_blocks"],
                       max_model_len=max_model_len, max_num_seqs=s["max_num_seqs"],
                       max_num_batched_tokens=s["max_num_batched_tokens"], scheduling_policy=policy)
    paced(LLMEngine(params, cfg), prompts, sp, s["arrivals_per_step"])  # rehearsal: compiles every shape used
    engine = LLMEngine(params, cfg)
    t0 = time.perf_counter()
    outs = paced(engine, prompts, sp, s["arrivals_per_step"])
    seconds = time.perf_counter() - t0
    engine.kv.check_invariants()
    st = engine.stats()
    ttft = [o.metrics.time_to_first_token * 1e3 for o in outs]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(policy=policy, seconds=seconds, steps=st["steps"], output_tokens=out_tokens,
                output_tokens_per_second=out_tokens / seconds, prompt_tokens=sum(map(len, prompts)),
                prefill_tokens=st["prefill_tokens"], prefix_hit_rate=st["prefix_hit_rate"],
                prefix_hit_tokens=st["prefix_hit_tokens"], evictions=st["evictions"], preemptions=st["preemptions"],
                deferred_admissions=st["deferred_admissions"], reordered_admissions=st["reordered_admissions"],
                max_passes_observed=st["max_passes_observed"], ttft_ms=ttft, ttft_p50_ms=percentile(ttft, 50),
                ttft_p99_ms=percentile(ttft, 99), compiled_shapes_during_run=st["compiled_shapes"],
                output_token_ids=[o.outputs[0].token_ids for o in outs])


def simulate(s: dict, policy: str, prompts, max_model_len: int) -> dict:
    """The schedule alone (no model): the same paced arrivals through ``Scheduler`` + ``KVCacheManager``."""
    import numpy as np

    from jaxpaged.kv import KVCacheManager
    from jaxpaged.engine.scheduler import Scheduler
    from jaxpaged.request import Sequence

    kv = KVCacheManager(s["num_blocks"], s["block_size"], max_model_len=max_model_len)
    sched = Scheduler(kv, max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
                      max_model_len=max_model_len, scheduling_policy=policy)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=s["max_tokens"])
    todo, arrived, first, step = list(enumerate(prompts))[::-1], {}, {}, 0
    while todo or sched.has_unfinished():
        for _ in range(min(s["arrivals_per_step"], len(todo))):
            i, p = todo.pop()
            sched.add(Sequence(str(i), p, sampling_params=sp))
            arrived[str(i)] = step
        scheduled = sched.schedule()
        sched.resolve(sched.advance(scheduled), np.full(len(scheduled), 7))  # every sampled token is 7
        for seq, _ in scheduled:
            if seq.num_output_tokens and seq.request_id not in first:
                first[seq.request_id] = step
        step += 1
    kv.check_invariants()
    st, c = kv.stats(), sched.counters
    ttft = [first[r] - arrived[r] for r in arrived]
    return dict(policy=policy, steps=step, prefix_hit_rate=st.prefix_hit_rate, prefill_tokens=c.prefill_tokens,
                evictions=st.evictions, preemptions=c.preemptions, max_passes_observed=c.max_passes_observed,
                ttft_steps_p50=percentile(ttft, 50), ttft_steps_p99=percentile(ttft, 99))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--full", action="store_true", help="the full-size workload at --model shapes (GPU)")
    ap.add_argument("--model", choices=sorted(EXPERIMENT_MODELS), default=None,
                    help="default: qwen3-0.6b with --full, else tiny")
    ap.add_argument("--tiny-override", action="store_true", help="--full's code path at tiny sizes (CPU tests)")
    ap.add_argument("--host-only", action="store_true", help="scheduler + KV manager only, a stand-in model")
    for name, value in SIZES["full"].items():
        if not isinstance(value, tuple):
            ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny" if args.tiny_override or not args.full else "qwen3-0.6b")
    sizes = dict(SIZES["full" if args.full and not args.tiny_override else "tiny"])
    for name in sizes:
        if getattr(args, name, None) is not None:
            sizes[name] = getattr(args, name)
    args.sizes = sizes
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    s = args.sizes
    if args.host_only:
        raw = EXPERIMENT_MODELS[args.model]
        prompts = agent_prompts(s, raw["vocab_size"] if raw else 512)
        max_model_len = -(-(max(map(len, prompts)) + s["max_tokens"]) // s["block_size"]) * s["block_size"]
        sims = [simulate(s, policy, prompts, max_model_len) for policy in POLICIES]
        for r in sims:
            print(r)
        return {"args": vars(args), "host_only": sims}
    params = experiment_params(args.full, args.model)
    prompts = agent_prompts(s, params.config.vocab_size)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=s["max_tokens"])
    max_model_len = -(-(max(map(len, prompts)) + s["max_tokens"]) // s["block_size"]) * s["block_size"]
    results = [run(params, s, policy, prompts, sp, max_model_len) for policy in POLICIES]
    fcfs, aff = results
    aff["differ_from_fcfs"] = div = output_divergence(fcfs["output_token_ids"], aff["output_token_ids"])
    if outputs_guaranteed_identical(params.dtype, False):
        assert div["num_differ"] == 0, f"the scheduling policy changed outputs: {div}"
    row = dict(experiment="prefix_affinity", design_notes=DESIGN_NOTES, model=args.model,
               ours=f"hit rate {fcfs['prefix_hit_rate']:.1%} -> {aff['prefix_hit_rate']:.1%}, prefill tokens "
                    f"{fcfs['prefill_tokens']} -> {aff['prefill_tokens']}, {fcfs['output_tokens_per_second']:.0f} -> "
                    f"{aff['output_tokens_per_second']:.0f} tok/s, TTFT p99 {fcfs['ttft_p99_ms']:.0f} -> "
                    f"{aff['ttft_p99_ms']:.0f} ms (fcfs -> prefix_affinity)")
    report = {"device": str(jax.devices()[0]), "args": {k: v for k, v in vars(args).items()}, "model": args.model,
              "results": results, "design_notes_rows": [row]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefix_affinity.json"), "w") as f:
        json.dump(report, f)
    plot(results, args)
    print(f"{s['requests']} requests from {s['agents']} agents ({s['prefix_len'][0]}-{s['prefix_len'][1]}-token "
          f"system prompts), {s['arrivals_per_step']} arrivals/step, pool {s['num_blocks']} blocks of {s['block_size']}")
    print(f"{'policy':16s} {'hit rate':>8s} {'prefilled':>9s} {'evictions':>9s} {'preempt':>7s} {'steps':>5s} "
          f"{'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'max passed':>10s}")
    for r in results:
        print(f"{r['policy']:16s} {r['prefix_hit_rate']:8.1%} {r['prefill_tokens']:9d} {r['evictions']:9d} "
              f"{r['preemptions']:7d} {r['steps']:5d} {r['output_tokens_per_second']:8.0f} {r['ttft_p50_ms']:9.1f} "
              f"{r['ttft_p99_ms']:9.1f} {r['max_passes_observed']:10d}")
    print(f"greedy outputs differing between the policies: {div['num_differ']}/{div['num_requests']}"
          f"{'' if outputs_guaranteed_identical(params.dtype, False) else ' (bf16: not guaranteed, docs/NUMERICS.md)'}")
    print(f"[{row['experiment']}] design notes: {row['design_notes']}\n    ours ({row['model']}): {row['ours']}")
    return report


def plot(results: list[dict], args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in results:
        xs = sorted(r["ttft_ms"])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{r['policy']} (hit {r['prefix_hit_rate']:.0%})")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", xscale="log", title=f"agent workload, {args.model}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "prefix_affinity.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
