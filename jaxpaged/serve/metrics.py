"""``/metrics``: the engine's state and counters in Prometheus' text format, vLLM's metric names under a
``jaxpaged:`` prefix, and those with a vLLM meaning under ``vllm:`` too (``VLLM_NAMES``), so routers that read a vLLM
server's gauges (the Gateway API inference extension's endpoint picker, llm-d, KServe) read jaxpaged's.

Gauges and counters are read from ``LLMEngine.stats()`` when scraped (a snapshot the engine thread takes,
``AsyncEngine.snapshot``: nothing is kept twice); the latency histograms are observed as requests finish.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..io.outputs import RequestOutput

# jaxpaged's metrics that mean what a vLLM server's of the same name mean (vLLM v1's names; Prometheus adds
# "_total" to counters in the text format, as vLLM's exporter does).
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
              "prefix_cache_hits", "num_preemptions", "time_to_first_token_seconds", "e2e_request_latency_seconds",
              "time_per_output_token_seconds")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """The engine's gauges and counters from the snapshot ``render`` took (``AsyncEngine.snapshot``)."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.snapshot: tuple[int, int, dict] | None = None

    def collect(self):
        if self.snapshot is None:
            return
        running, waiting, s = self.snapshot
        label = list(self.labels)
        values = list(self.labels.values())

        def families(kind, name, doc, value):
            for prefix in ("jaxpaged", "vllm") if name in VLLM_NAMES else ("jaxpaged",):
                family = kind(f"{prefix}:{name}", doc, labels=label)
                family.add_metric(values, value)
                yield family

        def gauge(name, doc, value):
            return families(GaugeMetricFamily, name, doc, value)

        def counter(name, doc, value):
            return families(CounterMetricFamily, name, doc, value)

        yield from gauge("num_requests_running", "Requests with sequences in the running batch.", running)
        yield from gauge("num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield from gauge("kv_blocks_used", "KV blocks referenced by running sequences.", s["blocks_used"])
        yield from gauge("kv_blocks_cached", "Unreferenced KV blocks holding a cached prefix.", s["blocks_cached"])
        yield from gauge("kv_blocks_total", "KV blocks in the pool.", s["num_blocks"])
        yield from gauge("kv_cache_usage_perc", "Share of the pool's blocks in use (0-1).", s["blocks_used"] / s["num_blocks"])
        yield from counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_query_tokens"])
        yield from counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s["prefix_hit_tokens"])
        yield from counter("num_preemptions", "Sequences preempted for lack of KV blocks.", s["preemptions"])
        if s.get("host_blocks"):  # the host tier (kv_offloading_size)
            yield from gauge("kv_host_blocks_used", "Host-tier blocks holding an evicted cached prefix.", s["host_blocks_used"])
            yield from gauge("kv_host_blocks_total", "Blocks in the host tier.", s["host_blocks"])
            yield from counter("prefix_cache_host_hits", "Prompt tokens served from the host tier (reloaded).",
                          s["host_hit_tokens"])
            yield from counter("kv_offloaded_bytes", "Bytes copied from the device pool to the host tier.", s["offload_bytes"])
            yield from counter("kv_reloaded_bytes", "Bytes copied from the host tier back to the device pool.",
                          s["reload_bytes"])


class _Twins:
    """Histograms observed together (one metric under two names)."""

    def __init__(self, histograms):
        self.histograms = histograms

    def observe(self, value: float) -> None:
        for h in self.histograms:
            h.observe(value)


class ServerMetrics:
    """The server's registry: the engine collector plus TTFT, time per output token and e2e histograms."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.engine_collector = _EngineCollector(model_name)
        self.registry.register(self.engine_collector)
        labels = ["model_name"]

        def histogram(name, doc):
            """The histogram under ``jaxpaged:`` and, where vLLM has it, ``vllm:`` (``_Twins`` observes both)."""
            return _Twins([Histogram(f"{prefix}:{name}", doc, labels, buckets=LATENCY_BUCKETS,
                                     registry=self.registry).labels(model_name)
                           for prefix in (("jaxpaged", "vllm") if name in VLLM_NAMES else ("jaxpaged",))])

        self.ttft = histogram("time_to_first_token_seconds", "Time to the first output token.")
        self.tpot = histogram("time_per_output_token_seconds", "Mean time between output tokens of a finished request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.aborted = Counter("jaxpaged:num_requests_aborted", "Requests withdrawn before they finished "
                               "(a client that went away).", labels, registry=self.registry).labels(model_name)

    def observe(self, outs: list[RequestOutput], tokens_per_request: list[int] | None = None) -> None:
        """Records finished requests' latencies (``tokens_per_request``: the most tokens any sample of
        each made, where ``outs`` are a stream's last deltas)."""
        for i, out in enumerate(outs):
            m = out.metrics
            if m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
                tokens = (tokens_per_request[i] if tokens_per_request is not None
                          else max(len(c.token_ids) for c in out.outputs))
                if m.first_token_time is not None and tokens > 1:
                    self.tpot.observe((m.finished_time - m.first_token_time) / (tokens - 1))

    def render(self, snapshot: tuple[int, int, dict]) -> tuple[str, str]:
        """The metrics text (and its content type) with the engine's state from ``snapshot``."""
        self.engine_collector.snapshot = snapshot
        return generate_latest(self.registry).decode(), CONTENT_TYPE_LATEST
