"""The probes Kubernetes and KServe send: liveness (``/health``, ``/v2/health/live``) answers 200 while the
engine runs, readiness (``/ready``, ``/v2/health/ready``) also turns 503 while the server drains for
shutdown; both are 503 once the engine stopped. The app in this process (FastAPI's test client)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from jaxpaged import LLM  # noqa: E402
from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.serve.api_server import build_app  # noqa: E402
from jaxpaged.serve.async_engine import AsyncEngine  # noqa: E402

LIVE, READY = ("/health", "/v2/health/live"), ("/ready", "/v2/health/ready")


@pytest.fixture(scope="module")
def app():
    llm = LLM(tiny_checkpoint_path("qwen3"), dtype="float32", max_model_len=64, num_blocks=16, warmup=False)
    return build_app(AsyncEngine.in_thread(llm), "tiny", api_key="secret")


def test_liveness_and_readiness_follow_the_engine_and_the_drain(app):
    engine = app.state.engine
    with TestClient(app) as client:
        assert [client.get(p).status_code for p in LIVE + READY] == [200] * 4  # (open: no API key needed)
        app.state.guard.draining = True  # what the first SIGTERM does (http_server.Server)
        assert [client.get(p).status_code for p in LIVE] == [200, 200]
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        app.state.guard.draining = False
        engine.error = RuntimeError("gone")  # what a dead engine process leaves
        for p in LIVE + READY:
            r = client.get(p)
            assert r.status_code == 503 and "the engine stopped: gone" in r.json()["error"]["message"]
        engine.error = None


def test_the_kubernetes_example_runs_this_command_line_and_probes_these_routes(app):
    """docs/kubernetes/jaxpaged.yaml is the manifest docs/kubernetes.md shows; its container's arguments are a
    ``jaxpaged serve`` command line this parser takes (the KV-events config included), and its probes and
    scrape path are routes of the app."""
    from pathlib import Path

    import yaml

    from jaxpaged.__main__ import build_parser

    root = Path(__file__).parents[2]
    manifest = (root / "docs/kubernetes/jaxpaged.yaml").read_text()
    assert manifest in (root / "docs/kubernetes.md").read_text()
    deployment, service = yaml.safe_load_all(manifest)
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    argv = [a.replace("$(POD_NAME)", "pod-0") for a in container["args"]]
    assert argv[:4] == ["python", "-m", "jaxpaged", "serve"]
    args = build_parser().parse_args(argv[3:])
    assert args.kv_events_config.enabled and args.kv_events_config.topic == "kv@pod-0@Qwen/Qwen3-0.6B"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port, "kv-events": int(args.kv_events_config.endpoint.rsplit(":", 1)[1])}
    routes = {r.path for r in app.routes}
    probes = [container[k]["httpGet"]["path"] for k in ("startupProbe", "livenessProbe", "readinessProbe")]
    assert probes == ["/health", "/health", "/ready"] and set(probes) <= routes
    assert pod["metadata"]["annotations"]["prometheus.io/path"] in routes
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
