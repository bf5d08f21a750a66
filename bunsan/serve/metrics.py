"""GET /metrics in Prometheus' text format (prometheus_client), named as vLLM names its own with a bunsan_
prefix: requests by how they ended, prompt and generated tokens, time to first token, inter-token latency
and whole-request latency histograms, and at scrape time the batcher's running and waiting sequences, the
KV cache's blocks in use, preemptions and prefix cache hits, and the serving loop's iterations and seconds
(all of it, and its model forwards: a loop's mean time against the inter-token latency says how long tokens
wait outside it).

Each Service has its own registry (several apps in one process, as the tests run them, never collide).
"""

from __future__ import annotations

import time

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0)


class ServeMetrics:
    def __init__(self, batcher, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        self.registry = CollectorRegistry()
        self.batcher, self.model_name = batcher, model_name
        label = ["model_name"]
        self.requests = Counter("bunsan_request_success", "Sequences ended, by finish reason",
                                label + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("bunsan_prompt_tokens", "Prompt tokens of accepted requests", label,
                                     registry=self.registry)
        self.generation_tokens = Counter("bunsan_generation_tokens", "Tokens generated", label, registry=self.registry)
        self.ttft = Histogram("bunsan_time_to_first_token_seconds", "From accepted to a sequence's first token",
                              label, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("bunsan_inter_token_latency_seconds", "Between a sequence's consecutive tokens", label,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("bunsan_e2e_request_latency_seconds", "From accepted to a request's last sequence's end",
                             label, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_BatcherState(self))

    def accepted(self, job) -> None:
        self.prompt_tokens.labels(self.model_name).inc(sum(len(ids) for ids in job.gen.prompts) * job.gen.best_of)

    def token(self, job, choice) -> None:
        now = time.monotonic()
        last = getattr(choice, "last_token_at", None)
        (self.ttft if last is None else self.itl).labels(self.model_name).observe(
            now - (job.accepted_at if last is None else last))
        choice.last_token_at = now
        self.generation_tokens.labels(self.model_name).inc()

    def ended(self, job, choice) -> None:
        reason = "error" if choice.end.startswith("error") else choice.reason
        self.requests.labels(self.model_name, reason).inc()
        if job.ended == len(job.choices):
            self.e2e.labels(self.model_name).observe(time.monotonic() - job.accepted_at)

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _BatcherState:
    """Gauges read from the batcher when scraped (no bookkeeping on its thread)."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        b, name = self.metrics.batcher, self.metrics.model_name
        running, waiting = b.load()
        pool = b.pool
        used = pool.usable - pool.available()
        for metric, doc, value in [("bunsan_num_requests_running", "Sequences prefilling or decoding", running),
                                   ("bunsan_num_requests_waiting", "Sequences waiting for a place", waiting),
                                   ("bunsan_kv_cache_blocks_used", "KV cache blocks held by sequences", used),
                                   ("bunsan_kv_cache_blocks_total", "KV cache blocks", pool.usable),
                                   ("bunsan_kv_cache_usage_perc", "Fraction of the KV cache's blocks held",
                                    used / pool.usable)]:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        for metric, doc, value in [("bunsan_num_preemptions", "Sequences preempted for want of blocks", b.preempted),
                                   ("bunsan_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache",
                                    b.reused_tokens),
                                   ("bunsan_engine_iterations", "Serving loops run (one forward each)", b.loops),
                                   ("bunsan_engine_busy_seconds", "Seconds in serving loops", b.busy_s),
                                   ("bunsan_engine_forward_seconds",
                                    "Seconds in the model's forwards (on a GPU: launching them)", b.forward_s)]:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
