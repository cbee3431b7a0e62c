"""Recovery from a lost lease or a new pool generation: a new lease, and the running requests recomputed.

A client's lease ends when the memory service restarts (the new process knows no lease, and
its pool has a new generation) or when the lease expires (no keep-alive within its TTL, e.g.
after a long pause); every block its sequences held is gone with it. The engine finds out by

- a memory-service call refused with ErrorInfo reason ``LEASE_NOT_FOUND`` or ``LEASE_EXPIRED``
  (or the lease's keep-alive thread meeting one: :attr:`client.lease.Lease.lost`),
- a worker's Step refused with ``POOL_GENERATION_MISMATCH`` or ``POOL_NOT_MAPPED``,
- GetStats reporting a pool generation other than the one the engine steps,
- UNAVAILABLE from the memory service or a worker (it stopped, or the connection broke).

:meth:`Recovery.recover` then runs on the engine thread, between steps::

    1. release  the old lease (stops its keep-alives; frees its blocks if the service still has it)
    2. wait     until the memory service is SERVING, its layout equals the engine's (else
                every request fails: LayoutChanged), every worker that answers maps its pool
                generation (GetModelInfo.pool_generation; at least one must answer: one that does
                not is failed over from at its next step, client.engine.failover) and a new
                lease is created; each try that
                fails waits 0.1 s, doubling to 2 s, with a log line; at most ``timeout`` seconds
    3. requeue  every running request waits again at the front of the queue, recomputed
                (Scheduler.requeue_running: like a preemption); a fork planned by the
                failed step is applied without blocks (client.engine.beam.ForkPlan.apply)
    4. count    Recovery.recoveries += 1 and a ``lease_recovered`` log line; the engine takes
                the new lease and pool generation from the :class:`Recovered` returned

Why the outputs equal an undisturbed run's: a request keeps its tokens (prompt and generated),
only its KV is recomputed, as after a preemption by recompute; a draw for output position t
depends only on (seed + sample index, t) (compute_service.sampling), so greedy and seeded
requests resume on the same tokens. A step whose tokens were sampled before the failure keeps
them (they came from KV the step computed); a step that failed before sampling is computed
again. Parallel samples that had not forked yet fork without blocks (each child recomputes the
prompt); beams continue from the candidates already scored, each beam recomputing its own
tokens. Recomputation runs the same tokens through a different batch and chunking, so logits
may differ in the last bits: a near tie may in rare cases pick another token, exactly as after
a preemption.

Recoveries that follow each other with no step completed in between are bounded
(:data:`MAX_CONSECUTIVE`); past that the error goes to the caller, which fails every request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from client.errors import FailedPrecondition, ServiceError, Unavailable
from client.lease import Lease
from client.ops.stack import serving
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.errors import LEASE_EXPIRED, LEASE_NOT_FOUND, POOL_GENERATION_MISMATCH, POOL_NOT_MAPPED
from pagedkv.runtime.logs import get_logger

if TYPE_CHECKING:
    from client.engine.beam import ForkPlan
    from client.request import Request
    from client.services import MemoryClient, WorkerClient

log = get_logger("recovery")

#: ErrorInfo reasons that mean the engine's lease or pool generation is gone.
LOST_REASONS = frozenset({LEASE_NOT_FOUND, LEASE_EXPIRED, POOL_GENERATION_MISMATCH, POOL_NOT_MAPPED})
#: Recoveries in a row, with no step completed between them, before the error goes to the caller.
MAX_CONSECUTIVE = 3
#: Seconds between tries while waiting: the first, and the most (it doubles up to it).
FIRST_BACKOFF, MAX_BACKOFF = 0.1, 2.0
#: Default bound on one recovery's wait, seconds.
DEFAULT_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class Recovered:
    """What a recovery got, for the engine to apply."""

    #: The new lease (the old one is released).
    lease: Lease
    #: The pool generation the engine's steps carry from now on.
    generation: int


class LayoutChanged(FailedPrecondition):
    """The memory service came back with another pool layout: the engine cannot carry on."""


def is_lost(error: BaseException) -> bool:
    """Whether ``error`` means the lease or the pool generation is gone (the module's list)."""
    return isinstance(error, ServiceError) and (
        error.code == grpc.StatusCode.UNAVAILABLE or error.reason in LOST_REASONS)


class Recovery:
    """Recovers an engine from a lost lease or a new pool generation (the module's procedure).

    Args:
        memory: the engine's memory-service client.
        workers: the engine's workers (each must map the pool's new generation).
        lease: returns the engine's lease now (its ``lost`` is checked before each step).
        pool: the pool descriptor the engine started with (its layout must stay the same).
        lease_ttl: the TTL to ask for each new lease, seconds (None: the service's default).
        timeout: most seconds one recovery waits for the services (> 0).

    Raises:
        ValueError: ``timeout`` <= 0.
    """

    def __init__(self, memory: MemoryClient, workers: list[WorkerClient], lease: Callable[[], Lease],
                 pool: mpb.PoolDescriptor, lease_ttl: float | None = None, timeout: float = DEFAULT_TIMEOUT):
        if timeout <= 0:
            raise ValueError(f"recovery timeout must be > 0 seconds, got {timeout}")
        self.memory, self.workers, self.lease = memory, workers, lease
        #: Times a lost lease or a new pool generation was recovered from.
        self.recoveries = 0
        self.layout = pool.layout
        #: Pool generation the engine's steps carry now.
        self.generation = pool.generation
        self.lease_ttl = lease_ttl
        self.timeout = timeout
        #: A fork planned by the step in flight and not applied yet (set by Engine._fork).
        self.fork_in_flight: ForkPlan | None = None
        self._consecutive = 0
        self._cancel = threading.Event()
        #: The loss a recovery could not recover from within its timeout (None: none pending).
        self._unrecovered: ServiceError | None = None

    # ------------------------------------------------------------- detection
    def check_lease(self) -> None:
        """Raise the error the lease's keep-alive thread met, if it found the lease gone; or the one
        a recovery that timed out left (its lease is released: the next step recovers afresh, so no
        outage, however long, leaves the engine on a lease the memory service no longer honours)."""
        lost = self.lease().lost or self._unrecovered
        if lost is not None:
            raise lost

    def check_generation(self, generation: int) -> None:
        """Raise when the memory service reports another pool generation than the steps carry.

        Raises:
            FailedPrecondition: reason POOL_GENERATION_MISMATCH.
        """
        if generation != self.generation:
            raise FailedPrecondition(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the memory service's pool generation is {generation}, the engine's {self.generation}: "
                "the memory service restarted", POOL_GENERATION_MISMATCH)

    def step_done(self) -> None:
        """A step completed: recoveries in a row start counting again."""
        self._consecutive = 0

    def cancel(self) -> None:
        """Stop waiting (the client is closing): a recovery in progress raises Unavailable."""
        self._cancel.set()

    # -------------------------------------------------------------- recovery
    def recover(self, cause: ServiceError, requeue: Callable[[], list[Request]]) -> Recovered:
        """Recover from ``cause`` (the module's procedure), or raise it when it is not a lost lease
        or pool, or when recoveries keep failing. ``requeue``: the scheduler's requeue_running.
        Returns the new lease and pool generation, which the engine takes.

        Raises:
            ServiceError: ``cause`` itself (not :func:`is_lost`, or :data:`MAX_CONSECUTIVE` in a row).
            Unavailable: the services did not come back within ``timeout`` seconds, or :meth:`cancel`.
            LayoutChanged: the memory service came back with another layout.
        """
        plan, self.fork_in_flight = self.fork_in_flight, None
        if not is_lost(cause):
            raise cause
        self._consecutive += 1
        if self._consecutive > MAX_CONSECUTIVE:
            self._consecutive = 0
            log.error("recovery_gave_up", recoveries_in_a_row=MAX_CONSECUTIVE, error=str(cause))
            raise cause
        old = self.lease()
        log.warning("lease_lost", lease_id=old.lease_id, generation=self.generation, reason=cause.reason,
                    code=cause.code.name, error=cause.message)
        old.close()
        try:
            pool, lease = self._wait_for_services()
        except ServiceError:
            self._consecutive = 0  # the caller fails every request: the next recovery starts afresh
            self._unrecovered = cause
            raise
        self._unrecovered = None
        self.generation = pool.generation
        requeued = requeue()
        if plan is not None:  # every parent forgot its blocks: the branches start without any
            plan.apply([])
        self.recoveries += 1
        log.warning(
            "lease_recovered",
            old_lease_id=old.lease_id,
            lease_id=lease.lease_id,
            generation=pool.generation,
            requeued=[r.request_id for r in requeued],
            branches_without_blocks=len(plan.branches) if plan else 0,
            recoveries=self.recoveries,
        )
        return Recovered(lease, pool.generation)

    def _wait_for_services(self) -> tuple[mpb.PoolDescriptor, Lease]:
        """Wait until the memory service serves the engine's layout, every worker maps its
        generation and a lease is created; returns the pool descriptor and the new lease."""
        deadline = time.monotonic() + self.timeout
        delay, tries = FIRST_BACKOFF, 0
        while True:
            tries += 1
            waiting_for = "the client to stay open" if self._cancel.is_set() else self._try_services()
            if isinstance(waiting_for, tuple):
                return waiting_for
            left = deadline - time.monotonic()
            if left <= 0 or self._cancel.is_set():
                why = "the client is closing" if self._cancel.is_set() else f"not ready within {self.timeout:g} s"
                raise Unavailable(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the engine lost its lease and could not get a new one ({why}): {waiting_for}; "
                    f"check the memory service at {self.memory.address} and the workers, then "
                    "submit the requests again",
                )
            log.info("recovery_waiting", tries=tries, retry_in=round(delay, 2), waiting_for=waiting_for)
            self._cancel.wait(min(delay, left))
            delay = min(delay * 2, MAX_BACKOFF)

    def _try_services(self) -> tuple[mpb.PoolDescriptor, Lease] | str:
        """One try: the pool descriptor and a new lease when everything is ready, else what is not."""
        memory = self.memory
        if not serving(memory.channel, timeout=2):
            return f"the memory service at {memory.address} to serve"
        try:
            pool = memory.pool()
        except ServiceError as e:
            return f"the memory service's pool descriptor ({e})"
        if pool.layout != self.layout:
            raise LayoutChanged(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the memory service at {memory.address} came back with pool layout {_text(pool.layout)}, "
                f"but this client started with {_text(self.layout)}; restart the memory service with the "
                "earlier layout, or create a new client",
                "LAYOUT_CHANGED",
            )
        unreachable = []
        for i, w in enumerate(self.workers):
            try:
                mapped = w.model_info(timeout=2.0).pool_generation
            except ServiceError as e:  # gone: the engine fails over from it (client.engine.failover)
                unreachable.append(f"worker {i} at {w.address} ({e})")
                continue
            if mapped != pool.generation:
                return f"worker {i} at {w.address} to map pool generation {pool.generation} (it maps {mapped})"
        if len(unreachable) == len(self.workers):
            return "; ".join(unreachable)
        try:
            lease = Lease(memory, self.lease_ttl)
        except ServiceError as e:
            return f"a new lease ({e})"
        return pool, lease


def _text(layout: mpb.PoolLayout) -> str:
    """``layout`` on one line."""
    return "{" + ", ".join(f"{f.name}={v}" for f, v in layout.ListFields()) + "}"
