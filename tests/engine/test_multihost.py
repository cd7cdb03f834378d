"""One engine over several processes (``engine/multihost.py``): two ``jaxpaged serve`` processes of one CPU device
each (``jax.distributed``, gloo collectives) run one tensor-parallel engine, process 0 serving and the other
replaying its engine calls; the replay's checks in one process; the settings."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams, load_params
from jaxpaged.__main__ import engine_kwargs, parse_args
from jaxpaged.engine.multihost import AUTHKEY_ENV, MultiProcessEngine, initialize, state_fingerprint
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
# The engine both processes build: the leader's LLM(...) and the follower's command line must agree (the
# leader checks that they do).
FLAGS = ["--dtype", "float32", "--attention-backend", "reference", "--block-size", "8", "--num-blocks", "64",
         "--max-model-len", "128", "--tensor-parallel-size", "2", "--num-processes", "2"]

def free_port() -> int:
    """A port free now whose successor is free too (process 0 listens on both)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_two_processes_one_engine_behind_the_server():
    """``jaxpaged serve --process-id 0`` and ``--process-id 1`` (which serves nothing) hold one tensor-parallel
    engine split over their two CPU devices: the server's greedy tokens are transformers' (the one-device engine's,
    tests/engine/test_engine.py), through a stream its client left (an abort) and prefix-cache hits; a structured
    output is refused; on SIGTERM both processes end."""
    pytest.importorskip("fastapi")
    ref = np.load(FIXTURES / "hf_reference_qwen3.npz")
    prompts = [list(map(int, ref[f"prompt_{i}"])) for i in range(4)]
    want = [list(map(int, ref[f"greedy_{i}"])) for i in range(4)]
    coordinator, http_port = f"127.0.0.1:{free_port()}", free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXPAGED_DISTRIBUTED_AUTHKEY="test-secret-0123456789",
               XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f))
    procs = [subprocess.Popen([sys.executable, "-m", "jaxpaged", "serve", "tiny", *FLAGS, "--process-id", str(i),
                               "--coordinator-address", coordinator, "--port", str(http_port)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (1, 0)]
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert procs[1].poll() is None and time.monotonic() < deadline, procs[1].communicate()[0][-4000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(0.2)
        greedy = dict(model="tiny", max_tokens=24, temperature=0, ignore_eos=True, return_token_ids=True)
        status, first = post(url + "/v1/completions", dict(greedy, prompt=prompts))
        assert status == 200, first
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)  # a stream left after two events
        conn.request("POST", "/v1/completions", json.dumps(dict(greedy, prompt=prompts[2], stream=True)),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert sum(line.startswith(b"data:") for line in (stream.readline() for _ in range(4))) == 2
        conn.close()
        status, refused = post(url + "/v1/completions", dict(model="tiny", prompt="x", max_tokens=4,
                                                             response_format={"type": "json_object"}))
        assert status == 400 and "not supported with several processes" in refused["error"]["message"]
        status, again = post(url + "/v1/completions", dict(greedy, prompt=prompts[::-1]))
        assert status == 200, again
    finally:
        procs[1].send_signal(signal.SIGTERM)
        outs = []
        for proc in procs[::-1]:
            try:
                outs.append(proc.communicate(timeout=60)[0])
            finally:
                proc.kill()  # (SIGKILL: jax's preemption notifier catches SIGTERM)
    assert [c["token_ids"] for c in first["choices"]] == want
    assert [c["token_ids"] for c in again["choices"]] == want[::-1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert procs[1].returncode == -signal.SIGTERM, outs[0][-4000:]  # (drained, then the signal raised again)
    assert procs[0].returncode == 0 and "process 1 of 2, following process 0" in outs[1], outs[1][-4000:]


@pytest.fixture(scope="module")
def params():
    return load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)


def replicas(params) -> tuple[MultiProcessEngine, MultiProcessEngine]:
    config = EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=32, max_model_len=64,
                          attention_backend="reference", max_num_batched_tokens=32, max_num_seqs=4)
    to_follower, from_leader = multiprocessing.Pipe()
    return (MultiProcessEngine(LLMEngine(params, config), followers=[to_follower]),
            MultiProcessEngine(LLMEngine(params, config), leader=from_leader))


def test_follower_replays_the_leaders_calls_and_stops_where_it_diverged(params):
    """In one process (no jax.distributed; the follower reads the leader's calls after it made them): a follower
    ends in the leader's state, refuses calls of its own, and stops before the first replayed call after it was
    changed behind the leader's back."""
    leader, follower = replicas(params)
    with pytest.raises(RuntimeError, match="call follow"):
        follower.step()
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = run_to_completion(leader, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7]], sp)
    with pytest.raises(ValueError, match="prompt 0: .*outside the vocabulary"):  # refused on both, nothing changed
        leader.add_requests([[10**6]], sp)
    with pytest.raises(ValueError, match="structured_outputs"):
        leader.add_request([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])))
    leader.abort_request(leader.add_request([5, 6, 7], sp))
    leader.step()
    assert len(out) == 2 and all(len(o.outputs[0].token_ids) == 4 for o in out)
    want = state_fingerprint(leader.engine)
    assert want[0] > 0 and want[3] == 8  # steps run, tokens generated
    leader.close()  # (after its calls: the follower stops there)
    follower.follow()
    assert state_fingerprint(follower.engine) == want

    leader, follower = replicas(params)
    follower.engine.add_request([4, 4, 4], sp)  # behind the leader's back
    leader.add_request([4, 4, 4], sp)
    leader.close()
    with pytest.raises(RuntimeError, match=r"diverged from process 0 before add_request\(\)"):
        follower.follow()


def test_process_settings_bounded_and_named():
    for kwargs, field in [(dict(num_processes=0), "num_processes"), (dict(num_processes=True), "num_processes"),
                          (dict(num_processes=2, process_id=2, coordinator_address="h:1"), "process_id"),
                          (dict(num_processes=2), "coordinator_address"),
                          (dict(num_processes=2, coordinator_address="h"), "coordinator_address"),
                          (dict(num_processes=2, coordinator_address="h:65535"), "coordinator_address"),
                          (dict(coordinator_address="h:1"), "num_processes > 1"),
                          (dict(num_processes=2, coordinator_address="h:1", kv_offloading_size=1),
                           "kv_offloading_size")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)
    assert EngineConfig(num_processes=2, process_id=1, coordinator_address="10.0.0.1:1234").num_processes == 2


def test_several_processes_need_a_shared_secret(monkeypatch):
    """The processes' channel carries pickles: without a secret (or with a short one) several processes are
    refused before jax.distributed starts, naming the variable."""
    config = EngineConfig(num_processes=2, process_id=1, coordinator_address="127.0.0.1:1")
    for value in (None, "short"):
        if value is None:
            monkeypatch.delenv(AUTHKEY_ENV, raising=False)
        else:
            monkeypatch.setenv(AUTHKEY_ENV, value)
        with pytest.raises(ValueError, match=AUTHKEY_ENV):
            initialize(config)


def test_command_line_takes_process_settings_from_flags_or_environment(monkeypatch):
    kwargs = engine_kwargs(parse_args(["serve", "tiny", "--num-processes", "2", "--process-id", "1",
                                       "--coordinator-address", "h0:1234"]))
    assert (kwargs["num_processes"], kwargs["process_id"], kwargs["coordinator_address"]) == (2, 1, "h0:1234")
    for name, value in (("NUM_PROCESSES", "4"), ("PROCESS_ID", "3"), ("COORDINATOR_ADDRESS", "h1:99")):
        monkeypatch.setenv(f"JAXPAGED_{name}", value)
    kwargs = engine_kwargs(parse_args(["generate", "tiny", "--prompt", "x"]))
    assert (kwargs["num_processes"], kwargs["process_id"], kwargs["coordinator_address"]) == (4, 3, "h1:99")
    assert "num_processes" not in engine_kwargs(parse_args(["demo"]))
