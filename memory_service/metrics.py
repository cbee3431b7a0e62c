"""Prometheus metrics of the memory service (``--metrics-port``), read from GetStats at scrape time.

Names follow vLLM's where one exists (kv cache usage, prefix cache queries/hits,
preemptions), with the ``pagedkv_`` prefix.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from memory_service.block_manager import BlockManager


class BlockManagerCollector(Collector):
    """Exports a :class:`BlockManager`'s counters."""

    def __init__(self, manager: BlockManager):
        self.manager = manager

    def collect(self):
        s = self.manager.stats()
        gauges = {
            "pagedkv_kv_cache_usage_perc": ("Fraction of KV blocks in use (0-1).", s.used_blocks / s.total_blocks),
            "pagedkv_kv_cache_utilization": ("Token states stored / token capacity of used blocks.", s.utilization),
            "pagedkv_num_blocks_total": ("Blocks in the pool.", s.total_blocks),
            "pagedkv_num_blocks_used": ("Blocks with refcount > 0.", s.used_blocks),
            "pagedkv_num_blocks_free": ("Blocks with no content.", s.free_blocks),
            "pagedkv_num_blocks_cached": ("Refcount-0 blocks kept for the prefix cache.", s.cached_blocks),
            "pagedkv_num_sequences": ("Live sequences.", s.num_sequences),
            "pagedkv_num_leases": ("Live leases.", s.num_leases),
            "pagedkv_tokens_stored": ("Token states held in used blocks.", s.tokens_stored),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "pagedkv_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            "pagedkv_prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            "pagedkv_prefix_cache_evictions": ("Cached blocks evicted.", s.prefix_cache_evictions),
            "pagedkv_num_preemptions": ("Sequences freed as preempted by clients.", s.preemptions),
            "pagedkv_allocation_failures": ("Requests refused with OUT_OF_BLOCKS.", s.allocation_failures),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


def start_metrics_server(manager: BlockManager, host: str, port: int) -> int:
    """Serve /metrics on ``host:port`` (0 = a free port) from a daemon thread; returns the port."""
    from prometheus_client import start_http_server

    REGISTRY.register(BlockManagerCollector(manager))
    server, _ = start_http_server(port, addr=host)
    return server.server_port
