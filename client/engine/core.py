"""The client's engine: executes each step's schedule over the memory service and the workers.

One :meth:`Engine.step` (vLLM v1's schedule / execute / update_from_output, split across services)::

    1. free      sequences aborted since the last step            (1 FreeSequences)
    2. fork      parallel-sampling prompts and beams that branch   (client.engine.beam: 1 FreeSequences
                 for dropped beams, 1 ForkSequences)
    3. schedule  client.engine.scheduler, from the pool's free blocks     (1 GetStats, only when a
                 waiting request may be admitted):
                 running requests first (decode tokens, then the rest of chunked
                 prefills), then admit waiting ones, under a token budget
    4. swap in   readmitted swapped-out requests (client.engine.swap)   (1 SwapInSequences, only
                 -> OUT_OF_BLOCKS: unadmit them (they wait)       when one was readmitted)
    5. append    slots for every scheduled, allocated sequence    (1 AppendSlots)
                 -> OUT_OF_BLOCKS: preempt the most recently admitted request by
                    recompute (free its blocks, requeue it at the front), or with
                    preemption_mode "swap" by swap (1 SwapOutSequences: its KV goes
                    to the host tier, it keeps its sequences), and retry
    6. allocate  sequences for newly admitted requests            (1 AllocateSequences)
                 -> OUT_OF_BLOCKS: unadmit the last admitted (it waits) and retry
    7. Step      one call per worker (client.engine.worker_step): copy-on-write pairs,
                 tokens, positions, block tables, grants (with their tier copies),
                 sampling; the worker samples
    8. update    hand in the workers' receipts (computed tokens;   (1 CommitComputedTokens)
                 full blocks enter the prefix cache)
                 append sampled tokens, check stops (client.stop), advance beams;
                 free finished sequences                          (1 FreeSequences)

so a step makes a constant number of memory-service calls (plus one per
preemption) and one Step call per worker. QUOTA_EXCEEDED (the lease at its block or
sequence quota, ``--max-blocks-per-lease``) is met like OUT_OF_BLOCKS in 4-6, and the
longest sequence served is capped by the lease's block quota as by the pool. A lost lease or a new pool generation
met by a step is recovered from before the next (client.engine.recovery): a new lease,
and the running requests recomputed. Requests join between steps and
leave as soon as they finish. Sampling is reproducible without worker state:
the draw for output position t depends on (seed + sample index, t), so a
preempted request resumes on the same draws.
"""

from __future__ import annotations

import collections
import threading
import time

from client.engine.beam import BeamState, Branching
from client.engine.commits import Commits
from client.engine.disk import DISK_POLL, DiskGate, DiskMover
from client.engine.failover import Failover, WorkersDown
from client.engine.preemption import Preemption
from client.engine.recovery import DEFAULT_TIMEOUT as DEFAULT_RECOVERY_TIMEOUT
from client.engine.recovery import Recovery
from client.engine.scheduler import Scheduler, SchedulerConfig
from client.engine.slots import Slots
from client.engine.stats import EngineLimits, EngineStats, StepLog, StepTrace
from client.engine.step_update import StepUpdate
from client.engine.swap import Swapper, check_host_tier
from client.engine.transfers import Peer, PrefixPull
from client.engine.worker_step import StepRunner
from client.errors import OutOfBlocks, QuotaExceeded, ServiceError
from client.lease import Lease
from client.params import model_defaults
from client.request import Request, Status
from client.services import MemoryClient, WorkerClient
from client.stop import StopChecker, context_limit, same_model
from client.structured.grammar import GrammarCompiler
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.model.source import model_identity
from pagedkv.runtime.errors import TRANSFER_FAILED, TRANSFERS_OFF
from pagedkv.runtime.limits import MAX_BATCH
from pagedkv.runtime.logs import get_logger

log = get_logger("engine")

__all__ = ["Engine", "StepTrace"]


class Engine:
    """Runs requests over one memory service and one or more workers.

    Not thread-safe except :meth:`add`, :meth:`abort` and :meth:`has_work`; one thread calls
    :meth:`step` (and :meth:`fail_all`).
    """

    def __init__(self, memory: MemoryClient, workers: list[WorkerClient], tokenizer, *,
                 config: SchedulerConfig | None = None, lease_ttl: float | None = None,
                 max_model_len: int | None = None, recovery_timeout: float = DEFAULT_RECOVERY_TIMEOUT,
                 peers: list[Peer] = (), worker_roles: list[str] | None = None):
        self.memory = memory
        self.workers = workers
        self.tokenizer = tokenizer
        pool = memory.pool()
        self.block_size = pool.layout.block_size
        self.num_blocks = pool.layout.num_blocks
        infos = [w.model_info() for w in workers]
        self.model_info = info = same_model(infos, [w.address for w in workers])
        #: Prefix-cache identity of this model's KV: model, resolved revision and KV dtype.
        self.model_id = model_identity(info.model_name, info.model_source, info.revision, info.dtype)
        self.eos_ids = set(info.eos_token_ids)
        #: The model's request defaults (its generation_config.json), applied at admission (:meth:`add`).
        self.generation_defaults = model_defaults(info.generation_defaults, info.ignored_generation_keys)
        self.lease = Lease(memory, lease_ttl)
        try:  # a sequence longer than the lease's block quota could never finish: the context stops there too
            self.max_context = context_limit(info.max_context, info.sliding_window,
                                             min(self.num_blocks, self.lease.max_blocks or self.num_blocks)
                                             * self.block_size, max_model_len)
            self.scheduler = Scheduler(config or SchedulerConfig(), block_size=self.block_size,  # checks the roles
                                       max_context=self.max_context, num_workers=len(workers),
                                       worker_roles=worker_roles)
        except BaseException:
            self.lease.close()
            raise
        #: The last step's receipts waiting for the next AppendSlots (client.engine.commits).
        self.commits = Commits(memory, lambda: self.lease)
        self.branching = Branching()
        self.stop_checker = StopChecker(self.eos_ids, self.max_context, tokenizer)
        #: Structured output's grammars for this model's vocabulary (client.structured).
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size, self.eos_ids)
        self.step_count = 0
        self.preemption = Preemption(self.scheduler, Swapper(memory, lambda: self.lease.lease_id), self._free,
                                     self.commits.flush)
        check_host_tier(self.scheduler.config.preemption_mode, pool.host_num_blocks)
        self.traces: collections.deque[StepTrace] = collections.deque(maxlen=100_000)
        #: (request id, step_count when its abort was asked), most recent last.
        self.abort_log: collections.deque[tuple[str, int]] = collections.deque(maxlen=10_000)
        self.runner = StepRunner(workers, pool.generation)
        self.recovery = Recovery(memory, workers, lambda: self.lease, pool, lease_ttl, recovery_timeout)
        self.failover = Failover(memory, workers, self.scheduler, lambda: self.lease.lease_id,
                                 lambda: self.runner.pool_generation, recovery_timeout, infos)
        #: Tokens computed again after a worker failure and after a lost lease; when a step last completed.
        self.recomputed = {"worker_failure": 0, "lease_lost": 0}
        self.last_step_at = 0.0
        #: Cross-node prefix reuse from ``peers``, other nodes' memory services (client.engine.transfers); None: none.
        self.pulls = PrefixPull(list(peers)) if peers else None
        self.update = StepUpdate(self.scheduler, self.branching, self.stop_checker, self.commits, self.pulls,
                                 lambda ids: self._free_ids(ids, mpb.FREE_REASON_FINISHED), self._fail)
        self.slots = Slots(memory, lambda: self.lease.lease_id, self.scheduler, self.commits, self.pulls,
                           self.model_id, self.block_size)
        #: The disk tier's copies, moved through the workers beside the steps; None without a disk tier.
        self.disk_mover: DiskMover | None = None
        if pool.HasField("disk_tier"):
            self.scheduler.admit_gate = DiskGate(memory, lambda: self.lease.lease_id, self.model_id)
            self.disk_mover = DiskMover(memory, workers, lambda: self.lease.lease_id,
                                        lambda: self.runner.pool_generation).start()
        #: What the front reads (client.engine.stats): fixed limits, and the stats of the last step.
        self.limits = EngineLimits(info, self.model_id, self.max_context, self.block_size, self.num_blocks,
                                   min(w.timeout for w in workers))
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()
        self._publish()

    def add(self, request: Request) -> None:
        """Queue a request (thread-safe); its unset sampling fields take the model's defaults here,
        once (``request.params`` becomes a resolved copy), and its structured output's grammar is
        compiled (or found in the cache). Raises ValueError when it can never fit
        (:meth:`Scheduler.add`), a logit_bias id is outside the vocabulary or its grammar does not compile."""
        request.params = request.params.with_defaults(self.generation_defaults)
        request.params.check_vocab(self.model_info.vocab_size)
        request.min_tokens_stop_ids = self.stop_checker.min_tokens_stop_ids(request.params, self.model_info.vocab_size)
        if request.params.structured_outputs is not None:  # compiled once per constraint (cached)
            grammar = self.grammars.compile(request.params.structured_outputs)
            for seq in request.seqs:
                seq.grammar = grammar.matcher()
        if request.params.use_beam_search:
            limit = min(request.params.max_tokens, self.max_context - len(request.prompt_token_ids))
            request.beam = BeamState.of(request.params, limit, set() if request.params.ignore_eos else self.eos_ids)
        self.scheduler.add(request)
        self._publish()  # the front counts it in the queue at once

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe): its blocks are freed at the start of the next step."""
        self.abort_log.append((request_id, self.step_count))
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.failover.pending()

    @property
    def lease_recoveries(self) -> int:
        """Times a lost lease or a new pool generation was recovered from (client.engine.recovery)."""
        return self.recovery.recoveries

    def fail_all(self, error: Exception) -> list[Request]:
        """End every running and waiting request with ``error``, freeing their sequences (best
        effort: the lease expires otherwise); returns them, running ones first."""
        reqs = self.scheduler.drain()
        self.commits.clear()
        try:
            self._free(reqs, mpb.FREE_REASON_FINISHED)
        except Exception:  # noqa: BLE001 - the lease will expire
            pass
        for r in reqs:
            r.fail(error)
        self._publish()
        return reqs

    # ------------------------------------------------------------ the seam
    def stats(self) -> EngineStats:
        """The stats published after the last step or request joined (thread-safe; client.engine.stats)."""
        return self._stats

    def step_log(self, since: int = 0) -> StepLog:
        """The traces of steps ``since`` on and the aborts asked since that step (thread-safe)."""
        steps = [t for t in list(self.traces) if t.step >= since]
        return StepLog(self.step_count, steps, [(r, s) for r, s in list(self.abort_log) if s >= since])

    def _publish(self) -> None:
        """Build the stats the front reads; under a lock, so the last one published is the newest."""
        with self._stats_lock:
            pulled, failed = (self.pulls.tokens_pulled, self.pulls.transfers_failed) if self.pulls else (0, 0)
            f, r, p, queues = self.failover, self.recomputed, self.preemption, self.scheduler.queues()
            self._stats = EngineStats(
                self.step_count, *queues, p.preemptions, p.swaps, p.swap_fallbacks,
                self.lease_recoveries, self.scheduler.handoffs, pulled, failed, self.lease.lease_id, self.lease.secret,
                f.failovers, len(f.ready), len(self.workers), r["worker_failure"], p.recomputed_tokens, r["lease_lost"],
                f.info(*queues), self.last_step_at)

    def close(self) -> None:
        if self.disk_mover is not None:
            self.disk_mover.close()
        self.recovery.cancel()
        self.runner.close()
        if self.pulls is not None:
            self.pulls.close()
        self.lease.close()

    def step(self) -> list[Request]:
        """Run one step (the module's diagram); returns the requests it updated (finished ones included).

        A step that finds the lease or the pool generation gone recovers instead (client.engine.recovery)
        and returns the requests it updated before that.

        Raises:
            client.errors.ServiceError: a service refused a call, or recovery failed.
        """
        updated: dict[str, Request] = {}
        try:
            self.recovery.check_lease()
            out = self._step(updated)
        except WorkersDown:
            raise  # the lease stays: the caller fails the requests, the next runs once a worker is back
        except ServiceError as e:
            if self.pulls is not None:
                self.pulls.clear()
            got = self.recovery.recover(e, self._requeue_running)  # raises what it cannot recover from
            self.lease, self.runner.pool_generation = got.lease, got.generation
            self.commits.clear()  # receipts of the old lease's sequences
            self.failover.forget_quarantines()
            return list(updated.values())
        finally:
            self._publish()
        self.recovery.step_done()
        return out

    def _step(self, updated: dict) -> list[Request]:
        t0 = time.perf_counter()
        self._handle_aborts(updated)
        self.failover.apply_requests()  # drains asked since the last step
        self.failover.probe()
        if not self.failover.ready:  # every worker is down: wait for one (client.engine.failover)
            self.failover.wait_for_a_worker(self.scheduler.has_work())
            return list(updated.values())
        self._fork(updated)
        may_admit = self.scheduler.may_admit()  # only then the pool's free blocks (a GetStats call)
        out = self.scheduler.schedule(self._available_blocks() if may_admit else 0)
        if not out.scheduled and not may_admit:  # a request came in meanwhile: schedule it on the real count
            out = self.scheduler.schedule(self._available_blocks())
        if not out.scheduled:
            self._fail_unschedulable(updated)
            if self.disk_mover is not None and self.scheduler.waiting:
                time.sleep(DISK_POLL)  # requests wait for disk reads the mover's thread is doing
            return list(updated.values())
        swapped_in = self.preemption.swap_in(out) if out.swapped else set()
        appended = self.slots.append(out, swapped_in, self.preemption.preempt,
                                     lambda r, e: self._fail(r, e, updated))
        scheduled = self.slots.allocate(out)
        if not scheduled:
            return list(updated.values())
        try:
            results = self.runner.run(scheduled, appended.copies_by_worker)
        except ServiceError as e:
            if e.reason not in (TRANSFER_FAILED, TRANSFERS_OFF) or self.pulls is None:
                raise
            for req in self.pulls.transfer_failed([x.request for x in scheduled]):  # recomputed
                self.preemption.preempt(req)
                appended.preempted.append(req.request_id)
            log.warning("transfer_failed", requests=len(appended.preempted))
            return list(updated.values())
        if results.failed:  # a worker is gone: its sequences go on elsewhere (client.engine.failover)
            scheduled, lost = self.failover.fail_over(results.failed, scheduled, appended.copies_by_worker,
                                                      self.scheduler.preempt)
            self.recomputed["worker_failure"] += lost
        self.failover.step_done({x.request.worker for x in scheduled})
        finished_ids = self.update.apply(scheduled, results, updated)
        self.last_step_at = time.monotonic()
        self._handle_aborts(updated)  # cancelled during the step: freed now, not a step later
        trace = StepTrace(self.step_count, list(dict.fromkeys(x.request.request_id for x in scheduled)),
                          sum(x.num_new_tokens for x in scheduled), finished_ids, appended.preempted,
                          results.model_seconds, time.perf_counter() - t0, appended.swapped)
        self.traces.append(trace)
        self.step_count += 1
        return list(updated.values())

    def _requeue_running(self) -> list[Request]:
        """A lost lease: every running request is recomputed (counted as lease_lost)."""
        self.recomputed["lease_lost"] += sum(s.num_computed for r in self.scheduler.running for s in r.seqs)
        return self.scheduler.requeue_running()

    def _handle_aborts(self, updated: dict) -> None:
        victims = self.scheduler.take_aborted()
        try:
            if victims:
                self.commits.flush()  # their last receipts still fill the cache
            self._free(victims, mpb.FREE_REASON_ABORTED)
        finally:  # aborted even when the lease is gone
            for r in victims:
                r.abort()
                updated[r.request_id] = r

    def _free(self, reqs: list[Request], reason: int) -> None:
        """Free the sequences of ``reqs`` that hold blocks (1 FreeSequences, none when there are none)."""
        if self.pulls is not None:
            for r in reqs:
                for s in r.seqs:
                    self.pulls.release(s)
        self._free_ids([i for r in reqs for i in r.seq_ids()], reason)

    def _free_ids(self, seq_ids: list[int], reason: int) -> None:
        """Free sequences by id, in calls of at most MAX_BATCH (none when there are none)."""
        for at in range(0, len(seq_ids), MAX_BATCH):
            self.memory.free(self.lease.lease_id, seq_ids[at:at + MAX_BATCH], reason)

    def _fork(self, updated: dict) -> None:
        """Fork parallel-sampling prompts and branching beams in one call; free dropped beams first.

        A request whose fork the lease's block quota refuses (QUOTA_EXCEEDED) is preempted by
        recompute while the lease runs others (their blocks come back), else it fails: alone it
        would pass the quota."""
        plan = self.recovery.fork_in_flight = self.branching.plan()
        if plan.drop or plan.forkable:
            self.commits.flush()
        self._free_ids(plan.drop, mpb.FREE_REASON_ABORTED)
        forkable = plan.forkable
        children, grants = self.slots.fork([b.parent for b in forkable])
        plan.apply(children, grants)
        self.recovery.fork_in_flight = None
        refused = {id(b.request): b.request for b, c in zip(forkable, children) if c is None}.values()
        for req in refused:
            if len(self.scheduler.running) > 1:
                self.preemption.recompute(req)
            else:
                self._fail(req, self.slots.fork_refusal, updated)

    def _available_blocks(self) -> int:
        """The pool's free blocks now (0 when GetStats fails: nothing is admitted)."""
        try:
            stats = self.memory.stats()
        except ServiceError:
            return 0
        self.recovery.check_generation(stats.generation)
        return stats.available_blocks

    def _fail_unschedulable(self, updated: dict) -> None:
        """Nothing could run: a waiting request that cannot fit even in an empty pool fails. A
        swapped-out one at the head is recomputed instead (its sequences freed: the blocks they
        still share on the device may be what keeps it out)."""
        if not self.scheduler.stalled():
            return
        if self.scheduler.gate_held:
            return  # requests wait for their prompt's blocks from disk: not unschedulable, tried next step
        head = self.scheduler.head()
        if head is not None and head.status == Status.SWAPPED:
            self.preemption.recompute_swapped(head)
            return
        quota, need = self.lease.max_blocks, sum(-(-len(s.tokens) // self.block_size) for s in head.seqs)
        if quota is not None and need > quota:  # its sequences together pass the lease's block quota
            self._fail(self.scheduler.pop_waiting(), QuotaExceeded.of("blocks", quota, need, 0, (
                f"request {head.request_id}'s {len(head.seqs)} sequences need {need} blocks, past this lease's "
                f"quota of {quota} (the memory service's --max-blocks-per-lease)")), updated)
            return
        try:
            stats = self.memory.stats()
        except ServiceError:
            return
        if stats.used_blocks > 0:
            return  # other clients hold blocks; wait for them
        req = self.scheduler.pop_waiting()
        need = -(-len(req.seqs[0].tokens) // self.block_size)
        self._fail(req, OutOfBlocks.of(need, stats.available_blocks, f"request {req.request_id} needs {need} blocks "
                                       f"for its first chunk but the pool has {stats.available_blocks}"), updated)

    def _fail(self, req: Request, error: Exception, updated: dict) -> None:
        """End ``req`` with ``error``, freeing whatever it holds."""
        self._free([req], mpb.FREE_REASON_ABORTED)
        self.scheduler.finish(req)
        req.fail(error)
        req.metrics.finished = time.time()
        updated[req.request_id] = req
        log.warning("request_failed", request_id=req.request_id, error=str(error))
