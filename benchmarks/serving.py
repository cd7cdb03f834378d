"""The OpenAI-compatible server under load: request throughput, output tok/s, TTFT and ITL, cached-token share.

Two workloads, both sent as token ids to ``POST /v1/completions`` with ``stream: true`` (greedy,
``ignore_eos``, so every request generates exactly its output length):

* ``random``: vLLM's random dataset (``--input-len`` tokens in, ``--output-len`` out, fresh random ids per
  request), at each of ``--request-rates`` (Poisson arrivals; ``inf`` sends everything at once: the
  saturated server), optionally capped at ``--max-concurrency`` requests in flight;
* ``multi-turn`` (``--conversations``): conversations that grow turn by turn; each turn re-sends the
  whole history (its previous prompt, the reply's token ids from ``return_token_ids``, then
  ``--turn-input-len`` new tokens), so the prefix cache should serve all but the new tokens. The
  conversations run concurrently, each one turn at a time.

TTFT is the time to the first chunk carrying a token; ITL the gaps between later chunks (one token each
while the server keeps up; several when it fell behind and merged them); both from the client's clock,
HTTP included. The client is ``aiohttp`` (as vLLM's benchmark): ``httpx`` spent more CPU per chunk than the
server on the same machine and became the bottleneck.

Against a server already running (as ``vllm bench serve`` is used)::

    python -m jaxpaged serve MODEL --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000

Or in one command, which also measures offline ``LLM.generate`` on the same random requests first (in its
own process, so both see the whole GPU) and then starts the server (``--launch``; arguments after ``--``
go to ``jaxpaged serve``). A name of ``workloads.EXPERIMENT_MODELS`` (e.g. ``qwen3-0.6b``) means that
model's shapes with random weights (``--load-format dummy``)::

    python benchmarks/serving.py --launch qwen3-0.6b --offline --request-rates 8,16,32,inf --conversations 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RequestResult:
    """One request as the client saw it."""

    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds to the first token
    itls: list[float] = field(default_factory=list)  # seconds between later chunks
    latency: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None


async def send(session: aiohttp.ClientSession, base_url: str, model: str, prompt: list[int], max_tokens: int,
               headers: dict) -> RequestResult:
    """Streams one completion; times its chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    result = RequestResult(len(prompt))
    start = last = time.perf_counter()
    try:
        async with session.post(f"{base_url}/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            buffer = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *events, buffer = (buffer + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    chunk = json.loads(event[6:])
                    if chunk.get("usage"):
                        result.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                    for choice in chunk["choices"]:
                        ids = choice.get("token_ids") or []
                        if not ids:
                            continue
                        if not result.token_ids:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
                        result.token_ids.extend(ids)
    except aiohttp.ClientError as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = len(result.token_ids)
    return result


def client() -> aiohttp.ClientSession:
    """One session for a run: unlimited connections, no timeout."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


def summarise(name: str, results: list[RequestResult], seconds: float) -> dict:
    """The table row of one run."""
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft for r in ok]) * 1e3
    itl = np.array([x for r in ok for x in r.itls] or [0.0]) * 1e3
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return {"run": name, "requests": len(ok), "failed": len(results) - len(ok), "seconds": round(seconds, 2),
            "output_tokens": output, "req_per_s": round(len(ok) / seconds, 2),
            "output_tok_per_s": round(output / seconds, 1),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1) if ok else None,
            "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1) if ok else None,
            "itl_p50_ms": round(float(np.percentile(itl, 50)), 2), "itl_p99_ms": round(float(np.percentile(itl, 99)), 2),
            "cached_share": round(sum(r.cached_tokens for r in ok) / max(prompt, 1), 3),
            "errors": sorted({r.error for r in results if r.error})[:3]}


def warm_requests(args: argparse.Namespace) -> list[list[int]]:
    """Eight short requests sent before anything is timed (their own prompts: nothing later hits them)."""
    return random_requests(8, min(args.input_len, 64), args.token_range, args.seed + 1)


def random_requests(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """vLLM's random dataset: ``n`` prompts of ``input_len`` random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]


async def run_random(base_url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                     max_concurrency: int | None, headers: dict, seed: int) -> tuple[list[RequestResult], float]:
    """Sends ``prompts`` with Poisson arrivals at ``rate`` per second (``inf``: all at once)."""
    rng = np.random.default_rng(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with client() as session:
        async def one(prompt):
            if gate is None:
                return await send(session, base_url, model, prompt, output_len, headers)
            async with gate:
                return await send(session, base_url, model, prompt, output_len, headers)

        start, tasks = time.perf_counter(), []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def run_multi_turn(base_url: str, model: str, conversations: int, turns: int, first_len: int, turn_len: int,
                         output_len: int, vocab: int, headers: dict, seed: int) -> tuple[list[RequestResult], float]:
    """``conversations`` chats of ``turns`` turns at once; each turn re-sends the history plus new tokens."""
    rng = random.Random(seed)
    async with client() as session:
        async def chat(first: list[int], user_turns: list[list[int]]) -> list[RequestResult]:
            history, out = first, []
            for t in range(turns):
                r = await send(session, base_url, model, history, output_len, headers)
                out.append(r)
                if r.error is not None:
                    break
                if t + 1 < turns:
                    history = history + r.token_ids + user_turns[t]
            return out

        chats = [([rng.randrange(vocab) for _ in range(first_len)],
                  [[rng.randrange(vocab) for _ in range(turn_len)] for _ in range(turns - 1)])
                 for _ in range(conversations)]
        start = time.perf_counter()
        done = await asyncio.gather(*(chat(f, u) for f, u in chats))
        return [r for c in done for r in c], time.perf_counter() - start


# ---- launching: a model folder, the offline reference and the server ----------------------------------
def model_folder(model: str, work: Path) -> tuple[str, list[str]]:
    """(folder, extra ``serve`` arguments): a checkpoint folder as given, ``tiny`` as is, or a shapes name of
    ``EXPERIMENT_MODELS`` as a folder holding only its ``config.json`` (random weights: ``--load-format dummy``)."""
    from jaxpaged.workloads import EXPERIMENT_MODELS

    if model in EXPERIMENT_MODELS and EXPERIMENT_MODELS[model] is not None:
        folder = work / model
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(EXPERIMENT_MODELS[model]))
        return str(folder), ["--load-format", "dummy"]
    return model, []


def offline(args: argparse.Namespace) -> None:
    """``LLM.generate`` over the random workload's requests (this process owns the GPU); prints one JSON line."""
    from jaxpaged import LLM, SamplingParams

    config = json.loads(args.offline_config)
    llm = LLM(config.pop("model"), **config)
    prompts = random_requests(args.num_prompts, args.input_len, args.token_range, args.seed)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(warm_requests(args), sp, use_tqdm=False)  # the first requests after warm-up, as the server's
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("OFFLINE " + json.dumps({"run": "offline LLM.generate", "requests": len(outs), "seconds": round(seconds, 2),
                                   "req_per_s": round(len(outs) / seconds, 2),
                                   "output_tok_per_s": round(tokens / seconds, 1)}), flush=True)
    # The engine's side of streaming alone: the same number of requests (fresh prompts: no cache hits)
    # stepped with DELTA outputs, each step's outputs packed and pickled as the engine process sends them.
    from jaxpaged.sampling import RequestOutputKind
    from jaxpaged.serve.async_engine import _pack

    delta = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                           output_kind=RequestOutputKind.DELTA)
    engine, tokens, pickled = llm.engine, 0, 0.0
    start = time.perf_counter()
    for prompt in random_requests(args.num_prompts, args.input_len, args.token_range, args.seed + 7):
        engine.add_request(prompt, delta)
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        pickle.dumps([_pack(o) for o in outs])
        pickled += time.perf_counter() - t
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
    seconds = time.perf_counter() - start
    print("OFFLINE " + json.dumps({"run": "offline engine, DELTA outputs packed", "requests": args.num_prompts,
                                   "seconds": round(seconds, 2), "req_per_s": round(args.num_prompts / seconds, 2),
                                   "output_tok_per_s": round(tokens / seconds, 1),
                                   "pickle_seconds": round(pickled, 3)}), flush=True)


def serve_config(model: str, serve_args: list[str]) -> dict:
    """The ``LLM`` keyword arguments equal to ``jaxpaged serve MODEL SERVE_ARGS`` (for the offline run)."""
    from jaxpaged.__main__ import build_parser, serve_llm_args

    return serve_llm_args(build_parser().parse_args(["serve", model, *serve_args]))


def launch(model: str, serve_args: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """Starts ``python -m jaxpaged serve`` on a free port; returns it and its URL once ``/health`` answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxpaged", "serve", model, "--port", str(port), *serve_args],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); its log: {log_path}\n"
                             + log_path.read_text()[-3000:])
        time.sleep(0.5)


def print_table(rows: list[dict]) -> None:
    cols = ["run", "requests", "seconds", "req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p99_ms", "cached_share"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server (default: --launch one)")
    p.add_argument("--launch", default=None, metavar="MODEL", help="start `jaxpaged serve MODEL` (a folder, "
                   "'tiny', or a shapes name such as qwen3-0.6b for random weights); args after -- go to serve")
    p.add_argument("--offline", action="store_true", help="with --launch: LLM.generate on the same random "
                   "requests first, in its own process")
    p.add_argument("--model", default=None, help="the served model name (default: the server's only model)")
    p.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=1000, help="requests per rate (vLLM benchmark_serving's default)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rates", default="inf", help="comma-separated requests/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--conversations", type=int, default=0, help="multi-turn: concurrent conversations (0: skip)")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-len", type=int, default=512, help="multi-turn: tokens of the first message")
    p.add_argument("--turn-input-len", type=int, default=128, help="multi-turn: new tokens per later turn")
    p.add_argument("--turn-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-range", type=int, default=10000,
                   help="prompt ids are drawn from [0, this) (nano-vllm's 10000; at most the vocabulary)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--offline-config", default=None, help=argparse.SUPPRESS)  # the offline child's LLM arguments
    return p.parse_args(argv), serve_args


def main(argv: list[str] | None = None) -> list[dict]:
    args, serve_args = parse_args(argv)
    rates = [float(r) for r in args.request_rates.split(",") if r]
    if args.offline and float("inf") not in rates:
        raise SystemExit("--offline compares with the saturated server: include inf in --request-rates")
    if args.offline_config is not None:
        offline(args)
        return []
    rows: list[dict] = []
    proc = None
    work = Path(tempfile.mkdtemp(prefix="jaxpaged-serving-"))
    try:
        if args.base_url is None:
            if args.launch is None:
                raise SystemExit("give --base-url of a running server or --launch MODEL")
            folder, extra = model_folder(args.launch, work)
            serve_args = extra + serve_args
            vocab_size = json.loads((Path(serve_config(folder, serve_args)["model"]) / "config.json").read_text())["vocab_size"]
            args.token_range = min(args.token_range, vocab_size)
            if args.offline:
                child = subprocess.run(
                    [sys.executable, __file__, "--offline-config", json.dumps(serve_config(folder, serve_args)),
                     "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                     "--output-len", str(args.output_len), "--seed", str(args.seed),
                     "--token-range", str(args.token_range)],
                    cwd=ROOT, capture_output=True, text=True)
                lines = [x for x in child.stdout.splitlines() if x.startswith("OFFLINE ")]
                if child.returncode != 0 or not lines:
                    raise SystemExit(f"the offline run failed:\n{child.stdout[-2000:]}\n{child.stderr[-3000:]}")
                for line in lines:
                    rows.append(json.loads(line[len("OFFLINE "):]))
                    print(rows[-1], flush=True)
            proc, args.base_url = launch(folder, serve_args, work / "server.log")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        info = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=10).json()["data"][0]
        model = args.model or info["id"]
        vocab = args.token_range
        # A few requests first: the first requests after start-up are not the server's steady state.
        asyncio.run(run_random(args.base_url, model, warm_requests(args), args.output_len, float("inf"), None,
                               headers, args.seed))
        for i, rate in enumerate(rates):
            # Fresh prompts for every rate (no run hits another's cache); the saturated run's are the
            # offline run's.
            seed = args.seed if rate == float("inf") else args.seed + 1000 * (i + 1)
            prompts = random_requests(args.num_prompts, args.input_len, vocab, seed)
            results, seconds = asyncio.run(run_random(args.base_url, model, prompts, args.output_len, rate,
                                                      args.max_concurrency, headers, seed))
            rows.append(summarise(f"random rate={rate:g}", results, seconds))
            print(rows[-1], flush=True)
        if args.conversations:
            results, seconds = asyncio.run(run_multi_turn(
                args.base_url, model, args.conversations, args.turns, args.first_len, args.turn_input_len,
                args.turn_output_len, vocab, headers, args.seed + 2))
            rows.append(summarise(f"multi-turn {args.conversations}x{args.turns}", results, seconds))
            print(rows[-1], flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
