"""Prometheus metrics of a served engine (``GET /metrics``): requests running and waiting, requests
finished by reason, tokens generated, draft tokens proposed and accepted, tau, acceptance by draft
position, batch step time, time to first token. Counts are read from the ``AsyncEngine``'s counters
at scrape time; times are histograms observed as they happen. Each server has its own registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .async_engine import AsyncEngine

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, served: AsyncEngine):
        self.served = served
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.step_seconds = Histogram("turbospec_step_seconds", "Time of one batched verify step (all rows)",
                                      buckets=STEP_BUCKETS, registry=self.registry)
        self.ttft_seconds = Histogram("turbospec_time_to_first_token_seconds",
                                      "From a request's arrival to its first generated token",
                                      buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_seconds = Histogram("turbospec_request_seconds", "From a request's arrival to its end",
                                         buckets=LATENCY_BUCKETS, registry=self.registry)

    def on_step(self, outputs, seconds: float) -> None:
        """The AsyncEngine's step hook (worker thread)."""
        if any(o.tokens for o in outputs):
            self.step_seconds.observe(seconds)

    def collect(self):
        c = self.served.counters
        yield GaugeMetricFamily("turbospec_requests_running", "Requests holding a batch slot",
                                value=self.served.running)
        yield GaugeMetricFamily("turbospec_requests_waiting", "Requests waiting for a batch slot",
                                value=self.served.waiting)
        finished = CounterMetricFamily("turbospec_requests_finished", "Requests ended, by reason",
                                       labels=["reason"])
        for reason, n in sorted(c.finished.items()):
            finished.add_metric([reason], n)
        yield finished
        yield CounterMetricFamily("turbospec_generation_tokens", "Tokens generated", value=c.tokens)
        yield CounterMetricFamily("turbospec_draft_tokens_proposed", "Draft tokens proposed to the target",
                                  value=c.draft_proposed)
        yield CounterMetricFamily("turbospec_draft_tokens_accepted", "Draft tokens accepted by the target",
                                  value=c.draft_accepted)
        yield CounterMetricFamily("turbospec_verify_row_steps", "Verify steps summed over requests",
                                  value=c.row_steps)
        yield CounterMetricFamily("turbospec_batch_steps", "Batched verify steps", value=c.steps)
        yield GaugeMetricFamily("turbospec_tau", "Mean tokens emitted per request per verify step",
                                value=c.tokens / c.row_steps if c.row_steps else 0.0)
        rate = GaugeMetricFamily("turbospec_acceptance_rate", "Acceptance rate by draft position (depth)",
                                 labels=["position"])
        for i, (a, p) in enumerate(zip(c.accepted_at, c.proposed_at)):
            rate.add_metric([str(i + 1)], a / p if p else 0.0)
        yield rate

    def render(self) -> bytes:
        return generate_latest(self.registry)
