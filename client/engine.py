"""The client's engine: executes each step's schedule over the memory service and the workers.

One :meth:`Engine.step` (vLLM v1's schedule / execute / update_from_output, split across services)::

    1. free      sequences aborted since the last step            (1 FreeSequences)
    2. fork      parallel-sampling prompts and beams that branch   (client.beam: 1 FreeSequences
                 for dropped beams, 1 ForkSequences)
    3. schedule  client.scheduler, from the pool's free blocks     (1 GetStats, only when a
                 waiting request may be admitted):
                 running requests first (decode tokens, then the rest of chunked
                 prefills), then admit waiting ones, under a token budget
    4. swap in   readmitted swapped-out requests (client.swap)   (1 SwapInSequences, only
                 -> OUT_OF_BLOCKS: unadmit them (they wait)       when one was readmitted)
    5. append    slots for every scheduled, allocated sequence    (1 AppendSlots)
                 -> OUT_OF_BLOCKS: preempt the most recently admitted request by
                    recompute (free its blocks, requeue it at the front), or with
                    preemption_mode "swap" by swap (1 SwapOutSequences: its KV goes
                    to the host tier, it keeps its sequences), and retry
    6. allocate  sequences for newly admitted requests            (1 AllocateSequences)
                 -> OUT_OF_BLOCKS: unadmit the last admitted (it waits) and retry
    7. Step      one call per worker (client.worker_step): copy-on-write pairs,
                 tokens, positions, block tables, grants (with their tier copies),
                 sampling; the worker samples
    8. update    hand in the workers' receipts (computed tokens;   (1 CommitComputedTokens)
                 full blocks enter the prefix cache)
                 append sampled tokens, check stops (client.stop), advance beams;
                 free finished sequences                          (1 FreeSequences)

so a step makes a constant number of memory-service calls (plus one per
preemption) and one Step call per worker. A lost lease or a new pool generation
met by a step is recovered from before the next (client.recovery): a new lease,
and the running requests recomputed. Requests join between steps and
leave as soon as they finish. Sampling is reproducible without worker state:
the draw for output position t depends on (seed + sample index, t), so a
preempted request resumes on the same draws.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from client.beam import BeamState, Branching
from client.commits import Commits
from client.errors import OutOfBlocks, QuotaExceeded, ServiceError
from client.params import model_defaults
from client.recovery import DEFAULT_TIMEOUT as DEFAULT_RECOVERY_TIMEOUT
from client.recovery import Recovery
from client.request import Request, Status
from client.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from client.services import Lease, MemoryClient, WorkerClient
from client.stop import StopChecker, context_limit, same_model
from client.swap import Swapper
from client.transfers import Peer, PrefixPull
from client.worker_step import StepResults, StepRunner
from pagedkv.errors import TRANSFER_FAILED, TRANSFER_TICKET_REFUSED, TRANSFERS_OFF
from pagedkv.grant.v1 import grant_pb2 as gpb
from pagedkv.limits import MAX_BATCH, MAX_FORK_BLOCK_IDS, MAX_FORK_CHILDREN, MAX_TOKEN_IDS_PER_CALL
from pagedkv.logs import get_logger
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.model_source import model_identity

log = get_logger("engine")


def _fits(items: list, size, limit: int = MAX_TOKEN_IDS_PER_CALL) -> int:
    """How many leading ``items`` one memory-service call may carry (pagedkv.limits): at most
    MAX_BATCH entries whose ``size(item)`` (token ids, or block-table entries of a fork) add up
    to at most ``limit``; at least one."""
    total = 0
    for i, item in enumerate(items[:MAX_BATCH]):
        total += size(item)
        if total > limit and i:
            return i
    return min(len(items), MAX_BATCH)


@dataclass(slots=True)
class StepTrace:
    """What one step ran (for tests and the demo)."""

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
    #: Of ``preempted``, those preempted by swap (client.swap).
    swapped: list[str] = field(default_factory=list)


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
        info = same_model([w.model_info() for w in workers], [w.address for w in workers])
        self.model_info = info
        #: Prefix-cache identity of this model's KV: model, resolved revision and KV dtype.
        self.model_id = model_identity(info.model_name, info.model_source, info.revision, info.dtype)
        self.eos_ids = set(info.eos_token_ids)
        #: The model's request defaults (its generation_config.json), applied at admission (:meth:`add`).
        self.generation_defaults = model_defaults(info.generation_defaults)
        if info.ignored_generation_keys:
            log.warning("generation_config_keys_ignored", keys=list(info.ignored_generation_keys),
                        honoured="temperature, top_p, top_k, repetition_penalty")
        self.max_context = context_limit(info.max_context, info.sliding_window, self.num_blocks * self.block_size,
                                         max_model_len)
        self.scheduler = Scheduler(config or SchedulerConfig(), block_size=self.block_size,  # checks the roles first
                                   max_context=self.max_context, num_workers=len(workers), worker_roles=worker_roles)
        self.lease = Lease(memory, lease_ttl)
        #: The last step's receipts waiting for the next AppendSlots (client.commits).
        self.commits = Commits(memory, lambda: self.lease)
        self.branching = Branching()
        self.stop_checker = StopChecker(self.eos_ids, self.max_context, tokenizer)
        self.step_count = 0
        #: Requests preempted, by recompute or by swap.
        self.preemptions = 0
        #: Of ``preemptions``, those by swap (SwapOutSequences; client.swap).
        self.swaps = 0
        #: Swap preemptions that fell back to recompute (host tier off or full, a swap-in's SWAP_LOST).
        self.swap_fallbacks = 0
        self.swapper = Swapper(self)
        if self.swapper.enabled and not pool.host_num_blocks:
            log.warning("no_host_tier", hint="preemption_mode 'swap' needs a memory service started with "
                        "--host-cache-memory; until it has one, preemptions recompute")
        self.traces: collections.deque[StepTrace] = collections.deque(maxlen=100_000)
        #: (request id, step_count when its abort was asked), most recent last.
        self.abort_log: collections.deque[tuple[str, int]] = collections.deque(maxlen=10_000)
        self.runner = StepRunner(workers, pool.generation)
        #: Times a lost lease or a new pool generation was recovered from (client.recovery).
        self.lease_recoveries = 0
        self.recovery = Recovery(self, pool, lease_ttl, recovery_timeout)
        #: Cross-node prefix reuse from ``peers``, other nodes' memory services (client.transfers); None: none.
        self.pulls = PrefixPull(list(peers)) if peers else None

    def add(self, request: Request) -> None:
        """Queue a request (thread-safe); its unset sampling fields take the model's defaults here,
        once (``request.params`` becomes a resolved copy). Raises ValueError when it can never fit
        (:meth:`Scheduler.add`)."""
        request.params = request.params.with_defaults(self.generation_defaults)
        if request.params.use_beam_search:
            limit = min(request.params.max_tokens, self.max_context - len(request.prompt_token_ids))
            request.beam = BeamState.of(request.params, limit, self.eos_ids)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe): its blocks are freed at the start of the next step."""
        self.abort_log.append((request_id, self.step_count))
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

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
        return reqs

    def close(self) -> None:
        self.recovery.cancel()
        self.runner.close()
        if self.pulls is not None:
            self.pulls.close()
        self.lease.close()

    def step(self) -> list[Request]:
        """Run one step (the module's diagram); returns the requests it updated (finished ones included).

        A step that finds the lease or the pool generation gone recovers instead (client.recovery)
        and returns the requests it updated before that.

        Raises:
            client.errors.ServiceError: a service refused a call, or recovery failed.
        """
        updated: dict[str, Request] = {}
        try:
            self.recovery.check_lease()
            out = self._step(updated)
        except ServiceError as e:
            if self.pulls is not None:
                self.pulls.clear()
            self.recovery.recover(e)  # raises what it cannot recover from
            return list(updated.values())
        self.recovery.step_done()
        return out

    def _step(self, updated: dict) -> list[Request]:
        t0 = time.perf_counter()
        self._handle_aborts(updated)
        self._fork()
        may_admit = self._may_admit()
        out = self.scheduler.schedule(self._available_blocks() if may_admit else 0)
        if not out.scheduled and not may_admit:  # a request came in meanwhile: schedule it on the real count
            out = self.scheduler.schedule(self._available_blocks())
        if not out.scheduled:
            self._fail_unschedulable(updated)
            return list(updated.values())
        if out.swapped:
            self.commits.flush()  # swap-in's reloads follow proven positions only
        swapped_in = self.swapper.swap_in(out) if out.swapped else set()
        copies_by_worker, preempted, swapped = self._append(out, updated, swapped_in)
        scheduled = self._allocate(out)
        if not scheduled:
            return list(updated.values())
        try:
            results = self.runner.run(scheduled, copies_by_worker)
        except ServiceError as e:
            if e.reason not in (TRANSFER_FAILED, TRANSFERS_OFF) or self.pulls is None:
                raise
            self._transfer_failed(scheduled, preempted)
            return list(updated.values())
        finished_ids = self._update(scheduled, results, updated)
        self._handle_aborts(updated)  # cancelled during the step: freed now, not a step later
        trace = StepTrace(self.step_count, list(dict.fromkeys(x.request.request_id for x in scheduled)),
                          sum(x.num_new_tokens for x in scheduled), finished_ids, preempted,
                          results.model_seconds, time.perf_counter() - t0, swapped)
        self.traces.append(trace)
        self.step_count += 1
        return list(updated.values())

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

    def _transfer_failed(self, scheduled: list[ScheduledSeq], preempted: list[str]) -> None:
        """A worker refused the step because a node transfer failed (nothing of it was written):
        preempt the step's requests by recompute; those that pulled compute everything from now on."""
        self.pulls.transfers_failed += 1
        for req in {id(x.request): x.request for x in scheduled}.values():
            if any(self.pulls.reading(s) for s in req.seqs):
                req.no_pull = True
            self._preempt(req)
            preempted.append(req.request_id)
        log.warning("transfer_failed", requests=len(preempted))

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

    def _fork(self) -> None:
        """Fork parallel-sampling prompts and branching beams in one call; free dropped beams first."""
        plan = self.recovery.fork_in_flight = self.branching.plan()
        if plan.drop or plan.forkable:
            self.commits.flush()
        self._free_ids(plan.drop, mpb.FREE_REASON_ABORTED)
        branches, children, grants = plan.forkable, [], []
        while len(children) < len(branches):  # in calls within the memory service's per-call bounds
            rest = branches[len(children):]
            n = _fits(rest[:MAX_FORK_CHILDREN], lambda b: len(b.parent.block_table), MAX_FORK_BLOCK_IDS)
            resp = self.memory.fork(self.lease.lease_id, [b.parent.seq_id for b in rest[:n]])
            children += resp.children
            grants += resp.grants
        plan.apply(children, grants)
        self.recovery.fork_in_flight = None

    def _may_admit(self) -> bool:
        """Whether this step's schedule may admit a waiting request (one waits and a running slot is
        free). Only then does it need the pool's free blocks (a GetStats call): a step that only
        continues running requests skips it (their growth is checked by AppendSlots)."""
        sched = self.scheduler
        return bool(sched.waiting) and len(sched.running) < sched.config.max_num_seqs

    def _available_blocks(self) -> int:
        """The pool's free blocks now (0 when GetStats fails: nothing is admitted)."""
        try:
            stats = self.memory.stats()
        except ServiceError:
            return 0
        self.recovery.check_generation(stats.generation)
        return stats.available_blocks

    def _append(self, out: SchedulerOutput, updated: dict,
                swapped_in: set[int]) -> tuple[dict[int, list[tuple[int, int]]], list[str], list[str]]:
        """Grow the scheduled sequences that hold blocks (reservations never grow), in calls within
        the memory service's per-call limits (one call unless a step is huge); on OUT_OF_BLOCKS
        preempt the scheduler's victim (or fail a lone request) and go on with what is left.

        Only copy-on-write pairs (device to device) go in a Step's ``copies``; the tier copies an
        append caused (offloads of evicted blocks) are in the grants, which the worker follows.

        ``swapped_in``: sequence ids swapped in this step, grown already by their SwapInSequences
        (a victim among them is recomputed: its reloads have not run yet). Returns the copy-on-write
        ``(src, dst)`` pairs per worker, the preempted request ids and, of those, the ones preempted
        by swap.
        """
        preempted: list[str] = []
        swapped: list[str] = []
        copies: dict[int, list[tuple[int, int]]] = {}  # seq_id -> its copies
        done: set[int] = set(swapped_in)
        receipts: list = []
        first = True
        while True:
            pending = [x for x in out.scheduled if x.seq.seq_id is not None and x.seq.seq_id not in done
                       and self.scheduler.reservation(x.request) is None]
            if not pending:
                break
            chunk = pending[:_fits(pending, lambda x: x.num_new_tokens)]
            if first:  # the last step's receipts ride on the step's first AppendSlots (client.commits)
                receipts, first = (self.commits.take() if len(self.commits) else []), False
            try:
                resp = self.memory.append(self.lease.lease_id,
                                          [(x.seq.seq_id, x.num_new_tokens, x.token_ids) for x in chunk], receipts)
            except (OutOfBlocks, QuotaExceeded) as e:  # the pool, or this lease's quota, is full
                if receipts:  # refused with its appends: proven now, before a victim is freed or swapped out
                    self.commits.commit_taken(receipts)
                    receipts = []
                victim = self.scheduler.pick_victim(out.scheduled)
                if victim is None:  # a lone request that cannot grow: the pool is too small for it
                    victim = out.scheduled[0].request
                    self._fail(victim, e, updated)
                else:
                    if self._preempt(victim, done | swapped_in):
                        swapped.append(victim.request_id)
                    preempted.append(victim.request_id)
                out.drop(victim)
                continue
            if receipts:
                self.commits.granted(resp.committed_grants)
                receipts = []
            by_id = {x.seq.seq_id: x.seq for x in chunk}
            for x, g in zip(chunk, resp.grants):
                x.seq.grant = g
            for u in resp.updates:
                by_id[u.seq_id].block_table[u.first_changed:] = list(u.block_ids)
            for c in resp.copies:  # a copy-on-write goes with the sequence whose table now holds dst
                if c.src_medium != gpb.MEDIUM_DEVICE or c.dst_medium != gpb.MEDIUM_DEVICE:
                    continue  # an offload: the worker does it from the owner's grant
                owner = by_id.get(c.seq_id) or next(q for q in by_id.values() if c.dst in q.block_table)
                copies.setdefault(owner.seq_id, []).append((c.src, c.dst))
            done.update(by_id)
        if len(self.commits):  # no AppendSlots this step: hand them in on their own
            self.commits.flush()
        copies_by_worker: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for x in out.scheduled:  # the copies of sequences still in the step, on their workers
            copies_by_worker[x.request.worker].extend(copies.get(x.seq.seq_id, ()))
        return copies_by_worker, preempted, swapped

    def _preempt(self, req: Request, grown: set[int] = frozenset()) -> bool:
        """Preempt running ``req``: by swap when the mode asks and the memory service can
        (client.swap), else by recompute. ``grown``: sequence ids that may not be swapped out now
        (grown by AppendSlots, or swapped in, in this step).
        Returns whether it was by swap."""
        by_swap = self.swapper.enabled and self.swapper.swap_out(req, grown)
        if not by_swap:
            self._free([req], mpb.FREE_REASON_PREEMPTED)
            self.scheduler.preempt(req)
        self.preemptions += 1
        return by_swap

    def _allocate(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """Allocate the sequences without blocks, in calls within the memory service's per-call
        limits; with prefix caching, skip what is cached. On OUT_OF_BLOCKS the last admitted request
        that needs an allocation (not one swapped in) is unadmitted and the rest retried."""
        while True:
            new = [x for x in out.scheduled if x.seq.seq_id is None]
            if not new:
                return out.scheduled
            allocations = [self._allocation(x) for x in new]
            n = _fits(allocations, lambda a: len(a.token_ids))
            try:
                resp = self.memory.allocate(self.lease.lease_id, allocations[:n])
            except (OutOfBlocks, QuotaExceeded):
                if self.pulls is not None:  # asked again when allocated again
                    for x in new:
                        self.pulls.release(x.seq)
                needing = [r for r in out.admitted if any(x.request is r for x in new)]
                if not needing:
                    raise
                last = needing[-1]
                self.scheduler.unadmit(last)
                out.drop(last)
                continue
            except ServiceError as e:  # a peer's ticket this node cannot take: allocate without it
                pulled = [x for x, a in zip(new[:n], allocations[:n]) if a.HasField("remote_prefix")]
                if e.reason not in (TRANSFER_TICKET_REFUSED, TRANSFERS_OFF) or not pulled:
                    raise
                for x in pulled:
                    x.request.no_pull = True
                    self.pulls.release(x.seq)
                log.warning("transfer_ticket_refused", requests=len(pulled), error=str(e))
                continue
            for x, t, g in zip(new, resp.sequences, resp.grants):
                x.allocated(t, g)
                if self.pulls is not None:
                    self.pulls.allocated(x.seq, t)
            for x in new[n:]:
                if self.pulls is not None:
                    self.pulls.release(x.seq)

    def _allocation(self, x: ScheduledSeq) -> mpb.SequenceAllocation:
        reserve = self.scheduler.reservation(x.request)
        if reserve is not None:  # contiguous reservation (baseline policies): no prefix cache
            return mpb.SequenceAllocation(num_tokens=reserve)
        s = x.seq
        known = s.tokens if s.compute_limit is None else s.tokens[:s.compute_limit]
        known = known[:MAX_TOKEN_IDS_PER_CALL]  # the prefix-cache lookup covers at most this many
        out = mpb.SequenceAllocation(num_tokens=x.num_new_tokens, token_ids=known, model_id=self.model_id,
                                     cache_salt=x.request.cache_salt)
        if self.pulls is not None and not x.request.no_pull:
            self.pulls.release(s)  # an allocation retried: pinned again below
            ticket = self.pulls.ticket(s, known, self.model_id, x.request.cache_salt, self.block_size)
            if ticket is not None:
                out.remote_prefix.CopyFrom(ticket)
        return out

    def _fail_unschedulable(self, updated: dict) -> None:
        """Nothing could run: a waiting request that cannot fit even in an empty pool fails. A
        swapped-out one at the head is recomputed instead (its sequences freed: the blocks they
        still share on the device may be what keeps it out)."""
        if not self.scheduler.stalled():
            return
        head = self.scheduler.head()
        if head is not None and head.status == Status.SWAPPED:
            self._free([head], mpb.FREE_REASON_PREEMPTED)
            self.scheduler.recompute_swapped(head)
            self.swap_fallbacks += 1
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

    def _update(self, scheduled: list[ScheduledSeq], results: StepResults, updated: dict) -> list[str]:
        """Take the sampled tokens; free finished sequences; returns the ids of finished requests."""
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
        # a plain running sequence's wait for the next step's AppendSlots (client.commits).
        self.commits.after_step([(x, r, self._may_wait(x)) for x, r in receipts])
        if self.pulls is not None:  # their blocks are read and proven: the peers' pins go
            self.pulls.release_done([x.seq for x in scheduled])
        self._free_ids(to_free, mpb.FREE_REASON_FINISHED)
        return finished

    def _may_wait(self, x: ScheduledSeq) -> bool:
        """Whether ``x``'s receipt may wait for the next AppendSlots: a single-sequence request still
        running that grows on demand (beams, parallel samples and reservations do not append)."""
        req = x.request
        return (x.seq.seq_id is not None and not req.finished and req.beam is None and req.params.n == 1
                and len(req.seqs) == 1 and self.scheduler.reservation(req) is None
                and not (self.pulls is not None and self.pulls.reading(x.seq)))
