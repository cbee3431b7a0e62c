"""The server's Prometheus metrics, with vLLM's names under the ``pagedkv:`` prefix.

Request metrics are updated on the engine thread as outputs are published
(:meth:`ServeMetrics.observe`); queue lengths, preemptions, lease recoveries and the pool's KV usage and
prefix-cache counters are read when scraped (:class:`_LiveCollector`), so they are never stale.

| metric | kind | when it moves |
|---|---|---|
| ``pagedkv:num_requests_running`` / ``_waiting`` | gauge | the scheduler's queues, at scrape |
| ``pagedkv:time_to_first_token_seconds`` | histogram | a request's first output token |
| ``pagedkv:time_per_output_token_seconds`` | histogram | each later output token (per step, spread over its tokens) |
| ``pagedkv:e2e_request_latency_seconds`` | histogram | a request finishes |
| ``pagedkv:prompt_tokens_total`` | counter | a request's first output (its prompt tokens, once) |
| ``pagedkv:generation_tokens_total`` | counter | every output token of every choice |
| ``pagedkv:request_success_total{finished_reason}`` | counter | a request finishes ("stop", "length", "abort") |
| ``pagedkv:num_preemptions_total`` | counter | the engine preempts a request (by recompute or swap) |
| ``pagedkv:num_swaps_total`` | counter | the engine preempts a request by swap (its KV to the host tier) |
| ``pagedkv:lease_recoveries_total`` | counter | the engine recovers from a lost lease or a new pool generation
(client.engine.recovery) |
| ``pagedkv:worker_failovers_total`` | counter | a worker fails, its sequences move to another
(client.engine.failover) |
| ``pagedkv:workers_ready`` | gauge | workers that take work, at scrape |
| ``pagedkv:host_tier_page_locked{worker}`` | gauge | 1 when a GPU worker's host tier is page-locked, 0 when the
memlock limit refused it (its tier copies are synchronous); no sample on a CPU pool or without a host tier |
| ``pagedkv:recomputed_tokens_total{reason}`` | counter | tokens computed again: ``worker_failure``,
``preemption``, ``lease_lost`` |
| ``pagedkv:kv_cache_usage_perc`` | gauge | used / total blocks of the pool, at scrape |
| ``pagedkv:prefix_cache_queries_total`` / ``_hits_total`` | counter | the pool's, in tokens, at scrape |

With ``--metrics-compat vllm`` the same values are also exported under vLLM's names, labels and
buckets (:mod:`client.serve.metrics_vllm`), in the same registry: ``/metrics`` serves both, under
one key rule (client.serve.access.authorize_metrics).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from client.api import RequestOutput
from client.serve.metrics_vllm import COMPAT_CHOICES, VllmMetrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(slots=True)
class _Progress:
    """What has been counted of one request."""

    prompt_counted: bool = False
    tokens: int = 0
    last_token: float = 0.0


class ServeMetrics:
    """Request metrics of one server (its own registry).

    Args:
        model_name: the ``model_name`` label (the served model name).
        backend: the Client or Cluster (client.backend.Backend) whose engine stats and pool
            GetStats are read at scrape (a Cluster's: every node's added up).
        compat: "vllm": also export vLLM's names (:class:`client.serve.metrics_vllm.VllmMetrics`);
            "none": the ``pagedkv:`` names only.
        max_model_len: the longest context, tokens (with ``compat`` "vllm": its token histograms'
            buckets); None: ``backend.limits.max_context``.

    Raises:
        ValueError: ``compat`` not one of :data:`client.serve.metrics_vllm.COMPAT_CHOICES`.
    """

    def __init__(self, model_name: str, backend, compat: str = "none", max_model_len: int | None = None):
        if compat not in COMPAT_CHOICES:
            raise ValueError(f"metrics compat {compat!r}: use one of {', '.join(COMPAT_CHOICES)}")
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        self._labels = {"model_name": model_name}
        self.ttft = Histogram("pagedkv:time_to_first_token_seconds", "Time to first token, seconds.",
                              buckets=_LATENCY_BUCKETS, **label).labels(**self._labels)
        self.tpot = Histogram("pagedkv:time_per_output_token_seconds",
                              "Time per output token after the first, seconds.",
                              buckets=_LATENCY_BUCKETS, **label).labels(**self._labels)
        self.e2e = Histogram("pagedkv:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                             buckets=_LATENCY_BUCKETS, **label).labels(**self._labels)
        self.prompt_tokens = Counter("pagedkv:prompt_tokens", "Prompt tokens processed.",
                                     **label).labels(**self._labels)
        self.generation_tokens = Counter("pagedkv:generation_tokens", "Output tokens generated.",
                                         **label).labels(**self._labels)
        self.success = Counter("pagedkv:request_success", "Finished requests by finish reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        #: vLLM's names of the same values (``--metrics-compat vllm``), or None.
        self.vllm: VllmMetrics | None = None
        if compat == "vllm":
            self.vllm = VllmMetrics(self.registry, model_name,
                                    max_model_len if max_model_len is not None else backend.limits.max_context)
        #: Where each request event goes: this prefix's metrics and, with compat, vLLM's.
        self._sinks = [self] if self.vllm is None else [self, self.vllm]
        self.registry.register(_LiveCollector(self._labels, backend, self.vllm))
        self._progress: dict[str, _Progress] = {}
        self._lock = threading.Lock()
        #: The two token counters' totals, kept beside them so reading them collects nothing (a
        #: registry read would run the live collector's GetStats).
        self._totals = [0, 0]

    def token_totals(self) -> tuple[float, float]:
        """(prompt tokens, generation tokens) counted so far, as /metrics shows them."""
        with self._lock:
            return float(self._totals[0]), float(self._totals[1])

    def observe(self, request_id: str, out: RequestOutput | None, error: Exception | None) -> None:
        """Count what ``out`` adds since the last output of request ``request_id`` (engine thread)."""
        now = time.time()
        with self._lock:
            if out is None:  # failed without an output: forget it
                self._progress.pop(request_id, None)
                return
            prog = self._progress.setdefault(request_id, _Progress())
            tokens = sum(len(o.token_ids) for o in out.outputs)
            new = tokens - prog.tokens
            if not prog.prompt_counted:
                prog.prompt_counted = True
                for m in self._sinks:
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                self._totals[0] += len(out.prompt_token_ids)
            if new > 0:
                for m in self._sinks:
                    m.generation_tokens.inc(new)
                self._totals[1] += new
                if prog.tokens == 0:
                    if out.metrics.get("ttft") is not None:
                        for m in self._sinks:
                            m.ttft.observe(out.metrics["ttft"])
                    new -= 1  # the first token has no inter-token time
                elif prog.last_token:
                    per = (now - prog.last_token) / new
                    for m in self._sinks:
                        for _ in range(new):
                            m.tpot.observe(per)
                prog.tokens, prog.last_token = tokens, now
            if out.finished or error is not None:
                self._progress.pop(request_id, None)
                reason = "error" if error is not None else _reason(out)
                for m in self._sinks:
                    m.finished(reason, out)

    def finished(self, reason: str, out: RequestOutput) -> None:
        """A request finished with ``reason`` and last output ``out``: its success and latency."""
        self.success.labels(finished_reason=reason, **self._labels).inc()
        if out.metrics.get("e2e") is not None:
            self.e2e.observe(out.metrics["e2e"])


def _reason(out: RequestOutput) -> str:
    """The request's finish reason: "abort" if any choice was aborted, else the first choice's."""
    reasons = [o.finish_reason for o in out.outputs]
    return "abort" if "abort" in reasons else (reasons[0] if reasons else "abort")


class _LiveCollector:
    """Gauges and pool counters read at scrape time."""

    def __init__(self, labels: dict, backend, vllm: VllmMetrics | None = None):
        self.labels, self.backend, self.vllm = labels, backend, vllm

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        engine_stats = self.backend.engine_stats()
        for name, doc, value in (("num_requests_running", "Requests in the running batch.", engine_stats.num_running),
                                 ("num_requests_waiting", "Requests waiting for admission.", engine_stats.num_waiting)):
            g = GaugeMetricFamily(f"pagedkv:{name}", doc, labels=names)
            g.add_metric(values, value)
            yield g
        for name, doc, value in (("num_preemptions", "Requests preempted (by recompute or swap).",
                                  engine_stats.preemptions),
                                 ("num_swaps", "Requests preempted by swap (KV moved to the host tier and back).",
                                  engine_stats.swaps),
                                 ("lease_recoveries", "Recoveries from a lost lease or a new pool generation "
                                  "(running requests recomputed).", engine_stats.lease_recoveries),
                                 ("worker_failovers", "Workers failed over from (their sequences moved to another "
                                  "worker).", engine_stats.worker_failovers)):
            c = CounterMetricFamily(f"pagedkv:{name}", doc, labels=names)
            c.add_metric(values, value)
            yield c
        g = GaugeMetricFamily("pagedkv:workers_ready", "Workers that take work now.", labels=names)
        g.add_metric(values, engine_stats.workers_ready)
        yield g
        g = GaugeMetricFamily("pagedkv:host_tier_page_locked", "1: the worker's host tier is page-locked (asynchronous "
                              "tier copies); 0: the memlock limit refused it (synchronous copies).",
                              labels=[*names, "worker"])
        for w in engine_stats.worker_info:
            if w.host_tier_page_locked is not None:
                g.add_metric([*values, w.address], 1.0 if w.host_tier_page_locked else 0.0)
        yield g
        c = CounterMetricFamily("pagedkv:recomputed_tokens", "Tokens whose KV a worker computed a second time, "
                                "by reason.", labels=[*names, "reason"])
        for reason in ("worker_failure", "preemption", "lease_lost"):
            c.add_metric([*values, reason], getattr(engine_stats, f"recomputed_{reason}"))
        yield c
        try:
            stats = self.backend.stats()
        except Exception:  # noqa: BLE001 - the memory service is down: no pool metrics this scrape
            stats = None
        if self.vllm is not None:
            yield from self.vllm.live(engine_stats, stats)
        if stats is None:
            return
        g = GaugeMetricFamily("pagedkv:kv_cache_usage_perc", "Used fraction of the KV pool's blocks (0-1).",
                              labels=names)
        g.add_metric(values, stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0)
        yield g
        for name, doc, value in (("prefix_cache_queries", "Prefix-cache lookups in the pool, tokens.",
                                  stats.prefix_cache_queries),
                                 ("prefix_cache_hits", "Prefix-cache hits in the pool, tokens.",
                                  stats.prefix_cache_hits)):
            c = CounterMetricFamily(f"pagedkv:{name}", doc, labels=names)
            c.add_metric(values, value)
            yield c
