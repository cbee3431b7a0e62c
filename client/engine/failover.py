"""Worker failover: a worker that stops answering costs the step it had in flight, nothing more.

Every worker of a node maps the same pool, so a sequence's proven KV does not live in the worker
that computed it. When a worker's Step fails with UNAVAILABLE (the process died, the connection
broke) or DEADLINE_EXCEEDED (it hung past the step timeout), :meth:`Failover.fail_over` runs on
the engine thread, between steps::

    1. mark     the worker down: no request is pinned to it, nothing is sent to it
    2. move     each sequence its lost step ran gets a failover fork (ForkSequences with
                proven_only): a child holding the proven tokens and the blocks that hold them;
                the sequence goes on as the child on a live worker, recomputing only the lost
                step's tokens (its partly filled last block is copied on its next append)
    3. hold     the parents stay allocated (quarantined): their blocks past the proven tokens
                are the ones the lost step may still write if its worker wakes up, so nobody
                else is handed them
    4. repin    every request pinned to the worker (running, waiting, swapped) moves to the
                least loaded live worker

A step that had a copy-on-write copy for a sequence on the lost worker left the copy undone:
that sequence's new block does not hold its proven KV, so its request is recomputed instead
(its old sequence is quarantined all the same).

``Failover(migrate="recompute")`` (or setting :attr:`Failover.migrate` on a running engine) sends
every request of the lost step that way instead of forking it: it is prefilled again on a live
worker, prompt and generated tokens, as request migration does where a worker's KV dies with it.
It is the baseline of ``benchmarks/bench_failover.py``, not a mode to serve with: it computes
again what the pool still holds (the pool's prefix cache gives back its full blocks, when on).

Down workers are probed between steps (GetModelInfo, at most every :data:`PROBE_INTERVAL`
seconds); one that maps the engine's pool generation again is ready. Its quarantined sequences
are freed once no step of the lost one can still write: the worker at that address is another
process (a new ``instance_id``) or has completed a step since it came back (a worker computes one
step at a time). With no worker ready the engine waits; past the recovery timeout it fails the
requests it holds and keeps its lease, so the next request runs once a worker is back.

The lease is never released for a worker failure, and no other sequence's blocks are touched.

Drain (:meth:`Failover.request`, applied on the engine thread between two steps): the worker takes
no more work and every request pinned to it moves to the others. No step of it is in flight then,
so nothing is copied or computed again; the worker can stop. A drain ends with undrain, or when
the worker at that address is another process (a restart).
"""

from __future__ import annotations

import collections
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from client.engine.scheduler import ScheduledSeq, Scheduler
from client.engine.stats import WorkerInfo
from client.errors import ServiceError, Unavailable
from client.request import Request
from client.services import MemoryClient, WorkerClient
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.limits import MAX_BATCH
from pagedkv.runtime.logs import get_logger

log = get_logger("failover")

#: Step errors that mean the worker is gone or hung (anything else is the request's or the pool's).
WORKER_FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.CANCELLED})
#: Seconds a Step may take before its worker counts as hung (Client(step_timeout=), --step-timeout).
DEFAULT_STEP_TIMEOUT = 600.0
#: Seconds between two probes of the down workers.
PROBE_INTERVAL = 0.5
#: How a failed worker's requests go on (Failover's ``migrate``): from their KV, or prefilled again.
MIGRATE_MODES = ("fork", "recompute")


def is_worker_failure(error: BaseException) -> bool:
    """Whether a Step's ``error`` means its worker is gone or hung (the module's codes)."""
    return isinstance(error, ServiceError) and error.code in WORKER_FAILURE_CODES


class WorkersDown(Unavailable):
    """No worker came back within the recovery timeout: the engine fails the requests it holds and
    keeps its lease (the next request runs once a worker serves again)."""


@dataclass(slots=True)
class WorkerState:
    """What the engine knows of one worker."""

    #: "ready", "down" or "draining".
    state: str = "ready"
    #: The worker process last seen at the address (GetModelInfoResponse.instance_id).
    instance_id: str = ""
    #: When it entered ``state`` (time.monotonic()); 0: ready since the engine started.
    since: float = 0.0
    #: Times it failed over, and times it came back as another process.
    failures: int = 0
    restarts: int = 0
    #: Sequences its lost steps may still write: freed once that is impossible (the module's rule).
    quarantine: list[int] = field(default_factory=list)
    #: Its host tier is page-locked (GetModelInfoResponse.host_tier_page_locked); None: not applicable.
    host_tier_page_locked: bool | None = None


def _page_locked(info) -> bool | None:
    """GetModelInfoResponse.host_tier_page_locked, None when unset (a CPU pool, no host tier)."""
    return info.host_tier_page_locked if info.HasField("host_tier_page_locked") else None


class Failover:
    """Tracks the workers' health and moves the sequences of a failed one (the module's procedure).

    Args:
        memory: the engine's memory-service client.
        workers: the engine's workers, by index.
        scheduler: the engine's scheduler (its pins and its set of down workers).
        lease_id: returns the engine's lease id now.
        generation: returns the pool generation the engine's steps carry now.
        timeout: seconds the engine waits with no worker ready before failing its requests.
        infos: each worker's GetModelInfoResponse at the start (its process's instance_id, its host tier).
        migrate: how the lost step's requests go on: "fork" (proven-only forks, the module's
            procedure) or "recompute" (prefilled again: the benchmark's baseline, see the module).

    Raises:
        ValueError: an unknown ``migrate``.
    """

    def __init__(self, memory: MemoryClient, workers: list[WorkerClient], scheduler: Scheduler,
                 lease_id: Callable[[], str], generation: Callable[[], int], timeout: float,
                 infos: list, migrate: str = "fork"):
        if migrate not in MIGRATE_MODES:
            raise ValueError(f"migrate must be one of {', '.join(MIGRATE_MODES)}, got {migrate!r}")
        self.memory, self.workers, self.scheduler = memory, workers, scheduler
        self.lease_id, self.generation, self.timeout = lease_id, generation, timeout
        #: "fork" or "recompute" (the constructor's ``migrate``; read at each failover).
        self.migrate = migrate
        self.states = [WorkerState(instance_id=i.instance_id, host_tier_page_locked=_page_locked(i)) for i in infos]
        #: Failovers done (one per failed worker and step).
        self.failovers = 0
        self._next_probe = 0.0
        #: Since when the engine waits with no worker ready (None: it does not).
        self._waiting_since: float | None = None
        #: Drains and undrains asked from other threads: (worker address, drain?, reply).
        self._requests: queue.SimpleQueue[tuple[str, bool, Future]] = queue.SimpleQueue()

    @property
    def ready(self) -> list[int]:
        """Indexes of the workers that take work."""
        return [i for i, s in enumerate(self.states) if s.state == "ready"]

    def info(self, running: tuple[Request, ...], waiting: tuple[Request, ...]) -> tuple[WorkerInfo, ...]:
        """Each worker as the front reads it (client.engine.stats), with the ``running`` and ``waiting``
        requests pinned to it (thread-safe: a request's worker is read once)."""
        requests, sequences, queued = collections.Counter(), collections.Counter(), collections.Counter()
        for r in running:
            w = r.worker
            requests[w] += 1
            sequences[w] += len(r.live_seqs())
        for r in waiting:
            queued[r.worker] += 1
        return tuple(WorkerInfo(c.address, s.state, since=s.since, requests=requests[w], sequences=sequences[w],
                                waiting=queued[w], failures=s.failures, restarts=s.restarts, instance_id=s.instance_id,
                                host_tier_page_locked=s.host_tier_page_locked)
                     for w, (c, s) in enumerate(zip(self.workers, self.states)))

    @staticmethod
    def _enter(s: WorkerState, state: str) -> None:
        """Put a worker in ``state``; its ``since`` moves only when the state changes."""
        if s.state != state:
            s.state, s.since = state, time.monotonic()

    # ---------------------------------------------------------------- failure
    def fail_over(self, failed: dict[int, ServiceError], scheduled: list[ScheduledSeq],
                  copies_by_worker: dict[int, list[tuple[int, int]]],
                  recompute: Callable[[Request], None]) -> tuple[list[ScheduledSeq], int]:
        """Mark the ``failed`` workers down and move their requests (the module's procedure).

        Args:
            failed: worker index -> the error its Step met.
            scheduled: the step's sequences.
            copies_by_worker: the step's copy-on-write pairs by worker.
            recompute: preempts a request by recompute (its sequences are quarantined, not freed):
                the lost step's requests whose copy-on-write copy was lost, every one of them with
                ``migrate`` "recompute".

        Returns:
            the step's sequences on the other workers (their results stand), and the tokens that
            will be computed again (the lost steps', and the recomputed requests' computed ones).

        Raises:
            client.errors.ServiceError: the memory service refused the failover forks.
        """
        for w, error in failed.items():
            s = self.states[w]
            self._enter(s, "down")
            s.failures += 1
            self.scheduler.down.add(w)
            log.warning("worker_failed", worker=self.workers[w].address, code=error.code.name, error=error.message)
        kept = [x for x in scheduled if x.request.worker not in failed]
        dsts = {d for w in failed for _, d in copies_by_worker.get(w, ())}
        by_request: dict[int, tuple[Request, list[ScheduledSeq]]] = {}
        for x in scheduled:
            if x.request.worker in failed:
                by_request.setdefault(id(x.request), (x.request, []))[1].append(x)
        moved, recomputed, forks, tokens = [], [], [], 0
        for req, xs in by_request.values():
            tokens += sum(x.num_new_tokens for x in xs)
            lost_copy = any(dsts & set(x.seq.block_table) for x in xs)  # its copy-on-write copy was lost
            if lost_copy or self.migrate == "recompute":
                tokens += sum(s.num_computed for s in req.seqs)
                self.states[req.worker].quarantine += req.seq_ids()
                recompute(req)
                recomputed.append(req)
            else:
                forks += [(req.worker, x.seq) for x in xs]
                moved.append(req)
        tokens += self._fork_proven(forks)
        for w in failed:
            moved += [r for r in self.scheduler.repin(w) if r not in moved and r not in recomputed]
        self.failovers += len(failed)
        log.warning("failover", workers=[self.workers[w].address for w in failed],
                    moved=[r.request_id for r in moved], recomputed_requests=[r.request_id for r in recomputed],
                    recomputed_tokens=tokens, ready=len(self.ready))
        return kept, tokens

    def _fork_proven(self, forks: list[tuple[int, object]]) -> int:
        """Give each (worker, sequence) a failover fork; the parent goes to that worker's quarantine.
        Returns the tokens the children hold fewer than their sequences had computed (a block whose
        copy-on-write was not proven: the memory service leaves it out), computed again."""
        again = 0
        for at in range(0, len(forks), MAX_BATCH):
            chunk = forks[at:at + MAX_BATCH]
            resp = self.memory.fork(self.lease_id(), [seq.seq_id for _, seq in chunk], proven_only=True)
            for (w, seq), child, grant in zip(chunk, resp.children, resp.grants):
                self.states[w].quarantine.append(seq.seq_id)
                seq.seq_id, seq.block_table, seq.grant = child.seq_id, list(child.block_ids), grant
                again += seq.num_computed - child.num_tokens
                seq.num_computed = child.num_tokens
        return again

    # ------------------------------------------------------------------- drain
    def request(self, address: str, drain: bool) -> Future:
        """Ask (thread-safe) to drain or undrain the worker at ``address``; the future's result is
        ``{"worker", "state", "moved_sequences"}`` once the engine applied it between two steps.
        It fails with KeyError for an address that is not one of the engine's workers."""
        reply: Future = Future()
        self._requests.put((address, drain, reply))
        return reply

    def pending(self) -> bool:
        """Whether a drain or undrain waits to be applied."""
        return not self._requests.empty()

    def apply_requests(self) -> None:
        """On the engine thread, between two steps: apply the drains and undrains asked."""
        while not self._requests.empty():
            address, drain, reply = self._requests.get()
            w = next((i for i, c in enumerate(self.workers) if c.address == address), None)
            if w is None:
                reply.set_exception(KeyError(f"{address} is not one of this engine's workers: "
                                             + ", ".join(c.address for c in self.workers)))
                continue
            s, moved = self.states[w], 0
            if drain and s.state != "down":
                self._enter(s, "draining")
                self.scheduler.down.add(w)
                moved = sum(len(r.live_seqs()) for r in self.scheduler.repin(w))
            elif not drain and s.state == "draining":
                self._enter(s, "ready")
                self.scheduler.down.discard(w)
            log.warning("worker_drain" if drain else "worker_undrain", worker=address, state=s.state,
                        moved_sequences=moved)
            reply.set_result({"worker": address, "state": s.state, "moved_sequences": moved})

    # ------------------------------------------------------------------ probes
    def probe(self) -> None:
        """Between steps: look at the down workers (at most every :data:`PROBE_INTERVAL` s) and take
        back the ones that map the engine's pool generation; free quarantines no step can write."""
        if all(s.state == "ready" for s in self.states) or time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + PROBE_INTERVAL
        for w, s in enumerate(self.states):
            if s.state == "ready":
                continue
            try:
                info = self.workers[w].model_info(timeout=1.0)
            except ServiceError as e:
                log.info("worker_still_down", worker=self.workers[w].address, code=e.code.name)
                continue
            if info.pool_generation != self.generation():
                log.info("worker_maps_another_pool", worker=self.workers[w].address,
                         generation=info.pool_generation, engine_generation=self.generation())
                continue
            if s.state == "draining" and info.instance_id == s.instance_id:
                continue  # drained until undrained or restarted
            out = time.monotonic() - s.since
            self._enter(s, "ready")
            self.scheduler.down.discard(w)
            restarted = info.instance_id != s.instance_id
            s.instance_id, s.restarts = info.instance_id, s.restarts + restarted
            s.host_tier_page_locked = _page_locked(info)
            log.warning("worker_back", worker=self.workers[w].address, restarted=restarted, down_seconds=round(out, 2))
            if restarted:
                self.release(w)

    def step_done(self, workers: set[int]) -> None:
        """``workers`` completed a step: no earlier step of theirs can still write."""
        for w in workers:
            if self.states[w].quarantine:
                self.release(w)

    def release(self, w: int) -> None:
        """Free worker ``w``'s quarantined sequences (reason ABORTED: their step was lost, they were not
        preempted; best effort: they go with the lease otherwise)."""
        ids, self.states[w].quarantine = self.states[w].quarantine, []
        try:
            for at in range(0, len(ids), MAX_BATCH):
                self.memory.free(self.lease_id(), ids[at:at + MAX_BATCH], mpb.FREE_REASON_ABORTED)
        except ServiceError as e:
            log.warning("quarantine_free_failed", worker=self.workers[w].address, sequences=len(ids), error=str(e))
            return
        log.info("quarantine_freed", worker=self.workers[w].address, sequences=len(ids))

    def forget_quarantines(self) -> None:
        """The lease is gone (a lost-lease recovery): so are the quarantined sequences."""
        for s in self.states:
            s.quarantine = []

    def wait_for_a_worker(self, has_work: bool) -> None:
        """After :meth:`probe` found no worker ready: wait a little, and past the timeout fail what
        the engine holds.

        Raises:
            WorkersDown: no worker ready for ``timeout`` seconds while requests wait.
        """
        if self.ready:
            self._waiting_since = None
            return
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if has_work and now - self._waiting_since > self.timeout:
            self._waiting_since = None  # the next request waits a full timeout again
            raise WorkersDown(grpc.StatusCode.UNAVAILABLE, f"no worker answered within {self.timeout:g} s ("
                              + ", ".join(w.address for w in self.workers) + "); the lease is kept: submit "
                              "the requests again once a worker serves")
        time.sleep(min(PROBE_INTERVAL, 0.1))
