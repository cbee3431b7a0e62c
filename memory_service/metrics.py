"""Prometheus metrics of the memory service (``--metrics-port``), read from GetStats at scrape time.

Names follow vLLM's where one exists (kv cache usage, prefix cache queries/hits,
preemptions), with the ``pagedkv:`` prefix of every pagedkv process (DESIGN.md, "Metrics"). The
older ``pagedkv_`` names of :data:`METRICS` are exported too, for one release, as deprecated
aliases: the same values under ``pagedkv_<same rest>`` (``pagedkv:num_blocks_used`` and
``pagedkv_num_blocks_used``; counters end in ``_total`` under both), each alias's help text
naming its new name. Dashboards and alerts should move to the ``pagedkv:`` names.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from memory_service.manager.block_manager import BlockManager

#: Exported metrics: name after the prefix -> (family, help, the :class:`Stats` attribute it reads); each
#: as ``pagedkv:<name>`` and, until the next release, as the alias ``pagedkv_<name>``.
METRICS = {
    "kv_cache_usage_perc": (GaugeMetricFamily, "Fraction of KV blocks in use (0-1).", "usage"),
    "kv_cache_utilization": (
        GaugeMetricFamily,
        "Token states stored / token capacity of used blocks.",
        "utilization",
    ),
    "num_blocks_total": (GaugeMetricFamily, "Blocks in the pool.", "total_blocks"),
    "num_blocks_used": (GaugeMetricFamily, "Blocks with refcount > 0.", "used_blocks"),
    "num_blocks_free": (GaugeMetricFamily, "Blocks with no content.", "free_blocks"),
    "num_blocks_cached": (
        GaugeMetricFamily,
        "Refcount-0 blocks keeping content (prefix cache, swapped-out blocks).",
        "cached_blocks",
    ),
    "num_sequences": (GaugeMetricFamily, "Live sequences.", "num_sequences"),
    "num_leases": (GaugeMetricFamily, "Live leases.", "num_leases"),
    "tokens_stored": (GaugeMetricFamily, "Token states held in used blocks.", "tokens_stored"),
    "prefix_cache_queries": (
        CounterMetricFamily,
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    "prefix_cache_hits": (CounterMetricFamily, "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    "prefix_cache_evictions": (CounterMetricFamily, "Cached blocks evicted.", "prefix_cache_evictions"),
    "num_preemptions": (CounterMetricFamily, "Sequences freed as preempted by clients.", "preemptions"),
    "allocation_failures": (CounterMetricFamily, "Requests refused with OUT_OF_BLOCKS.", "allocation_failures"),
    # The host tier (all 0 without one).
    "host_num_blocks_total": (GaugeMetricFamily, "Blocks in the host tier.", "host_total_blocks"),
    "host_num_blocks_used": (
        GaugeMetricFamily,
        "Host blocks held: pending copies, swapped sequences.",
        "host_used_blocks",
    ),
    "host_num_blocks_free": (GaugeMetricFamily, "Host blocks with no content.", "host_free_blocks"),
    "host_num_blocks_cached": (
        GaugeMetricFamily,
        "Host blocks holding offloaded prefix-cache blocks.",
        "host_cached_blocks",
    ),
    "host_cache_hits": (
        CounterMetricFamily,
        "Prompt tokens found in the host tier (reloaded).",
        "host_cache_hits",
    ),
    "host_cache_evictions": (CounterMetricFamily, "Cached host blocks evicted.", "host_cache_evictions"),
    "offloads": (CounterMetricFamily, "Blocks offloaded device to host (copies proven).", "offloads"),
    "offloads_dropped": (
        CounterMetricFamily,
        "Offloads that did not happen (no host room, or never proven).",
        "offloads_dropped",
    ),
    "reloads": (CounterMetricFamily, "Blocks reloaded host to device (copies proven).", "reloads"),
    "swap_outs": (CounterMetricFamily, "Sequences swapped out to the host tier.", "swap_outs"),
    "swap_ins": (CounterMetricFamily, "Sequences swapped back in.", "swap_ins"),
    "num_sequences_swapped": (GaugeMetricFamily, "Sequences swapped out now.", "swapped_sequences"),
}


#: The disk tier's metrics (only with one): name -> (family, help, its DiskTier.stats() key). Named
#: ``pagedkv:``, every process's prefix from now on (DESIGN.md, "Metrics").
DISK_METRICS = {
    "pagedkv:disk_blocks": (GaugeMetricFamily, "Blocks on disk (the disk tier's cached slots).", "disk_blocks"),
    "pagedkv:disk_bytes": (GaugeMetricFamily, "Bytes of the blocks on disk, headers included.", "disk_bytes"),
    "pagedkv:disk_hits_total": (CounterMetricFamily, "Prompt tokens read back from disk (proven reads).",
                                "disk_hits"),
    "pagedkv:disk_writes_total": (CounterMetricFamily, "Blocks written to disk (proven writes).", "disk_writes"),
    "pagedkv:disk_dropped_total": (CounterMetricFamily, "Writes to disk dropped: no room, the write queue full, "
                                   "or never proven.", "disk_dropped"),
    "pagedkv:disk_checksum_failures_total": (CounterMetricFamily, "Disk blocks whose header or checksum was wrong "
                                             "when read (dropped, never served).", "disk_checksum_failures"),
}


#: Prefix pins (PinPrefix) and the retention they leave: name -> (family, help, its PinStats key).
PIN_METRICS = {
    "pagedkv:prefix_pins": (GaugeMetricFamily, "Live prefix pins.", "num_pins"),
    "pagedkv:prefix_pinned_blocks": (GaugeMetricFamily, "Device blocks held by prefix pins.", "pinned_blocks"),
    "pagedkv:retained_blocks": (GaugeMetricFamily, "Cached blocks with a retention priority (evicted after plain "
                                "cached blocks, lowest priority first).", "retained_blocks"),
    "pagedkv:prefix_pins_expired_total": (CounterMetricFamily, "Prefix pins ended by their TTL.", "expired"),
}


#: Every metric's prefix, and the older one its aliases keep for one release.
NEW_PREFIX, OLD_PREFIX = "pagedkv:", "pagedkv_"


class BlockManagerCollector(Collector):
    """Exports a :class:`BlockManager`'s counters: :data:`METRICS` under both prefixes (same values),
    :data:`PIN_METRICS`, and :data:`DISK_METRICS` with a disk tier (``pagedkv:`` only)."""

    def __init__(self, manager: BlockManager):
        self.manager = manager

    def collect(self):
        s = self.manager.stats()
        for name, (family, doc, field) in METRICS.items():
            value = getattr(s, field)
            yield family(f"{NEW_PREFIX}{name}", doc, value=value)
            yield family(f"{OLD_PREFIX}{name}", f"Deprecated alias of {NEW_PREFIX}{name} (removed in the next "
                         f"release): {doc}", value=value)
        tables = [(PIN_METRICS, s.pins)] + ([(DISK_METRICS, s.disk)] if s.disk is not None else [])
        for metrics, values in tables:
            for name, (family, doc, key) in metrics.items():
                yield family(name.removesuffix("_total") if family is CounterMetricFamily else name, doc,
                             value=values[key])


def start_metrics_server(manager: BlockManager, host: str, port: int) -> int:
    """Serve /metrics on ``host:port`` (0 = a free port) from a daemon thread; returns the port."""
    from prometheus_client import start_http_server

    REGISTRY.register(BlockManagerCollector(manager))
    server, _ = start_http_server(port, addr=host)
    return server.server_port
