"""GET /metrics in Prometheus' format, through `prometheus_client`.

Latency histograms, observed by the worker as tokens are sampled: time to first
token (from submission: queueing and prefill included), inter-token latency, and
end-to-end time of completed requests. Counters and gauges are read from
Scheduler.state() at each scrape (requests by outcome, prompt and generated tokens,
whose rate() is the prompt and generation throughput, queue, KV pool), prefix snapkv_.
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)


class Metrics:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("snapkv_time_to_first_token_seconds", "Time from submission to the first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("snapkv_inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("snapkv_e2e_request_latency_seconds", "Time from submission to the end of a "
                             "completed request.", buckets=E2E_BUCKETS, registry=self.registry)
        self.registry.register(_StateCollector(scheduler))

    def token(self, handle) -> None:
        """(worker) A token of `handle` was sampled now."""
        now = time.monotonic()
        if handle.last_token_at is None:
            self.ttft.observe(now - handle.submitted)
        else:
            self.itl.observe(now - handle.last_token_at)
        handle.last_token_at = now

    def finished(self, handle) -> None:
        self.e2e.observe(time.monotonic() - handle.submitted)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StateCollector:
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def describe(self):
        return []

    def collect(self):
        state = self.scheduler.state()
        c = CounterMetricFamily("snapkv_requests", "Requests that ended, by outcome (rejected: 503, the queue "
                                "was full).", labels=["outcome"])
        for outcome in ("completed", "cancelled", "failed", "rejected"):
            c.add_metric([outcome], state[outcome])
        yield c
        for name, key, help_ in (
                ("preemptions", "preempted", "Running requests whose pages were taken back for older ones."),
                ("prompt_tokens", "prompt_tokens", "Prompt tokens run through the model (a preempted request's "
                                                   "again); rate() is the prompt throughput."),
                ("prompt_tokens_cached", "cached_tokens", "Prompt tokens taken from kept caches instead of run."),
                ("generation_tokens", "generation_tokens", "Tokens generated; rate() is the generation "
                                                           "throughput.")):
            yield CounterMetricFamily(f"snapkv_{name}", help_, value=state[key])
        for name, help_, value in (
                ("requests_running", "Requests admitted (prefilling or decoding).", len(state["running"])),
                ("requests_waiting", "Requests queued for admission.", state["waiting"]),
                ("kv_bytes_held", "KV cache bytes held by running requests.", state["kv_bytes_held"])):
            yield GaugeMetricFamily(f"snapkv_{name}", help_, value=value)
        pools = state["kv_pools"].items()
        for name, key, help_ in (("kv_pool_pages", "pages", "Pages of each shared KV pool, by row format."),
                                 ("kv_pool_pages_used", "pages_used", "Pages in use (running requests and kept "
                                                                      "caches), by row format.")):
            g = GaugeMetricFamily(f"snapkv_{name}", help_, labels=["format"])
            for fmt, p in pools:
                g.add_metric([fmt], p[key])
            yield g
