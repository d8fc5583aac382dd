"""Prometheus metrics of ``looplm serve`` (``GET /metrics``), in a registry of each app's own.

Two sources, one registry (a :class:`prometheus_client.CollectorRegistry` per :class:`ServerMetrics`, never
the process-global one, so that a test process can build many apps):

* the engine's own counts, read from :meth:`Engine.stats` at every scrape (:class:`_EngineCollector`):
  requests running and waiting, the KV budget used, prompt and generated tokens, exits by depth;
* what the server measures per request: time to first token, inter-token latency, the loops each generated
  token ran, request durations and outcomes.

=========================================  =========  ===================================================
metric                                     type       what
=========================================  =========  ===================================================
``looplm_requests_running``                gauge      engine requests in a batch row (prefilling or decoding)
``looplm_requests_waiting``                gauge      engine requests queued for a row
``looplm_max_batch``                       gauge      rows decoded at once
``looplm_kv_tokens_used`` / ``_capacity``  gauge      cache tokens in use / allocated (a token position holds
                                                      ``looplm_kv_slots`` of them: its loop slots per layer)
``looplm_kv_budget_tokens``                gauge      cache tokens requests may hold (``--kv-budget``)
``looplm_kv_bytes_used`` / ``_capacity``   gauge      the same in bytes (and ``looplm_kv_budget_bytes``)
``looplm_kv_usage_ratio``                  gauge      tokens used / budget (0..1): the KV budget used
``looplm_preemptions_total``               counter    requests preempted (their rows freed; recomputed later)
``looplm_prompt_tokens_total``             counter    prompt tokens prefilled
``looplm_generation_tokens_total``         counter    tokens generated
``looplm_exits_total{loops="r"}``          counter    generated tokens that ran r loops (r = 1..K)
``looplm_token_loops``                     histogram  loops per generated token, as the server saw them
``looplm_time_to_first_token_seconds``     histogram  request arrival to its first token
``looplm_inter_token_latency_seconds``     histogram  between a request's successive tokens
``looplm_request_duration_seconds``        histogram  request arrival to its last event
``looplm_requests_total{endpoint,outcome}``  counter  HTTP requests: ok, bad_request, rejected, timeout, ...
``looplm_choices_finished_total{reason}``  counter    engine requests by finish reason (stop, length, abort, error)
``looplm_model_info{model}``               gauge      1, labelled with the served model's name
=========================================  =========  ===================================================

An engine request is one choice: a request with ``n=4`` counts as four in ``running`` / ``waiting``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """Reads :meth:`Engine.stats` at each scrape: the engine's gauges and its running totals."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):  # no scrape at registration
        return []

    def collect(self):
        s = self.engine.stats()
        for name, key, doc in (
            ("looplm_requests_running", "running", "engine requests in a batch row"),
            ("looplm_requests_waiting", "waiting", "engine requests queued for a row"),
            ("looplm_max_batch", "max_batch", "rows decoded at once"),
            ("looplm_kv_slots", "kv_slots", "loop slots a token keeps per layer (its cache tokens)"),
            ("looplm_kv_tokens_used", "kv_tokens_used", "KV cache tokens in use"),
            ("looplm_kv_tokens_capacity", "kv_tokens_capacity", "KV cache tokens allocated"),
            ("looplm_kv_budget_tokens", "kv_budget_tokens", "KV cache tokens requests may hold"),
            ("looplm_kv_bytes_used", "kv_bytes_used", "KV-cache bytes in use"),
            ("looplm_kv_bytes_capacity", "kv_bytes_capacity", "KV-cache bytes allocated"),
            ("looplm_kv_budget_bytes", "kv_budget_bytes", "KV-cache bytes requests may hold"),
        ):
            if key in s and s[key] is not None:
                yield GaugeMetricFamily(name, doc, value=float(s[key]))
        cap = s.get("kv_budget_tokens") or s.get("kv_tokens_capacity") or 0
        yield GaugeMetricFamily(
            "looplm_kv_usage_ratio",
            "KV cache tokens used / budget (the KV budget used)",
            value=float(s.get("kv_tokens_used", 0)) / cap if cap else 0.0,
        )
        yield CounterMetricFamily(
            "looplm_preemptions", "requests preempted (recomputed later)", value=float(s.get("preempted", 0))
        )
        yield CounterMetricFamily(
            "looplm_prompt_tokens", "prompt tokens prefilled", value=float(s.get("prompt_tokens_total", 0))
        )
        yield CounterMetricFamily(
            "looplm_generation_tokens", "tokens generated", value=float(s.get("generation_tokens_total", 0))
        )
        exits = CounterMetricFamily("looplm_exits", "generated tokens by the loops they ran", labels=["loops"])
        for i, count in enumerate(s.get("exits_by_depth") or []):
            exits.add_metric([str(i + 1)], float(count))
        yield exits
        done = CounterMetricFamily(
            "looplm_choices_finished", "engine requests (choices) by finish reason", labels=["reason"]
        )
        for reason, count in sorted((s.get("finished_by_reason") or {}).items()):
            done.add_metric([reason], float(count))
        yield done


class ServerMetrics:
    """The metrics of one app: ``registry`` (its own), the server-side histograms, :meth:`render`."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine))
        K = int(getattr(engine, "K", 0) or 0)
        loop_buckets = tuple(float(r) for r in range(1, max(K, 1) + 1))
        r = self.registry
        self.ttft = Histogram(
            "looplm_time_to_first_token_seconds",
            "request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "looplm_inter_token_latency_seconds",
            "time between a request's successive tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.token_loops = Histogram(
            "looplm_token_loops", "loops each generated token ran", buckets=loop_buckets, registry=r
        )
        self.duration = Histogram(
            "looplm_request_duration_seconds",
            "request arrival to its last event",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "looplm_requests", "HTTP requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        info = Gauge("looplm_model_info", "the served model (value 1)", ["model"], registry=r)
        info.labels(model=model_name).set(1)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in :attr:`registry`."""
        return generate_latest(self.registry)
