"""Data-parallel replicas on Ray Serve: N replicas against one, through Ray Serve's HTTP proxy, on a workload of
many requests sharing a few system prompts; N replicas routed by prefix (``PrefixCacheRouter``, what
``jaxpaged serve --data-parallel-size N`` deploys) and routed round robin (the baseline a router must beat).

Workload (``workloads.agent_workload``, token ids so that random-weight models without a tokenizer run it):
``--prefixes`` system prompts of ``--prefix-len`` tokens; ``--num-requests`` requests, each a random one of them
followed by its own question of ``--question-len`` tokens; ``--output-len`` tokens out (greedy, ``ignore_eos``),
streamed from ``POST /v1/completions``, ``--concurrency`` requests in flight.

Runs, each a fresh application (empty caches: one run's prefixes never hit in the next), after a few warm-up
requests with prompts of their own: ``1`` (one replica), ``prefix`` (N replicas, prefix-aware), ``round-robin``
(N replicas, in turn). Per run: output tok/s, the share of prompt tokens served from the prefix caches
(``usage.prompt_tokens_details.cached_tokens``), TTFT p50 / p99 (client clock, HTTP and the proxy included),
requests per replica, and the speed-up over one replica.

``--model tiny`` (the default: the packaged tiny checkpoint, float32, a CPU sanity check; its numbers say nothing
about speed); a shapes name of ``workloads.EXPERIMENT_MODELS`` (``qwen3-0.6b``, ``qwen2.5-7b``) is that model with
random bf16 weights (``load_format="dummy"``), one GPU per replica, for a machine with N GPUs::

    python benchmarks/bench_replicas.py --model qwen3-0.6b --replicas 2 --out $OUT
    python benchmarks/bench_replicas.py --replicas 2 --out /tmp/replicas          # tiny, CPU

A local Ray cluster is started (or the one ``RAY_ADDRESS`` names; the random-weight model's folder is written
locally, so other nodes need a shared file system). Writes ``replicas.json`` (settings and rows) and
``replicas.md`` (the table) into ``--out``. Needs ``pip install -e '.[ray,bench]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import ray
from ray import serve
from ray.serve.request_router import RequestRouter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.serve.ray_serve import build  # noqa: E402
from jaxpaged.workloads import EXPERIMENT_MODELS, agent_workload  # noqa: E402

RUNS = ("1", "prefix", "round-robin")
# Per model: the workload's defaults (a GPU's for the full-size shapes; small and short for tiny on a CPU) and the
# engines' settings.
DEFAULTS = {
    "tiny": dict(num_requests=48, concurrency=8, prefixes=4, prefix_len=160, question_len=16, output_len=16),
    "full": dict(num_requests=512, concurrency=64, prefixes=8, prefix_len=1024, question_len=64, output_len=128),
}


class RoundRobinRouter(RequestRouter):
    """The baseline: replicas in turn, whatever the prompt."""

    def initialize_state(self, **_):
        self._next = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._next += 1
        return [[ordered[self._next % len(ordered)]]]


@dataclass
class Result:
    """One request as the client saw it."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    replica: str = ""
    error: str | None = None


async def send(session: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int) -> Result:
    """Streams one completion: its time to the first token, its usage, and the replica that served it."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    result, start = Result(), time.perf_counter()
    try:
        async with session.post(f"{base}/v1/completions", json=body) as response:
            result.replica = response.headers.get("x-jaxpaged-replica", "")
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            buffer = b""
            async for data in response.content.iter_any():
                *events, buffer = (buffer + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    if "error" in chunk:
                        result.error = str(chunk["error"].get("message"))[:300]
                    if not result.ttft and any(c.get("token_ids") for c in chunk.get("choices", [])):
                        result.ttft = time.perf_counter() - start
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        result.prompt_tokens = usage["prompt_tokens"]
                        result.output_tokens = usage["completion_tokens"]
                        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except aiohttp.ClientError as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_requests(base: str, prompts: list[list[int]], max_tokens: int,
                       concurrency: int) -> tuple[list[Result], float]:
    """All of ``prompts``, at most ``concurrency`` in flight; returns the results and the seconds it took."""
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def one(prompt):
            async with gate:
                return await send(session, base, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return results, time.perf_counter() - start


def summarise(run: str, replicas: int, results: list[Result], seconds: float) -> dict:
    """The table row of one run."""
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft for r in ok] or [0.0]) * 1e3
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r.replica] = per_replica.get(r.replica, 0) + 1
    output = sum(r.output_tokens for r in ok)
    return {"run": run, "replicas": replicas, "requests": len(ok), "failed": len(results) - len(ok),
            "seconds": round(seconds, 2), "output_tokens": output, "output_tok_per_s": round(output / seconds, 1),
            "cached_share": round(sum(r.cached_tokens for r in ok) / max(sum(r.prompt_tokens for r in ok), 1), 3),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1),
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
            "requests_per_replica": sorted(per_replica.values(), reverse=True),
            "errors": sorted({r.error for r in results if r.error})[:3]}


def llm_kwargs(model: str, work: Path) -> dict:
    """The replicas' ``LLM`` arguments: the tiny checkpoint (float32, compiled on first use: a CPU's), or a folder
    holding only ``config.json`` of a full-size shape, with random bf16 weights (warmed up at start: a GPU's)."""
    if model == "tiny":
        return dict(model=str(tiny_checkpoint_path("qwen3")), dtype="float32", max_model_len=1024, num_blocks=512,
                    block_size=16, max_num_seqs=16, max_num_batched_tokens=1024, warmup=False)
    if EXPERIMENT_MODELS.get(model) is None:
        raise SystemExit(f"--model must be one of {sorted(EXPERIMENT_MODELS)}, got {model!r}")
    folder = work / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(EXPERIMENT_MODELS[model]))
    return dict(model=str(folder), load_format="dummy", dtype="bfloat16", max_model_len=4096)


def deploy(kwargs: dict, replicas: int, router, name: str, cpu_only: bool) -> None:
    """``build``'s application under ``name`` at ``/``, running once this returns."""
    serve.run(build(kwargs, replicas, served_model_name="bench", request_router_class=router,
                    num_cpus=0 if cpu_only else 1), name=name, route_prefix="/")


def print_table(rows: list[dict]) -> str:
    cols = ["run", "replicas", "requests", "failed", "seconds", "output_tok_per_s", "speedup", "cached_share",
            "ttft_p50_ms", "ttft_p99_ms", "requests_per_replica"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in cols) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (CPU check) or a shapes name: "
                   + ", ".join(k for k, v in EXPERIMENT_MODELS.items() if v is not None))
    p.add_argument("--replicas", type=int, default=2, help="N: the replicas of the prefix and round-robin runs")
    p.add_argument("--runs", default=",".join(RUNS), help=f"a comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight")
    p.add_argument("--prefixes", type=int, default=None, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=None, help="tokens of each system prompt")
    p.add_argument("--question-len", type=int, default=None, help="tokens after the system prompt, per request")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    for key, value in DEFAULTS["tiny" if args.model == "tiny" else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("replicas", "num_requests", "concurrency", "prefixes", "prefix_len", "question_len", "output_len"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be a positive integer, got {getattr(args, key)}")
    args.runs = [r for r in args.runs.split(",") if r]
    if not args.runs or set(args.runs) - set(RUNS):
        raise SystemExit(f"--runs must name some of {RUNS}, got {args.runs}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="jaxpaged-replicas-"))
    kwargs = llm_kwargs(args.model, work)
    config = EXPERIMENT_MODELS.get(args.model) or json.loads((Path(kwargs["model"]) / "config.json").read_text())
    vocab = config["vocab_size"]
    if args.prefix_len + args.question_len + args.output_len > kwargs["max_model_len"]:
        raise SystemExit(f"--prefix-len + --question-len + --output-len must be at most {kwargs['max_model_len']}")
    prompts, _, _ = agent_workload(args.prefixes, (args.prefix_len, args.prefix_len),
                                   (args.question_len, args.question_len), args.num_requests, vocab, args.seed)
    if __name__ != "__main__":  # (imported: the baseline router travels to the ingress by value)
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    cpu_only = not ray.cluster_resources().get("GPU", 0)
    if not cpu_only and ray.cluster_resources()["GPU"] < args.replicas:
        raise SystemExit(f"--replicas {args.replicas} needs as many GPUs; the cluster has "
                         f"{ray.cluster_resources()['GPU']:g}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for run in (r for r in RUNS if r in args.runs):
            replicas = 1 if run == "1" else args.replicas
            name = f"replicas-{run}"
            t0 = time.perf_counter()
            deploy(kwargs, replicas, RoundRobinRouter if run == "round-robin" else None, name, cpu_only)
            started = time.perf_counter() - t0
            # Warm-up: requests shaped like the workload's, with prompts of their own (they hit nothing later).
            warm, _, _ = agent_workload(4 * replicas, (args.prefix_len, args.prefix_len),
                                        (args.question_len, args.question_len), 4 * replicas, vocab, args.seed + 1)
            asyncio.run(run_requests(base, warm, args.output_len, args.concurrency))
            results, seconds = asyncio.run(run_requests(base, prompts, args.output_len, args.concurrency))
            rows.append(dict(summarise(run, replicas, results, seconds), start_s=round(started, 1)))
            print(json.dumps(rows[-1]), flush=True)
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    one = next((r for r in rows if r["run"] == "1"), None)
    for row in rows:
        if one and one["output_tok_per_s"]:
            row["speedup"] = round(row["output_tok_per_s"] / one["output_tok_per_s"], 2)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    summary = {"settings": settings, "llm_kwargs": {k: v for k, v in kwargs.items() if k != "model"}, "rows": rows}
    (out / "replicas.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = print_table(rows)
    (out / "replicas.md").write_text(
        f"{args.replicas} replicas against 1, model {args.model}: {args.num_requests} requests over {args.prefixes} "
        f"system prompts of {args.prefix_len} tokens (+{args.question_len} tokens each, {args.output_len} out), "
        f"{args.concurrency} in flight\n\n{table}\n")
    return summary


if __name__ == "__main__":
    main()
