"""Steps 2, 5 and 6 of :meth:`client.engine.core.Engine.step`: fork sequences (ForkSequences), grow the
step's sequences (AppendSlots) and allocate the new ones (AllocateSequences), within the memory
service's per-call limits.

:class:`Slots` makes the calls and returns what the step runs; the engine applies a shortfall
through the callbacks it passes (preempt a victim, fail a lone request). Running out is met as
the engine's diagram says: AppendSlots' OUT_OF_BLOCKS (or the lease's quota) preempts the
scheduler's victim and goes on with what is left; AllocateSequences' unadmits the last admitted
request that needs an allocation and retries.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from client.engine.commits import Commits
from client.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from client.engine.transfers import PrefixPull
from client.errors import OutOfBlocks, QuotaExceeded, ServiceError
from client.request import Request
from client.services import MemoryClient
from pagedkv.grant.v1 import grant_pb2 as gpb
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.errors import TRANSFER_TICKET_REFUSED, TRANSFERS_OFF
from pagedkv.runtime.limits import MAX_BATCH, MAX_FORK_BLOCK_IDS, MAX_FORK_CHILDREN, MAX_TOKEN_IDS_PER_CALL
from pagedkv.runtime.logs import get_logger

log = get_logger("engine")


def fits(items: list, size, limit: int = MAX_TOKEN_IDS_PER_CALL) -> int:
    """How many leading ``items`` one memory-service call may carry (pagedkv.runtime.limits): at most
    MAX_BATCH entries whose ``size(item)`` (token ids, or block-table entries of a fork) add up
    to at most ``limit``; at least one."""
    total = 0
    for i, item in enumerate(items[:MAX_BATCH]):
        total += size(item)
        if total > limit and i:
            return i
    return min(len(items), MAX_BATCH)


@dataclass(slots=True)
class Appended:
    """What :meth:`Slots.append` did."""

    #: Copy-on-write ``(src, dst)`` block pairs per worker, for the sequences still in the step.
    copies_by_worker: dict[int, list[tuple[int, int]]]
    #: Request ids preempted, and of those the ones preempted by swap.
    preempted: list[str]
    swapped: list[str]


class Slots:
    """The step's ForkSequences, AppendSlots and AllocateSequences calls for one engine.

    Args:
        memory: the memory-service client.
        lease_id: returns the engine's lease id now (it changes on recovery).
        scheduler: read for reservations and victims; :meth:`allocate` unadmits through it.
        commits: the receipts that ride on the step's first AppendSlots (client.engine.commits).
        pulls: cross-node prefix reuse (client.engine.transfers), or None.
        model_id: the prefix-cache identity of the model's KV.
        block_size: tokens per block.
    """

    def __init__(self, memory: MemoryClient, lease_id: Callable[[], str], scheduler: Scheduler, commits: Commits,
                 pulls: PrefixPull | None, model_id: str, block_size: int):
        self.memory, self.lease_id, self.scheduler, self.commits = memory, lease_id, scheduler, commits
        self.pulls, self.model_id, self.block_size = pulls, model_id, block_size
        #: The last QUOTA_EXCEEDED that refused a fork (:meth:`fork`), for the request it fails.
        self.fork_refusal: QuotaExceeded | None = None

    def fork(self, parents: list) -> tuple[list, list]:
        """Fork each of ``parents`` (Seq objects holding blocks; one may come several times) in calls
        within the memory service's per-call bounds; returns the ForkSequences replies' children and
        grants, in order. A call past the lease's block quota (QUOTA_EXCEEDED: a fork takes no
        block, but adds table entries) is made again parent by parent, and a refused parent's child
        and grant are None: it starts without blocks (the engine preempts or fails its request)."""
        children, grants = [], []
        one_by_one = False
        while len(children) < len(parents):
            rest = parents[len(children):]
            n = 1 if one_by_one else fits(rest[:MAX_FORK_CHILDREN], lambda p: len(p.block_table), MAX_FORK_BLOCK_IDS)
            try:
                resp = self.memory.fork(self.lease_id(), [p.seq_id for p in rest[:n]])
            except QuotaExceeded as e:
                if n > 1:  # which of them fit: one at a time from here
                    one_by_one = True
                    continue
                self.fork_refusal = e
                log.info("fork_over_quota", seq_id=rest[0].seq_id, error=e.message)
                children.append(None)
                grants.append(None)
                continue
            children += resp.children
            grants += resp.grants
        return children, grants

    def append(self, out: SchedulerOutput, swapped_in: set[int], preempt: Callable[[Request, set[int], bool], bool],
               fail: Callable[[Request, Exception], None]) -> Appended:
        """Grow the scheduled sequences that hold blocks (reservations never grow), in calls within
        the memory service's per-call limits (one call unless a step is huge); on OUT_OF_BLOCKS
        ``preempt(victim, grown, over_quota)`` the scheduler's victim (True: by swap; ``over_quota``: the
        lease's quota ran out, not the pool, so by recompute) or ``fail`` a lone request,
        drop it from ``out`` and go on with what is left.

        Only copy-on-write pairs (device to device) go in a Step's ``copies``; the tier copies an
        append caused (offloads of evicted blocks) are in the grants, which the worker follows.

        ``swapped_in``: sequence ids swapped in this step, grown already by their SwapInSequences
        (a victim among them is recomputed: its reloads have not run yet).
        """
        result = Appended({}, [], [])
        copies: dict[int, list[tuple[int, int]]] = {}  # seq_id -> its copies
        done: set[int] = set(swapped_in)
        receipts: list = []
        first = True
        while True:
            pending = [x for x in out.scheduled if x.seq.seq_id is not None and x.seq.seq_id not in done
                       and self.scheduler.reservation(x.request) is None]
            if not pending:
                break
            chunk = pending[:fits(pending, lambda x: x.num_new_tokens)]
            if first:  # the last step's receipts ride on the step's first AppendSlots (client.engine.commits)
                receipts, first = (self.commits.take() if len(self.commits) else []), False
            try:
                resp = self.memory.append(self.lease_id(), [(x.seq.seq_id, x.num_new_tokens, x.token_ids)
                                                            for x in chunk], receipts)
            except (OutOfBlocks, QuotaExceeded) as e:  # the pool, or this lease's quota, is full
                if receipts:  # refused with its appends: proven now, before a victim is freed or swapped out
                    self.commits.commit_taken(receipts)
                    receipts = []
                self._shortfall(out, e, done | swapped_in, preempt, fail, result)
                continue
            if receipts:
                self.commits.granted(resp.committed_grants)
                receipts = []
            done.update(_take_grants(chunk, resp, copies))
        if len(self.commits):  # no AppendSlots this step: hand them in on their own
            self.commits.flush()
        result.copies_by_worker = collections.defaultdict(list)
        for x in out.scheduled:  # the copies of sequences still in the step, on their workers
            result.copies_by_worker[x.request.worker].extend(copies.get(x.seq.seq_id, ()))
        return result

    def _shortfall(self, out: SchedulerOutput, error: Exception, grown: set[int],
                   preempt: Callable[[Request, set[int], bool], bool], fail: Callable[[Request, Exception], None],
                   result: Appended) -> None:
        """An AppendSlots found no room: preempt the scheduler's victim, or fail a lone request."""
        victim = self.scheduler.pick_victim(out.scheduled)
        if victim is None:  # a lone request that cannot grow: the pool is too small for it
            victim = out.scheduled[0].request
            fail(victim, error)
        else:
            if preempt(victim, grown, isinstance(error, QuotaExceeded)):
                result.swapped.append(victim.request_id)
            result.preempted.append(victim.request_id)
        out.drop(victim)

    def allocate(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """Allocate the sequences without blocks, in calls within the memory service's per-call
        limits; with prefix caching, skip what is cached. On OUT_OF_BLOCKS the last admitted request
        that needs an allocation (not one swapped in) is unadmitted and the rest retried. Returns
        the step's sequences."""
        while True:
            new = [x for x in out.scheduled if x.seq.seq_id is None]
            if not new:
                return out.scheduled
            allocations = [self._allocation(x) for x in new]
            n = fits(allocations, lambda a: len(a.token_ids))
            try:
                resp = self.memory.allocate(self.lease_id(), allocations[:n])
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


def _take_grants(chunk: list[ScheduledSeq], resp: mpb.AppendSlotsResponse,
                 copies: dict[int, list[tuple[int, int]]]) -> set[int]:
    """Apply an AppendSlots reply to ``chunk``'s sequences (grants, changed block-table tails) and
    collect its copy-on-write pairs into ``copies``; returns the sequence ids grown."""
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
    return set(by_id)
