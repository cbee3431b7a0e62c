"""The scheduler: waiting and running queues, the token budget, admission, chunked prefill, preemption order.

It decides, the engine executes (vLLM v1's ``schedule`` / ``update_from_output``
split; nano-vllm's scheduler in small). :meth:`Scheduler.schedule` takes the pool's
free capacity and returns a :class:`SchedulerOutput`: which sequences compute how
many tokens this step, and which requests it admitted. It calls no service: other
leases share the pool, so the engine may still meet OUT_OF_BLOCKS, and then calls
:meth:`Scheduler.preempt` (a running request, recomputed later, or with
``preemption_mode="swap"`` swapped out to the host tier and swapped back in when
readmitted) or :meth:`Scheduler.unadmit` (a request admitted this step, which waits again).

NOTE: invariants
- A request is in exactly one of ``waiting`` and ``running`` (admission order), or
  in neither once finished. ``waiting`` is FCFS (preempted and unadmitted requests go
  back to the front), or under the "priority" policy sorted by (priority, arrival)
  wherever a request goes back (vLLM's priority queue).
- A SWAPPED request holds live (swapped-out) sequences in the memory service: it
  is in ``waiting``, or in ``running`` between its admission and the engine's
  swap-in in the same step (SchedulerOutput.swapped).
- Only :meth:`add`, :meth:`abort` and :meth:`has_work` may run on other threads;
  they and every change of ``waiting`` take the lock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from client.engine.placement import WorkerPlacement
from client.engine.scheduler_types import (
    PREEMPTION_MODES,
    ROLES,
    SCHEDULING_POLICIES,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerOutput,
)
from client.request import Request, Status
from pagedkv.runtime.logs import get_logger

log = get_logger("scheduler")


#: Most waiting requests the admission gate may hold in one :meth:`Scheduler.schedule` before the
#: rest of the queue waits for the next step (each gate check is a memory-service call).
MAX_GATE_HELD = 16


class Scheduler(WorkerPlacement):
    """Continuous batching under a token budget and the pool's free blocks.

    Args:
        config: limits and the reservation policy.
        block_size: tokens per KV block.
        max_context: longest sequence, tokens (the model's context capped by the pool).
        num_workers: workers a request may be pinned to (the least loaded at admission).
        worker_roles: each worker's role, "prefill", "decode" or "both" (default: all "both"). A
            request is admitted to a worker that prefills, and handed to one that decodes once its
            prompt is computed (:meth:`hand_off`): both map the same pool, so nothing is copied.

    Raises:
        ValueError: a role list of another length, an unknown role, or no worker for a phase.
    """

    def __init__(self, config: SchedulerConfig, *, block_size: int, max_context: int, num_workers: int,
                 worker_roles: list[str] | None = None):
        self.config = config
        self.block_size = block_size
        self.max_context = max_context
        self.num_workers = num_workers
        roles = list(worker_roles or ["both"] * num_workers)
        if len(roles) != num_workers or not set(roles) <= set(ROLES):
            raise ValueError(f"worker roles {roles}: need one of {ROLES} for each of the {num_workers} workers")
        #: Workers that run prefills, and those that run decodes (a "both" worker is in each).
        self.prefill_workers = [w for w, r in enumerate(roles) if r != "decode"]
        self.decode_workers = [w for w, r in enumerate(roles) if r != "prefill"]
        if not self.prefill_workers or not self.decode_workers:
            raise ValueError(f"worker roles {roles}: at least one worker must prefill and one must decode")
        #: Requests moved from a prefill worker to a decode worker (:meth:`hand_off`).
        self.handoffs = 0
        #: Workers that take no work now (failed: client.engine.failover).
        self.down: set[int] = set()
        self.waiting: collections.deque[Request] = collections.deque()
        #: Asked before a waiting request is admitted; False holds it this step and the others behind it
        #: go first (client.engine.disk.DiskGate: its prompt's blocks are being read from disk). None: none.
        self.admit_gate: Callable[[Request], bool] | None = None
        #: Requests the gate held in the last :meth:`schedule` (they wait; they are not unschedulable).
        self.gate_held = 0
        self.running: list[Request] = []
        self._lock = threading.Lock()
        self._aborts: set[str] = set()

    # ----------------------------------------------------------------- intake
    def add(self, request: Request) -> None:
        """Queue ``request`` at the back of ``waiting`` (thread-safe); under the "priority" policy,
        behind every request of its priority or a lower one.

        Raises:
            ValueError: the prompt cannot fit the context, the reservation policy refuses parallel
                sampling or beam search, or a priority other than 0 under the "fcfs" policy.
        """
        if request.priority and self.config.policy != "priority":
            raise ValueError(f"priority {request.priority}: priority scheduling is not enabled "
                             "(scheduling policy 'priority', pagedkv serve --scheduling-policy priority)")
        policy = self.config.reservation
        if self.reservation(request) is not None and (request.params.n > 1 or request.params.use_beam_search):
            raise ValueError(f"the {policy.name!r} reservation policy takes n=1 requests without beam search")
        if len(request.prompt_token_ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(request.prompt_token_ids)} tokens; the model and pool allow "
                             f"{self.max_context - 1} (max context {self.max_context})")
        with self._lock:
            self._wait(request, front=False)

    def _wait(self, request: Request, front: bool) -> None:
        """Put ``request`` in ``waiting`` (the caller holds the lock): at the front or the back (FCFS),
        or at its place by (priority, arrival) under the "priority" policy."""
        if self.config.policy == "priority":
            key = _priority_key(request)
            at = next((i for i, r in enumerate(self.waiting) if _priority_key(r) > key), len(self.waiting))
            self.waiting.insert(at, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); :meth:`take_aborted` hands it to the engine."""
        with self._lock:
            self._aborts.add(request_id)

    def queues(self) -> tuple[tuple[Request, ...], tuple[Request, ...]]:
        """Copies of ``running`` and ``waiting`` (thread-safe: ``waiting`` is read under the lock,
        ``running`` is copied at once; it changes only on the engine thread)."""
        running = tuple(self.running)
        with self._lock:
            return running, tuple(self.waiting)

    def has_work(self) -> bool:
        """Whether a request waits, runs or awaits its abort (thread-safe)."""
        with self._lock:
            return bool(self.waiting or self.running or self._aborts)

    def may_admit(self) -> bool:
        """Whether :meth:`schedule` may admit a waiting request now (one waits and a running slot is
        free): only then does it need the pool's free blocks (a step that only continues running
        requests skips the GetStats; their growth is checked by AppendSlots)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def take_aborted(self) -> list[Request]:
        """Remove the requests aborted since the last call from the queues and return them."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if not aborts:
                return []
            victims = [r for r in [*self.running, *self.waiting] if r.request_id in aborts]
            for r in victims:
                if r in self.running:
                    self.running.remove(r)
                else:
                    self.waiting.remove(r)
        return victims

    def reservation(self, request: Request) -> int | None:
        """Tokens ``request`` reserves at admission (capped by the context); None: blocks on demand."""
        reserve = self.config.reservation.reserve(len(request.prompt_token_ids), request.params.max_tokens)
        return None if reserve is None else min(reserve, self.max_context)

    # --------------------------------------------------------------- schedule
    def schedule(self, available_blocks: int) -> SchedulerOutput:
        """Plan one step.

        Running requests come first: one decode token per sequence, then the rest of
        chunked prefills, under ``max_num_batched_tokens``. Then waiting requests are
        admitted in order while the budget, ``max_num_seqs`` and the free blocks allow:
        ``available_blocks`` less what this step's running sequences will grow by. A
        swapped-out request needs a block for every distinct entry of its sequences' block
        tables (some may still be on the device, which the scheduler cannot know: vLLM's
        ``can_swap_in`` counts the same way) plus its chunks' growth past them.

        Args:
            available_blocks: the pool's free blocks (GetStats), shared with other leases;
                0 when unknown (nothing is admitted).
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for want_decode in (True, False):
            for req in self.running:
                for seq in req.live_seqs():
                    n = seq.pending()
                    if n == 0 or (n == 1) != want_decode or budget == 0:
                        continue
                    n = min(n, budget)
                    scheduled.append(ScheduledSeq(req, seq, n))
                    budget -= n
        admitted: list[Request] = []
        swapped: list[Request] = []
        held: list[Request] = []  # waiting for their prompt's blocks (the admission gate): the others go first
        free_blocks = available_blocks - self._growth(scheduled)
        with self._lock:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if self.admit_gate is not None and not self.admit_gate(req):
                    held.append(self.waiting.popleft())
                    if len(held) >= MAX_GATE_HELD:  # one memory-service call each: the queue's rest waits
                        break
                    continue
                chunks = []
                for seq in req.live_seqs():
                    n = min(seq.pending(), budget - sum(chunks))
                    if n > 0:
                        chunks.append(n)
                reserve = self.reservation(req)
                if req.status == Status.SWAPPED:
                    need = self._swap_in_need(req, chunks)
                elif reserve is not None:
                    chunks = chunks[:1]
                    need = -(-reserve // self.block_size)
                else:
                    need = sum(-(-n // self.block_size) for n in chunks)
                if not chunks or need > free_blocks:
                    break
                self.waiting.popleft()
                free_blocks -= need
                budget -= sum(chunks)
                if req.status == Status.SWAPPED:
                    swapped.append(req)
                self._admit(req)
                admitted.append(req)
                it = iter(chunks)
                for seq in req.live_seqs():
                    if seq.pending() > 0:
                        scheduled.append(ScheduledSeq(req, seq, next(it, 0)))
                scheduled = [x for x in scheduled if x.num_new_tokens > 0]
            for r in reversed(held):
                self._wait(r, front=True)
            self.gate_held = len(held)
        return SchedulerOutput(scheduled, admitted, swapped)

    def _growth(self, scheduled: list[ScheduledSeq]) -> int:
        """Blocks the appends of ``scheduled`` sequences that hold blocks may take."""
        grow = 0
        for x in scheduled:
            s = x.seq
            if s.seq_id is not None:
                have = len(s.block_table) * self.block_size
                grow += max(0, -(-(s.num_computed + x.num_new_tokens - have) // self.block_size))
                grow += len(x.request.seqs) > 1  # a forked sequence may copy its shared last block
        return grow

    def _swap_in_need(self, req: Request, chunks: list[int]) -> int:
        """Device blocks a swapped-out request may need to swap in and compute ``chunks`` (one per
        live sequence with pending tokens, in order): every distinct block of its tables, plus what
        each chunk grows past its table."""
        need = len({b for s in req.seqs if s.seq_id is not None for b in s.block_table})
        it = iter(chunks)
        for s in req.live_seqs():
            if s.pending() > 0:
                n = next(it, 0)
                need += max(0, -(-(s.num_computed + n) // self.block_size) - len(s.block_table))
        return need

    def _admit(self, req: Request) -> None:
        """Move ``req`` to running and pin it to the least loaded worker (first admission only); a
        swapped-out request stays SWAPPED until the engine swaps it in (:meth:`swapped_in`)."""
        if req.status != Status.SWAPPED:
            req.status = Status.RUNNING
        if req.worker is None:
            req.worker = self._least_loaded(self.prefill_workers)
        if req.metrics.first_scheduled is None:
            req.metrics.first_scheduled = time.time()
        self.running.append(req)

    # ------------------------------------------------------ shortfall, endings
    def pick_victim(self, scheduled: list[ScheduledSeq]) -> Request | None:
        """The running request in ``scheduled`` to preempt: the most recently admitted (vLLM's FCFS
        order), or under the "priority" policy the one with the highest (priority, arrival), the
        least urgent and latest (vLLM v1); None when it is the only one (preempting it would free
        nothing for another)."""
        live = [r for r in self.running if any(x.request is r for x in scheduled)]
        if len(live) <= 1:
            return None
        if self.config.policy != "priority":
            return live[-1]
        return max(enumerate(live), key=lambda x: (*_priority_key(x[1]), x[0]))[1]  # ties: the later admitted

    def preempt(self, request: Request, swap: bool = False) -> None:
        """Preempt ``request``: it waits at the front of ``waiting``.

        By recompute (the engine freed its sequences): it forgets its KV, and its tokens are
        computed again when it is readmitted. By swap (``swap``: the engine swapped its sequences
        out to the host tier): it keeps its sequences' ids, block tables and ``num_computed``,
        with status SWAPPED, and is swapped in when readmitted (vLLM's swap preemption).
        """
        if swap:
            for s in request.seqs:
                s.grant = None  # a swap-in brings the next one
            request.status = Status.SWAPPED
            request.metrics.swaps += 1
        else:
            for s in request.seqs:
                s.reset()
            request.status = Status.WAITING
        self.running.remove(request)
        request.metrics.preemptions += 1
        with self._lock:
            self._wait(request, front=True)
        log.info("preempted", request_id=request.request_id, mode="swap" if swap else "recompute",
                 generated=[len(s.generated) for s in request.seqs])

    def swapped_in(self, request: Request) -> None:
        """The engine swapped ``request``'s sequences back in: it runs."""
        request.status = Status.RUNNING

    def swap_in_done(self, unadmitted: list[tuple[Request, bool]], swapped_in: list[Request]) -> None:
        """Apply a swap-in's outcome (client.engine.swap.SwapIn): each of ``unadmitted`` leaves the step
        and waits at the front, in order (``(request, recomputed)``: :meth:`recompute_swapped` first
        when its KV was lost); each of ``swapped_in`` runs."""
        for r, recomputed in unadmitted:
            if recomputed:
                self.recompute_swapped(r)
            self.unadmit(r)
        for r in swapped_in:
            self.swapped_in(r)

    def recompute_swapped(self, request: Request) -> None:
        """A swapped-out ``request`` lost its KV (the engine freed its sequences: SWAP_LOST): it
        forgets its block tables and computes its tokens again, keeping its place in the queues."""
        for s in request.seqs:
            s.reset()
        request.status = Status.RUNNING if request in self.running else Status.WAITING

    def requeue_running(self) -> list[Request]:
        """Recompute every running request: the lease that held their blocks is gone (client.engine.recovery).

        Like :meth:`preempt` for all of them at once, but not counted as preemptions: each forgets
        its KV (its tokens stay, so it resumes where it was) and they wait at the front of
        ``waiting`` in admission order, ahead of the requests that were already waiting.
        Swapped-out requests in ``waiting`` lost their sequences too: they stay where they are,
        recomputed. Returns the running ones in admission order, then the swapped-out ones.
        """
        with self._lock:
            requeued, self.running = self.running, []
            swapped = [r for r in self.waiting if r.status == Status.SWAPPED]
            for r in [*requeued, *swapped]:
                for s in r.seqs:
                    s.reset()
                r.status = Status.WAITING
            for r in reversed(requeued):
                self._wait(r, front=True)
        return [*requeued, *swapped]

    def unadmit(self, request: Request) -> None:
        """Undo this step's admission of ``request`` (its allocation or swap-in failed): it waits at
        the front (still SWAPPED if it was not swapped in)."""
        self.running.remove(request)
        if request.status != Status.SWAPPED:
            request.status = Status.WAITING
        with self._lock:
            self._wait(request, front=True)

    def finish(self, request: Request) -> None:
        """``request`` ended (finished or failed): it leaves ``running``."""
        if request in self.running:
            self.running.remove(request)

    def stalled(self) -> bool:
        """Nothing runs while requests wait: the head of ``waiting`` did not fit the free blocks."""
        with self._lock:
            return not self.running and bool(self.waiting)

    def head(self) -> Request | None:
        """The head of ``waiting``, or None."""
        with self._lock:
            return self.waiting[0] if self.waiting else None

    def pop_waiting(self) -> Request:
        """Remove and return the head of ``waiting`` (a request that can never fit)."""
        with self._lock:
            return self.waiting.popleft()

    def drain(self) -> list[Request]:
        """Empty both queues; returns the requests that were running, then those waiting."""
        with self._lock:
            reqs = [*self.running, *self.waiting]
            self.running.clear()
            self.waiting.clear()
        return reqs


def _priority_key(request: Request) -> tuple[int, float]:
    """The "priority" policy's order: lower priority value first, then earlier arrival."""
    return request.priority, request.metrics.arrival


__all__ = ["PREEMPTION_MODES", "ROLES", "SCHEDULING_POLICIES", "ScheduledSeq", "Scheduler", "SchedulerConfig",
           "SchedulerOutput"]
