"""Step 8 of :meth:`client.engine.core.Engine.step` (vLLM v1's ``update_from_output``): take the
workers' sampled tokens, check stops, advance beams, hand in the receipts and free what finished.

It changes the step's requests and sequences, the scheduler's queues (a finished request leaves
``running``; a prefilled one moves to a decode worker) and hands the receipts to client.engine.commits;
it holds no engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from client.engine.beam import Branching
from client.engine.commits import Commits
from client.engine.scheduler import ScheduledSeq, Scheduler
from client.engine.transfers import PrefixPull
from client.engine.worker_step import StepResults
from client.request import Request, Status
from client.stop import StopChecker


class StepUpdate:
    """Applies one step's results.

    Args:
        scheduler: the engine's scheduler.
        branching: parallel sampling and beams (client.engine.beam).
        stop_checker: appends sampled tokens and checks stops (client.stop).
        commits: the receipts' way to the memory service (client.engine.commits).
        pulls: cross-node prefix reuse (client.engine.transfers), or None.
        free_ids: frees sequences by id (FreeSequences, reason FINISHED).
        fail: ends a request with an error, freeing what it holds: ``fail(request, error, updated)``.
    """

    def __init__(self, scheduler: Scheduler, branching: Branching, stop_checker: StopChecker, commits: Commits,
                 pulls: PrefixPull | None, free_ids: Callable[[list[int]], None],
                 fail: Callable[[Request, Exception, dict], None]):
        self.scheduler, self.branching, self.stop_checker = scheduler, branching, stop_checker
        self.commits, self.pulls, self.free_ids, self.fail = commits, pulls, free_ids, fail

    def apply(self, scheduled: list[ScheduledSeq], results: StepResults, updated: dict) -> list[str]:
        """Take the sampled tokens of ``scheduled`` (each updated request goes in ``updated`` by id);
        free finished sequences; returns the ids of the requests that finished. A request with a
        sequence a worker refused alone (``results.refused``) fails with that error, and only it."""
        if results.refused:
            scheduled = self._fail_refused(scheduled, results.refused, updated)
        now = time.time()
        to_free: list[int] = []
        finished: list[str] = []
        for x in scheduled:
            x.seq.num_computed += x.num_new_tokens
        receipts = [(x, results.by_seq[x.seq.seq_id].receipt) for x in scheduled]
        for x in scheduled:
            req, seq = x.request, x.seq
            res = results.by_seq[seq.seq_id]
            updated[req.request_id] = req
            if self.branching.reached_fork(req, seq) or not res.HasField("token_id"):
                continue
            if req.metrics.first_token is None:
                req.metrics.first_token = now
            if req.beam is not None:
                self.branching.add_candidates(req, seq, res.top_logprobs)
                continue
            self.stop_checker.append(seq, req.params, res)
            if seq.finished and seq.seq_id is not None:
                to_free.append(seq.seq_id)
                seq.seq_id = None
        for req in {id(x.request): x.request for x in scheduled}.values():
            self.scheduler.hand_off(req)  # a prefill worker's request goes on on a decode worker
            to_free.extend(self.branching.advance(req))
            if req.finished and req.status != Status.FINISHED:
                req.status = Status.FINISHED
                req.metrics.finished = now
                self.scheduler.finish(req)
                finished.append(req.request_id)
        # The receipts before any free (a request done in its prefill step still fills the cache);
        # a plain running sequence's wait for the next step's AppendSlots (client.engine.commits).
        self.commits.after_step([(x, r, self._may_wait(x)) for x, r in receipts])
        if self.pulls is not None:  # their blocks are read and proven: the peers' pins go
            self.pulls.release_done([x.seq for x in scheduled])
        self.free_ids(to_free)
        return finished

    def _fail_refused(self, scheduled: list[ScheduledSeq], refused: dict, updated: dict) -> list[ScheduledSeq]:
        """Fail each request with a refused sequence (its first refusal); returns the others' sequences."""
        failed: dict[int, Request] = {}
        for x in scheduled:
            error = refused.get(x.seq.seq_id)
            if error is not None and id(x.request) not in failed:
                failed[id(x.request)] = x.request
                self.fail(x.request, error, updated)
        return [x for x in scheduled if id(x.request) not in failed]

    def _may_wait(self, x: ScheduledSeq) -> bool:
        """Whether ``x``'s receipt may wait for the next AppendSlots: a single-sequence request still
        running that grows on demand (beams, parallel samples and reservations do not append)."""
        req = x.request
        return (x.seq.seq_id is not None and not req.finished and req.beam is None and req.params.n == 1
                and len(req.seqs) == 1 and self.scheduler.reservation(req) is None
                and not (self.pulls is not None and self.pulls.reading(x.seq)))
