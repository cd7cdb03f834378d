"""Data-parallel replicas on Ray Serve, on a local Ray cluster: two replicas of the tiny checkpoint behind the
ingress. Requests sharing a prefix land on the replica that cached it, so the prefix-cache hit rate beats round
robin's on the same workload; a replica killed mid-stream ends its streams with an error event, and Ray replaces it.

Ray's start and each engine process cost seconds of a 2-core machine, so one application (two engines) serves
every check, in one test: the router routes by prefix (``PrefixCacheRouter`` itself) unless a request asks for
round robin with a header, and the round-robin workload uses system prompts of its own, so neither run finds the
other's prefixes in the engines' caches. (One test, not several over a module's cluster: pytest-xdist may run a
module's tests in different workers, each of which would start a cluster.)"""

from __future__ import annotations

import concurrent.futures
import socket
import sys
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.serve.prefix_router import PrefixCacheRouter  # noqa: E402
from jaxpaged.serve.ray_serve import build  # noqa: E402

LLM_KWARGS = dict(model=str(tiny_checkpoint_path("qwen3")), dtype="float32", max_model_len=512, num_blocks=128,
                  block_size=16, max_num_seqs=8, max_num_batched_tokens=512, warmup=False)
SYSTEM_PROMPTS = [f"System {i}: " + " ".join(f"rule-{i}-{k} applies to every answer." for k in range(6))
                  for i in range(6)]
PREFIX_ROUTED, ROUND_ROBIN = SYSTEM_PROMPTS[:3], SYSTEM_PROMPTS[3:]  # (the same lengths, distinct texts)
ROUTING_HEADER = "x-test-routing"


class PrefixOrRoundRobinRouter(PrefixCacheRouter):
    """``PrefixCacheRouter``, except for requests with ``x-test-routing: round-robin``: replicas in turn, whatever
    the prompt (the baseline)."""

    def initialize_state(self, **kwargs):
        super().initialize_state(**kwargs)
        self._next = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        headers = dict(getattr(request, "headers", []))  # (the ForwardedRequest's raw HTTP headers)
        if headers.get(ROUTING_HEADER.encode()) != b"round-robin" or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._next += 1
        return [[ordered[self._next % len(ordered)]]]


@pytest.fixture
def cluster(monkeypatch):
    """A local Ray cluster of its own (``"local"``: never one that ``RAY_ADDRESS`` or an earlier ``ray start``
    names) with the application at ``/``: its proxy's URL once both replicas run. Started lean for a 2-core
    machine: no dashboard, no usage reporting, a small object store (requests and responses are small)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (the router travels to the ingress)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 ** 2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve._run(build(LLM_KWARGS, 2, served_model_name="tiny", num_cpus=0,
                         request_router_class=PrefixOrRoundRobinRouter, health_check_period_s=1.0),
                   _blocking=False, name="jaxpaged", route_prefix="/")
        deadline = time.time() + 120
        while (app := serve.status().applications.get("jaxpaged")) is None or app.status != "RUNNING":
            assert time.time() < deadline, serve.status()
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()  # (every process of the local cluster ends with it: serve.shutdown's drain is not needed)


def workload(base: str, prefixes: list[str], routing: str) -> tuple[float, dict[int, set[str]]]:
    """Four rounds over three shared prefixes, one request at a time: the prefix tokens served from the cache
    over all prompt tokens, and the replicas each prefix's requests went to."""
    cached = prompt = 0
    replicas: dict[int, set[str]] = {i: set() for i in range(len(prefixes))}
    with httpx.Client(timeout=60, headers={ROUTING_HEADER: routing}) as client:
        for k in range(4):
            for i, prefix in enumerate(prefixes):
                r = client.post(f"{base}/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": f"Question {k}?"}]})
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]
                replicas[i].add(r.headers["x-jaxpaged-replica"])
    return cached / prompt, replicas


def requests_sharing_a_prefix_go_where_it_is_cached_and_hit_more_than_round_robin(base: str) -> None:
    hit_rate, replicas = workload(base, PREFIX_ROUTED, "prefix")
    assert all(len(r) == 1 for r in replicas.values()), replicas  # each prefix stayed on one replica
    rr_hit_rate, rr_replicas = workload(base, ROUND_ROBIN, "round-robin")
    assert all(len(r) == 2 for r in rr_replicas.values())  # round robin spread every prefix over both
    print(f"prefix-cache hit rate over 12 requests on 3 prefixes, 2 replicas: prefix-aware {hit_rate:.1%}, "
          f"round robin {rr_hit_rate:.1%}")
    assert hit_rate > rr_hit_rate + 0.1


def a_replica_killed_mid_stream_ends_its_streams_cleanly_and_is_replaced(base: str) -> None:
    body = {"model": "tiny", "prompt": PREFIX_ROUTED[0], "max_tokens": 150, "ignore_eos": True, "temperature": 0,
            "stream": True}

    def stream(started: concurrent.futures.Future) -> tuple[str, list[str]]:
        with (httpx.Client(timeout=60, headers={ROUTING_HEADER: "round-robin"}) as client,  # (one per replica)
              client.stream("POST", f"{base}/v1/completions", json=body) as r):
            if r.status_code != 200:
                started.set_exception(AssertionError(f"{r.status_code}: {r.read()}"))
                return "", []
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if not started.done():
                        started.set_result(r.headers["x-jaxpaged-replica"])
            return r.headers["x-jaxpaged-replica"], lines

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = [concurrent.futures.Future() for _ in range(2)]
        streams = [pool.submit(stream, f) for f in started]
        victim = started[0].result(timeout=60)  # (the first stream's replica)
        started[1].result(timeout=60)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        results = [s.result(timeout=60) for s in streams]
    for replica, lines in results:
        if replica == victim:  # (its stream ends with the error event, then [DONE]: no hang, no truncated JSON)
            assert lines[-1] == "data: [DONE]" and "replica_failed" in lines[-2], lines[-3:]
        else:
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2].replace(" ", "")
    other = started[1].result()
    assert other != victim and {replica for replica, _ in results} == {victim, other}  # (a stream on each)
    deadline = time.time() + 60
    while True:  # Ray replaces the dead replica; a request then succeeds on the new one
        status = serve.status().applications["jaxpaged"].deployments["JaxpagedReplica"]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        assert time.time() < deadline, status
        time.sleep(0.5)
    seen = set()
    with httpx.Client(timeout=60) as client:
        for i in range(4):
            r = client.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": f"{i} fresh", "max_tokens": 1})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-jaxpaged-replica"])
    assert victim not in seen


@pytest.mark.slow  # (a Ray cluster and two engines: more than ~20 s on 2 cores)
def test_two_replicas_route_by_prefix_and_survive_one_killed_mid_stream(cluster):
    """The routing first (the kill changes the replicas)."""
    requests_sharing_a_prefix_go_where_it_is_cached_and_hit_more_than_round_robin(cluster)
    a_replica_killed_mid_stream_ends_its_streams_cleanly_and_is_replaced(cluster)


def test_the_routing_text_and_the_replicas_prefix_record():
    """What the router matches: the prompt, or the chat messages in order; a record's match is its leading
    chunks, and it forgets the least recently routed ones past its capacity."""
    import json

    from jaxpaged.serve.prefix_router import ReplicaPrefixes, prefix_hashes
    from jaxpaged.serve.ray_serve import routing_text

    chat = json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user",
                                                                         "content": [{"type": "text", "text": "Q"}]}]})
    assert routing_text("/v1/chat/completions", chat.encode()) == "system:S\nuser:Q\n"
    assert routing_text("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert routing_text("/v1/completions", b'{"prompt": [7, 8, 9]}') == "7 8 9"  # token ids
    assert routing_text("/v1/completions", b'{"prompt": [[7, 8], [9]]}') == "7 8"
    assert routing_text("/v1/completions", b"not json") == routing_text("/health", b"") == ""
    a, b = prefix_hashes("x" * 8 + "y" * 8, 4, 100), prefix_hashes("x" * 8 + "z" * 8, 4, 100)
    assert a[:2] == b[:2] and a[2] != b[2] and len(prefix_hashes("x" * 7, 4, 100)) == 1
    record = ReplicaPrefixes(capacity=4)
    record.add(a)
    assert record.match(b) == 2 and record.match(a) == 4
    record.add(b[2:])  # two more chunks: the two least recently added of ``a`` go
    assert record.match(a) == 0 and record.match(b) == 0  # (their first chunks were the oldest)
