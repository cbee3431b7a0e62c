"""vLLM's names for the front's metrics: ``pagedkv serve --metrics-compat vllm``.

A second export of the same values (DESIGN.md, "Metrics": ``vllm:`` names only as an opt-in
second export), so that dashboards and alerts written for ``vllm serve`` read a pagedkv server
unchanged. Names, types, label names and histogram buckets are those of vLLM 0.32's
``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py), checked against a capture of a real
``vllm serve`` (tests/client/serve/data/vllm_0.32_metrics.txt, scripts/capture_vllm_metrics.py).
Every family carries ``model_name`` (the served model name) and ``engine`` ("0": one engine, as
``vllm serve`` without data parallelism).

| ``vllm:`` family | kind | the ``pagedkv:`` value it repeats |
|---|---|---|
| ``num_requests_running`` / ``num_requests_waiting`` | gauge | the scheduler's queues, at scrape |
| ``kv_cache_usage_perc`` | gauge | used / total blocks of the pool, at scrape |
| ``prompt_tokens_total`` / ``generation_tokens_total`` | counter | the same counters |
| ``time_to_first_token_seconds`` | histogram | each request's TTFT |
| ``inter_token_latency_seconds`` | histogram | each token after the first (``pagedkv:time_per_output_token_seconds``) |
| ``request_time_per_output_token_seconds`` | histogram | a finished request's mean time per output token |
| ``e2e_request_latency_seconds`` | histogram | a finished request's latency |
| ``request_success_total{finished_reason}`` | counter | finished requests: stop, length, abort, error; repetition 0 |
| ``num_preemptions_total`` | counter | the engine's preemptions, at scrape |
| ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` | counter | the pool's, tokens, at scrape |
| ``request_prompt_tokens`` / ``request_generation_tokens`` | histogram | a finished request's token counts |
| ``request_num_preemptions`` | histogram | a finished request's preemptions |

Not exported (no pagedkv equivalent, or not measured at the front): the per-phase request times
(queue, prefill, decode, inference), ``iteration_tokens_total`` (the workers'
``pagedkv:worker_step_tokens``), multimodal, external-cache, FLOPs and sleep-state families,
``cache_config_info``, ``admission_rejections``, the by-source prompt counters,
``request_params_*``. A request with ``n`` > 1 counts once, as in the ``pagedkv:`` metrics (vLLM's
engine counts each of its ``n`` samples as a request).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from client.api import RequestOutput

#: ``--metrics-compat`` values.
COMPAT_CHOICES = ("none", "vllm")
#: The ``engine`` label: vLLM's engine index (one engine).
ENGINE = "0"
#: vLLM 0.32's bucket families (vllm/v1/metrics/buckets.py): time to first token; inter-token
#: latency and per-request time per output token; request latencies; preemptions per request.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
#: vLLM's finish reasons, each a ``request_success`` series from the start.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``, its bounds of the
    per-request token histograms, from the longest context)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return out
            out.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """The ``vllm:`` request metrics of one server, in its registry (the one ``/metrics`` serves, so
    the same key rule holds); :class:`client.serve.metrics.ServeMetrics` feeds them beside its own.

    Args:
        registry: the server's registry.
        model_name: the ``model_name`` label.
        max_model_len: the longest context in tokens (prompt + output): the token histograms' buckets.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        self.labels = {"model_name": model_name, "engine": ENGINE}
        names = ["model_name", "engine"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**self.labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        #: Each output token after the first (the name ``ServeMetrics`` feeds: its ``tpot``).
        self.tpot = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        tokens = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.request_preemptions = histogram("vllm:request_num_preemptions",
                                             "Histogram of the number of times a request was preempted.",
                                             PREEMPTION_BUCKETS)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=registry)
        self.success = {r: success.labels(finished_reason=r, **self.labels) for r in FINISH_REASONS}

    def finished(self, reason: str, out: RequestOutput) -> None:
        """A request finished with ``reason`` ("stop", "length", "abort" or "error") and last output ``out``."""
        self.success[reason if reason in self.success else "stop"].inc()
        if out.metrics.get("e2e") is not None:
            self.e2e.observe(out.metrics["e2e"])
        if out.metrics.get("tpot") is not None:
            self.request_tpot.observe(out.metrics["tpot"])
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(o.token_ids) for o in out.outputs))
        self.request_preemptions.observe(out.metrics.get("preemptions") or 0)

    def live(self, engine_stats, pool_stats):
        """The scrape-time families: queues and preemptions from ``engine_stats``
        (client.engine.stats.EngineStats); KV usage and prefix-cache counters from ``pool_stats``
        (the memory service's GetStats; None while it is down: those families are left out)."""
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 engine_stats.num_running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine_stats.num_waiting)):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            yield g
        c = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                labels=names)
        c.add_metric(values, engine_stats.preemptions)
        yield c
        if pool_stats is None:
            return
        g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=names)
        total = pool_stats.total_blocks
        g.add_metric(values, pool_stats.used_blocks / total if total else 0.0)
        yield g
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 pool_stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 pool_stats.prefix_cache_hits)):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            yield c


__all__ = ["COMPAT_CHOICES", "VllmMetrics", "one_two_five_buckets"]
