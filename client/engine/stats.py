"""What an engine publishes for the front to read: a frozen snapshot per step, its step log, its limits.

``pagedkv serve`` (its routes, metrics and dashboard) reads these and never the engine's
scheduler, lease or counters: the engine thread owns those. :class:`EngineStats` is built by the
engine at the end of every step and again whenever a request joins the queue (so a front that
checks the queue's length sees every request already accepted); reading it takes no lock.
:class:`StepLog` is the engine's step trace from a step on (``GET /debug/steps``).
:class:`EngineLimits` is fixed at the engine's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from client.request import Request


@dataclass(slots=True)
class StepTrace:
    """What one step ran (for tests, the demo and ``GET /debug/steps``)."""

    step: int
    #: Request ids with a sequence in the batch.
    request_ids: list[str]
    #: Tokens computed (prefill + decode).
    num_tokens: int
    #: Request ids that finished in this step.
    finished: list[str]
    #: Requests preempted in this step (by recompute or by swap).
    preempted: list[str] = field(default_factory=list)
    #: Seconds in the workers' forward (max over workers) and in the whole step.
    model_seconds: float = 0.0
    step_seconds: float = 0.0
    #: Of ``preempted``, those preempted by swap (client.engine.swap).
    swapped: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker as its engine sees it (client.engine.failover), when the stats were published."""

    address: str
    #: "ready" (takes work), "down" (failed; probed until it maps the pool again) or "draining"
    #: (takes no work until undrained or restarted).
    state: str = "ready"
    #: The node whose engine it serves (``pagedkv serve --node NAME=...``); "" for a single engine.
    node: str = ""
    #: When it entered ``state`` (time.monotonic()); 0: ready since the engine started.
    since: float = 0.0
    #: Running requests pinned to it, and their unfinished sequences; waiting requests pinned to it
    #: (preempted or moved ones: a request is pinned at its first admission).
    requests: int = 0
    sequences: int = 0
    waiting: int = 0
    #: Times it failed over (a Step lost), and times it came back as another process.
    failures: int = 0
    restarts: int = 0
    #: The worker process last seen at the address (GetModelInfoResponse.instance_id).
    instance_id: str = ""
    #: Its host tier is page-locked (asynchronous tier copies); False: the memlock limit refused it;
    #: None: a CPU pool or no host tier (GetModelInfoResponse.host_tier_page_locked).
    host_tier_page_locked: bool | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One engine's state after a step (or after a request joined), as the front reads it.

    The request objects are the engine's own (read them, never change them); the tuples are copies.
    """

    #: Steps the engine completed.
    step_count: int = 0
    #: Requests in the running batch (admission order), and waiting for admission (queue order).
    running: tuple[Request, ...] = ()
    waiting: tuple[Request, ...] = ()
    #: Requests preempted, by recompute or by swap; of them by swap; swap preemptions that fell back
    #: to recompute (client.engine.swap).
    preemptions: int = 0
    swaps: int = 0
    swap_fallbacks: int = 0
    #: Times a lost lease or a new pool generation was recovered from (client.engine.recovery).
    lease_recoveries: int = 0
    #: Requests moved from a prefill worker to a decode worker (client.engine.scheduler.Scheduler.hand_off).
    handoffs: int = 0
    #: Tokens read from other nodes' pools, and steps whose node transfer failed (client.engine.transfers).
    tokens_pulled: int = 0
    transfers_failed: int = 0
    #: The engine's lease (its sequences are this engine's) and the lease's secret, which lets
    #: another channel list that lease's sequences (ListSequences). Empty in a :meth:`total`.
    lease_id: str = ""
    lease_secret: str = field(default="", repr=False)
    #: Workers failed over from (client.engine.failover); workers ready to take work, and in all.
    worker_failovers: int = 0
    workers_ready: int = 0
    workers_total: int = 0
    #: Tokens whose KV was computed again, by reason: the lost steps of failed workers, requests
    #: preempted by recompute, requests requeued after a lost lease.
    recomputed_worker_failure: int = 0
    recomputed_preemption: int = 0
    recomputed_lease_lost: int = 0
    #: Each worker, in the engine's order (with ``--node``, node by node).
    worker_info: tuple[WorkerInfo, ...] = ()
    #: When the last step completed (time.monotonic()); 0: none yet.
    last_step_at: float = 0.0

    @property
    def workers(self) -> tuple[tuple[str, str], ...]:
        """Each worker's address and state ("ready", "down" or "draining")."""
        return tuple((w.address, w.state) for w in self.worker_info)

    def on_node(self, name: str) -> EngineStats:
        """These stats with every worker marked as node ``name``'s."""
        return replace(self, worker_info=tuple(replace(w, node=name) for w in self.worker_info))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @classmethod
    def total(cls, parts: list[EngineStats]) -> EngineStats:
        """Several engines' stats as one (a cluster's nodes): queues and workers joined in order, counts
        added, the latest step; no lease. One part is returned as it is."""
        if len(parts) == 1:
            return parts[0]
        summed = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls)
                  if f.name not in ("running", "waiting", "lease_id", "lease_secret", "worker_info", "last_step_at")}
        return cls(running=tuple(r for p in parts for r in p.running),
                   waiting=tuple(r for p in parts for r in p.waiting),
                   worker_info=tuple(w for p in parts for w in p.worker_info),
                   last_step_at=max(p.last_step_at for p in parts), **summed)


@dataclass(frozen=True, slots=True)
class StepLog:
    """An engine's step trace from a given step on."""

    #: Steps the engine completed.
    step_count: int
    #: The traces of the steps asked for, oldest first (the engine keeps the last 100,000).
    steps: list[StepTrace]
    #: (request id, step_count when its abort was asked) of the aborts asked for, oldest first.
    aborts: list[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What an engine serves, fixed at its start."""

    #: The workers' GetModelInfo (one model on every worker).
    model_info: object
    #: Prefix-cache identity of the model's KV: model, resolved revision and KV dtype.
    model_id: str
    #: Longest sequence (prompt + output), tokens: the model's context capped by the pool.
    max_context: int
    #: Tokens per KV block, and blocks in the device pool.
    block_size: int
    num_blocks: int
    #: Seconds a worker's Step may take before the worker counts as hung (client.engine.failover).
    step_timeout: float = 600.0


__all__ = ["EngineLimits", "EngineStats", "StepLog", "StepTrace", "WorkerInfo"]
