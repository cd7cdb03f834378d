"""The OpenAI-compatible server over the tiny checkpoint (CPU): a real server process talked to with the
official ``openai`` client and with raw HTTP, and the app in-process for the error cases."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "sk-test"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "16", "--num-blocks", "64",
               "--max-num-seqs", "16", "--max-num-batched-tokens", "32", "--served-model-name", "tiny",
               "--api-key", KEY]


@pytest.fixture(scope="module")
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "jaxpaged", "serve", "tiny", "--port", str(port), *SERVER_ARGS],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.5)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)


def headers(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_completions_stream_concatenates_to_the_whole_text(client):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert len(whole.choices[0].token_ids) == 12  # vLLM's return_token_ids (an extra field of the choice)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_reuses_the_conversation_prefix_and_streams(client):
    conv = [{"role": "system", "content": "You are a helpful assistant who answers in one short sentence. " * 3},
            {"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(model="tiny", messages=conv, max_tokens=8, temperature=0)
    reply = first.choices[0].message
    assert reply.role == "assistant" and first.usage.prompt_tokens > 32
    again = client.chat.completions.create(model="tiny", messages=conv + [
        {"role": "assistant", "content": reply.content}, {"role": "user", "content": "And three more."}],
        max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # the re-sent conversation hit the cache
    stream = client.chat.completions.create(model="tiny", messages=conv, max_tokens=8, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == reply.content


def test_several_prompts_stream_side_by_side(client):
    """A completions request with two prompts streams both as they are generated (interleaved chunks, each
    prompt's deltas concatenating to its own non-streamed text)."""
    kw = dict(model="tiny", prompt=["Once upon a time", "The quick brown fox"], max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    whole = {c.index: c.text for c in client.completions.create(**kw).choices}
    list(client.completions.create(**{**kw, "max_tokens": 2}, stream=True))  # the stream path's first use is slow
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    order = [c.index for c in chunks]
    assert {i: "".join(c.text for c in chunks if c.index == i) for i in (0, 1)} == whole
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # prompt 1 began before prompt 0 ended


def test_n_stop_and_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=1,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) == 6
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    text = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    start = next(i for i in range(2, len(text) - 1) if text[i:i + 2].strip())  # two characters, not blank
    stop = text[start:start + 2]
    cut = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and text.startswith(cut.text)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 3 for e in entries)


def test_models_health_and_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server}/health").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)}
    for name in ("jaxpaged:num_requests_running", "jaxpaged:num_requests_waiting", "jaxpaged:kv_blocks_used",
                 "jaxpaged:kv_blocks_cached", "jaxpaged:prefix_cache_queries", "jaxpaged:prefix_cache_hits",
                 "jaxpaged:num_preemptions", "jaxpaged:time_to_first_token_seconds",
                 "jaxpaged:e2e_request_latency_seconds"):
        assert name in families, sorted(families)
    assert families["jaxpaged:kv_blocks_used"].samples[0].value == 0  # nothing running, nothing leaked
    # vLLM's names for what means the same (routers that read vLLM's gauges read these): equal values
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "time_to_first_token_seconds", "e2e_request_latency_seconds"):
        ours, vllm = families[f"jaxpaged:{name}"], families[f"vllm:{name}"]
        assert [(s.name.split(":")[1], s.value) for s in ours.samples] == \
            [(s.name.split(":")[1], s.value) for s in vllm.samples], name
    assert "vllm:kv_blocks_cached" not in families  # no vLLM metric of that meaning


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "not valid JSON"),
    (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": "many"}), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "hi", "temperature": -1}), 400, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "x " * 400, "max_tokens": 4}), 400, "max_model_len"),
    (json.dumps({"model": "gpt-9", "prompt": "hi"}), 404, "gpt-9"),
])
def test_bad_requests_get_openai_errors(server, body, status, needle):
    r = httpx.post(f"{server}/v1/completions", content=body, headers={**headers(), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_api_key_is_required(server):
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=headers("wrong"))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/v1/models").status_code == 401


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    from jaxpaged.serve.api_server import MAX_BODY_BYTES

    r = httpx.post(f"{server}/v1/completions", content=b" " * (MAX_BODY_BYTES + 1),
                   headers={**headers(), "Content-Type": "application/json"})
    assert r.status_code == 413 and "more than the limit" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/health").status_code == 200


def test_concurrent_streams_with_disconnects(server):
    """64 streaming clients at once, 16 of them asking for 200 tokens and leaving after their first
    chunk: every other stream completes, the server still answers, the leavers' requests are aborted
    (not run to the end) and no KV block stays held."""
    import concurrent.futures

    def aborted():
        text = httpx.get(f"{server}/metrics").text
        return float(next(ln for ln in text.splitlines() if ln.startswith("jaxpaged:num_requests_aborted")).split()[-1])

    before = aborted()

    def one(i):
        body = {"model": "tiny", "prompt": f"Request {i} says", "max_tokens": 200 if i % 4 == 0 else 16,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers(), timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if i % 4 == 0:
                        return "left"
            return lines[-1]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert results.count("left") == 16 and all(r == "data: [DONE]" for r in results if r != "left")
    assert httpx.get(f"{server}/health").status_code == 200
    deadline = time.time() + 30
    while time.time() < deadline:
        text = httpx.get(f"{server}/metrics").text
        used = [ln for ln in text.splitlines() if ln.startswith("jaxpaged:kv_blocks_used")]
        running = [ln for ln in text.splitlines() if ln.startswith("jaxpaged:num_requests_running")]
        if used and used[0].endswith(" 0.0") and running[0].endswith(" 0.0"):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"blocks still held after every client finished or left: {used} {running}")
    assert aborted() - before == 16


def test_serving_benchmark_against_the_server(server):
    """``benchmarks/serving.py`` against a running server: every request streams its exact output length;
    the multi-turn conversations hit the prefix cache from their second turn on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_benchmark", os.path.join(ROOT, "benchmarks", "serving.py"))
    serving = sys.modules["serving_benchmark"] = importlib.util.module_from_spec(spec)  # (its dataclasses need it)
    spec.loader.exec_module(serving)
    rows = serving.main(["--base-url", server, "--api-key", KEY, "--num-prompts", "4", "--input-len", "24",
                         "--output-len", "4", "--request-rates", "4,inf", "--conversations", "2", "--turns", "3",
                         "--first-len", "40", "--turn-input-len", "8", "--turn-output-len", "4",
                         "--token-range", "500"])
    by_run = {r["run"]: r for r in rows}
    for name, requests in (("random rate=4", 4), ("random rate=inf", 4), ("multi-turn 2x3", 6)):
        row = by_run[name]
        assert row["requests"] == requests and row["failed"] == 0 and row["output_tokens"] == 4 * requests
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
    assert by_run["random rate=inf"]["cached_share"] == 0  # fresh prompts per run
    # Turns 2 and 3 re-send 48 and 64 tokens' worth of full blocks of history: at least 32 + 48 cached.
    assert by_run["multi-turn 2x3"]["cached_share"] >= 2 * (32 + 48) / (2 * (40 + 52 + 64))
