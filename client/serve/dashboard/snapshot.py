"""One dashboard snapshot: the pool, the front's requests with their block tables, other leases,
counters. Pure: built from what the feed read (client.serve.dashboard.feed), no service calls.

The JSON (``type: "snapshot"``; the browser page and ``pagedkv top`` read it)::

    version                   SCHEMA_VERSION (bumped when a field changes meaning or goes)
    seq, time                 snapshot number (from 1 at each server start), seconds since the epoch
    scope                     "all leases" (the feed holds the memory service's admin token) or
                              "own lease" (it does not: other leases are hidden); scope_note says why
    pool                      device tier: total_blocks, block_size, generation, counts
                              {free, used, cached} of this map, exact (see client.serve.dashboard.block_states),
                              and the blocks (client.serve.dashboard.block_states.encode)
    host                      the host tier's map in the same form, or null without one
    stats                     every field of GetStats, as the memory service answered
    requests.running          this front's running requests: request_id, status, prompt_tokens, n,
                              output_tokens, num_cached_tokens, preemptions, sequences
    requests.waiting          its waiting requests (no blocks; a request preempted by swap keeps its
                              sequences, swapped out to the host tier)
    leases                    other leases' sequences: [{lease_id, sequences}]
    sequences[]               seq_id, index (a request's sample), num_tokens, num_computed, block_ids,
                              ref_counts (null when not in the listing), media (only when a block is
                              off the device: 0 device, 1 host), swapped, parent_seq_id
    truncated                 sequences beyond MAX_TABLE_SEQUENCES were sent without their tables
    workers[]                 every worker of every node (client.engine.stats.WorkerInfo): address, node
                              (its --node name, "" for a single engine), state ("ready", "down" or
                              "draining"), since (when it entered that state, seconds since the epoch;
                              null: ready since the engine started), requests and sequences (running, pinned
                              to it), waiting (waiting requests pinned to it), failures, restarts, instance_id
    counters                  kv_usage, prefix_cache_hit_rate (since the pool started), preemptions
                              (this front's) and pool_preemptions, swaps, and ``now``: tokens/s and hit
                              rate over the last seconds (client.serve.dashboard.rates); of every node's
                              engine: workers_ready, workers_total, worker_failovers, and last_step_age_s
                              (seconds since a step last completed; null: none yet)
    history                   one point per 5 s over the last 5 minutes (client.serve.dashboard.rates)
    feed                      what the feed costs this front: interval_s between snapshots, and the
                              previous tick's wall and CPU milliseconds (last_tick_ms, last_tick_cpu_ms)
"""

from __future__ import annotations

import time

from client.engine.stats import EngineStats
from client.request import Request
from client.serve.dashboard.block_states import MEDIUM_DEVICE, MEDIUM_HOST, encode, pool_map
from client.serve.dashboard.rates import History

#: The snapshot's schema version.
SCHEMA_VERSION = 1
#: Sequences sent with their block tables in one snapshot (the front's first, then other leases');
#: the rest go without tables, so a snapshot stays bounded on a busy node.
MAX_TABLE_SEQUENCES = 512


class _Budget:
    """Block tables left to send in this snapshot, and the rows sent without one."""

    __slots__ = ("left", "skipped")

    def __init__(self, left: int):
        self.left, self.skipped = left, 0

    def take(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return True
        self.skipped += 1
        return False


def _row(info, budget: _Budget) -> dict:
    """A listed sequence as JSON; its table only while the budget lasts."""
    row = {"seq_id": info.seq_id, "num_tokens": info.num_tokens, "swapped": info.swapped,
           "parent_seq_id": info.parent_seq_id if info.HasField("parent_seq_id") else None}
    if budget.take():
        row["block_ids"] = list(info.block_ids)
        row["ref_counts"] = list(info.ref_counts)
        if info.media and max(info.media) != MEDIUM_DEVICE:
            row["media"] = list(info.media)
    return row


def _request(req: Request, listed: dict, budget: _Budget) -> dict:
    seqs = []
    own = list(req.seqs)
    for s in own:
        info = listed.get(s.seq_id) if s.seq_id is not None else None
        if info is not None:
            row = _row(info, budget)
        else:  # not allocated (waiting, preempted by recompute) or not in this listing
            row = {"seq_id": s.seq_id, "num_tokens": len(s.tokens), "swapped": False, "parent_seq_id": None,
                   "block_ids": list(s.block_table), "ref_counts": None}
        seqs.append(row | {"index": s.index, "num_computed": s.num_computed, "finished": s.finish_reason is not None})
    return {"request_id": req.request_id, "status": req.status.value, "prompt_tokens": len(req.prompt_token_ids),
            "n": req.params.n, "output_tokens": max((len(s.tokens) - s.prompt_len for s in own), default=0),
            "num_cached_tokens": req.num_cached_tokens, "preemptions": req.metrics.preemptions,
            "arrival": round(req.metrics.arrival, 3), "sequences": seqs}


def _workers(engines: EngineStats, now: float, clock: float) -> list[dict]:
    """Each worker as JSON; its monotonic ``since`` as seconds since the epoch."""
    return [{"address": w.address, "node": w.node, "state": w.state,
             "since": round(now - (clock - w.since), 3) if w.since else None,
             "requests": w.requests, "sequences": w.sequences, "waiting": w.waiting, "failures": w.failures,
             "restarts": w.restarts, "instance_id": w.instance_id} for w in engines.worker_info]


def build(*, seq: int, now: float, stats, sequences: list, front: EngineStats, scope: str, scope_note: str,
          cached: tuple[set[int], set[int], bool], history: History, feed: dict | None = None,
          max_table_sequences: int = MAX_TABLE_SEQUENCES, engines: EngineStats | None = None,
          clock: float | None = None) -> dict:
    """The snapshot (module docstring) from one tick's reads.

    Args:
        seq: snapshot number.
        now: seconds since the epoch, when the reads began.
        stats: the GetStatsResponse read.
        sequences: the SequenceInfo rows listed (every lease's, or this front's lease's).
        front: this front's engine stats (its requests, lease and preemptions; client.engine.stats).
        scope, scope_note: what the listing covers, and why.
        cached: (device block ids, host block ids, complete) from the KV events.
        history: the counters' history, this tick's sample already added.
        feed: the feed's own cost (module docstring), or None.
        engines: every node's engine stats, added up (client.backend.Backend.engine_stats: the workers
            of every node); None: ``front``'s.
        clock: time.monotonic() when the reads began (None: now), against which the engines' times are read.
    """
    engines = front if engines is None else engines
    clock = time.monotonic() if clock is None else clock
    device_cached, host_cached, complete = cached
    dev = pool_map(stats.total_blocks, sequences, device_cached, MEDIUM_DEVICE)
    counts = dev.counts()
    exact = complete and scope == "all leases" and counts == {"free": stats.free_blocks, "used": stats.used_blocks,
                                                              "cached": stats.cached_blocks}
    pool = {"block_size": stats.block_size, "generation": stats.generation, "exact": exact} | encode(dev)
    host = None
    if stats.host_total_blocks:
        hm = pool_map(stats.host_total_blocks, sequences, host_cached, MEDIUM_HOST)
        host = {"exact": complete and scope == "all leases" and hm.counts() == {
            "free": stats.host_free_blocks, "used": stats.host_used_blocks, "cached": stats.host_cached_blocks}
        } | encode(hm)
    budget = _Budget(max_table_sequences)
    listed = {s.seq_id: s for s in sequences}
    running = [_request(r, listed, budget) for r in front.running]
    waiting = [_request(r, listed, budget) for r in front.waiting]
    mine = {s["seq_id"] for r in running + waiting for s in r["sequences"] if s["seq_id"] is not None}
    leases: dict[str, list] = {}
    for s in sequences:
        # Only the admin's listing names leases; a listing of the front's own lease has no others.
        if s.seq_id in mine or scope != "all leases" or s.lease_id == front.lease_id:
            continue
        leases.setdefault(s.lease_id or "?", []).append(_row(s, budget))
    hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
    return {
        "type": "snapshot",
        "version": SCHEMA_VERSION,
        "seq": seq,
        "time": round(now, 3),
        "scope": scope,
        "scope_note": scope_note,
        "pool": pool,
        "host": host,
        "stats": stats_dict(stats),
        "requests": {"running": running, "waiting": waiting},
        "leases": [{"lease_id": k, "sequences": v} for k, v in sorted(leases.items())],
        "truncated": budget.skipped > 0,
        "workers": _workers(engines, now, clock),
        "counters": {
            "kv_usage": round(stats.used_blocks / stats.total_blocks, 4) if stats.total_blocks else 0.0,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "preemptions": front.preemptions,
            "swaps": front.swaps,
            "pool_preemptions": stats.preemptions,
            "now": history.now(),
            "workers_ready": engines.workers_ready,
            "workers_total": engines.workers_total,
            "worker_failovers": engines.worker_failovers,
            "last_step_age_s": round(clock - engines.last_step_at, 3) if engines.last_step_at else None,
        },
        "history": history.series(),
        "feed": feed,
    }


__all__ = ["MAX_TABLE_SEQUENCES", "SCHEMA_VERSION", "build"]


def stats_dict(stats) -> dict:
    """GetStats as plain JSON values; the disk tier's (a message) as a dict of its counters, when it has one."""
    out = {}
    for f in stats.DESCRIPTOR.fields:
        v = getattr(stats, f.name)
        if f.message_type is not None:
            if not stats.HasField(f.name):
                continue
            v = {g.name: getattr(v, g.name) for g in v.DESCRIPTOR.fields}
        out[f.name] = v
    return out
