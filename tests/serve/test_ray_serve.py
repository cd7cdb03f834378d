"""Data-parallel replicas on Ray Serve, on a local Ray cluster (one per module): two replicas of the tiny checkpoint
behind the ingress. Requests sharing a prefix land on the replica that cached it, so the prefix-cache hit rate beats
round robin's on the same workload; a replica killed mid-stream ends its streams with an error event, and Ray
replaces it."""

from __future__ import annotations

import concurrent.futures
import socket
import sys
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from ray.serve.request_router import RequestRouter  # noqa: E402

from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.serve.ray_serve import build  # noqa: E402

pytestmark = pytest.mark.slow  # (a Ray cluster and two engines)
LLM_KWARGS = dict(model=str(tiny_checkpoint_path("qwen3")), dtype="float32", max_model_len=512, num_blocks=128,
                  block_size=16, max_num_seqs=8, max_num_batched_tokens=512, warmup=False)
PREFIXES = [f"System {i}: " + " ".join(f"rule-{i}-{k} applies to every answer." for k in range(12)) for i in range(3)]


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


@pytest.fixture(scope="module")
def cluster():
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (the baseline router travels to the ingress)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Both applications at once (their four engines start side by side): prefix-aware at /, round robin at /rr.
    for name, prefix, router in (("jaxpaged", "/", None), ("rr", "/rr", RoundRobinRouter)):
        serve._run(build(LLM_KWARGS, 2, served_model_name="tiny", num_cpus=0, request_router_class=router,
                         health_check_period_s=1.0), _blocking=False, name=name, route_prefix=prefix)
    deadline = time.time() + 120
    while any(serve.status().applications.get(name) is None or serve.status().applications[name].status != "RUNNING"
              for name in ("jaxpaged", "rr")):
        assert time.time() < deadline, serve.status()
        time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def workload(base: str) -> tuple[float, dict[int, set[str]]]:
    """Four rounds over three shared prefixes, one request at a time: the prefix tokens served from the cache
    over all prompt tokens, and the replicas each prefix's requests went to."""
    cached = prompt = 0
    replicas: dict[int, set[str]] = {i: set() for i in range(len(PREFIXES))}
    with httpx.Client(timeout=60) as client:
        for k in range(4):
            for i, prefix in enumerate(PREFIXES):
                r = client.post(f"{base}/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": f"Question {k}?"}]})
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]
                replicas[i].add(r.headers["x-jaxpaged-replica"])
    return cached / prompt, replicas


def test_requests_sharing_a_prefix_go_where_it_is_cached_and_hit_more_than_round_robin(cluster):
    hit_rate, replicas = workload(cluster)
    assert all(len(r) == 1 for r in replicas.values()), replicas  # each prefix stayed on one replica
    rr_hit_rate, rr_replicas = workload(cluster + "/rr")
    assert all(len(r) == 2 for r in rr_replicas.values())  # round robin spread every prefix over both
    print(f"prefix-cache hit rate over 12 requests on 3 prefixes, 2 replicas: prefix-aware {hit_rate:.1%}, "
          f"round robin {rr_hit_rate:.1%}")
    assert hit_rate > rr_hit_rate + 0.1


def test_a_replica_killed_mid_stream_ends_its_streams_cleanly_and_is_replaced(cluster):
    body = {"model": "tiny", "prompt": PREFIXES[0], "max_tokens": 150, "ignore_eos": True, "temperature": 0,
            "stream": True}

    def stream(started: concurrent.futures.Future) -> tuple[str, list[str]]:
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{cluster}/v1/completions", json=body) as r:
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
        victim = started[0].result(timeout=60)
        started[1].result(timeout=60)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        results = [s.result(timeout=60) for s in streams]
    for replica, lines in results:
        if replica == victim:  # (its stream ends with the error event, then [DONE]: no hang, no truncated JSON)
            assert lines[-1] == "data: [DONE]" and "replica_failed" in lines[-2], lines[-3:]
        else:
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2].replace(" ", "")
    assert victim in {replica for replica, _ in results}
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
            r = client.post(f"{cluster}/v1/completions", json={"model": "tiny", "prompt": f"{i} fresh", "max_tokens": 1})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-jaxpaged-replica"])
    assert victim not in seen


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
    assert routing_text("/v1/completions", b"not json") == routing_text("/health", b"") == ""
    a, b = prefix_hashes("x" * 8 + "y" * 8, 4, 100), prefix_hashes("x" * 8 + "z" * 8, 4, 100)
    assert a[:2] == b[:2] and a[2] != b[2] and len(prefix_hashes("x" * 7, 4, 100)) == 1
    record = ReplicaPrefixes(capacity=4)
    record.add(a)
    assert record.match(b) == 2 and record.match(a) == 4
    record.add(b[2:])  # two more chunks: the two least recently added of ``a`` go
    assert record.match(a) == 0 and record.match(b) == 0  # (their first chunks were the oldest)
