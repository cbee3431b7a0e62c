"""Preemption by swap on the client: swap a victim out to the host tier, swap it back in when readmitted.

With ``SchedulerConfig.preemption_mode = "swap"`` (PagedAttention, section 4.5; vLLM's
``PreemptionMode.SWAP``) the engine preempts a running request by SwapOutSequences instead of
FreeSequences: its sequences stay live in the memory service, their own blocks reserved in the
host tier, their device blocks back in the pool (still holding their KV until someone else
takes them, and offloaded then, in that owner's step). The request keeps its sequences' ids,
block tables and ``num_computed``, and waits at the front of the queue with status SWAPPED. When
the scheduler readmits it, the engine swaps it in (SwapInSequences) before it grows or allocates
anything in that step: new block tables and grants, whose copies reload what left the device
(the worker does them before it writes; DESIGN.md, "Tiers and transfers"). Nothing is computed
again, so its outputs equal an undisturbed run's.

Falling back to recompute:

- swap-out refused with OUT_OF_HOST_BLOCKS (the host tier is full) or HOST_TIER_OFF (the memory
  service has none): the victim is freed (reason PREEMPTED) and recomputed, as by default;
- a victim whose sequences grew (AppendSlots) earlier in the same step: they hold slots for
  tokens not computed yet, which a swap-in would hand back as its next step's writes; and a
  victim swapped in earlier in the same step (its reloads have not run); freed;
- swap-in refused with SWAP_LOST (a block left the device with no proven host copy): that
  request's sequences are freed and it waits at the front of the queue as a recomputed
  request (allocated at its next admission, normally the next step).

A swap-in refused with OUT_OF_BLOCKS (other leases took the blocks the scheduler counted on)
unadmits the request, still SWAPPED, and every request admitted after it (so none jumps the
queue); they wait for the next step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from client.errors import FailedPrecondition, OutOfBlocks, OutOfHostBlocks, QuotaExceeded
from client.request import Request
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.errors import HOST_TIER_OFF, SWAP_LOST
from pagedkv.runtime.limits import MAX_BATCH
from pagedkv.runtime.logs import get_logger

if TYPE_CHECKING:
    from client.engine.scheduler import SchedulerOutput
    from client.services import MemoryClient

log = get_logger("swap")


def check_host_tier(preemption_mode: str, host_blocks: int) -> None:
    """Warn when preemption by swap is asked of a memory service without a host tier (``host_blocks`` 0)."""
    if preemption_mode == "swap" and not host_blocks:
        log.warning("no_host_tier", hint="preemption_mode 'swap' needs a memory service started with "
                    "--host-cache-memory; until it has one, preemptions recompute")


class SwapOut(enum.Enum):
    """What :meth:`Swapper.swap_out` did; the engine preempts by recompute unless SWAPPED."""

    #: Swapped out: the engine requeues the request SWAPPED (Scheduler.preempt(swap=True)).
    SWAPPED = "swapped"
    #: Refused by the memory service (host tier off or full): a swap fallback, nothing changed.
    REFUSED = "refused"
    #: Not tried (no sequence holds blocks, or one grew or was swapped in this step).
    SKIPPED = "skipped"


@dataclass(slots=True)
class SwapIn:
    """What :meth:`Swapper.swap_in` did, for the engine to apply to its scheduler."""

    #: Ids of the sequences swapped in (grown already by their SwapInSequences).
    seq_ids: set[int] = field(default_factory=set)
    #: Requests now running (Scheduler.swapped_in).
    swapped_in: list[Request] = field(default_factory=list)
    #: Requests that leave this step and wait again, in the order to unadmit them (Scheduler.unadmit):
    #: ``(request, recomputed)``, recomputed (Scheduler.recompute_swapped first; their sequences
    #: are freed already) when their KV was lost, else still SWAPPED.
    unadmitted: list[tuple[Request, bool]] = field(default_factory=list)

    @property
    def fallbacks(self) -> int:
        """Requests recomputed rather than swapped in."""
        return sum(recomputed for _, recomputed in self.unadmitted)


class Swapper:
    """The swap preemption's calls to the memory service (the module's procedure).

    Args:
        memory: the memory-service client.
        lease_id: returns the engine's lease id now (it changes on recovery).
    """

    def __init__(self, memory: MemoryClient, lease_id: Callable[[], str]):
        self.memory = memory
        self.lease_id = lease_id
        self._warned_off = False

    def swap_out(self, req: Request, grown: set[int]) -> SwapOut:
        """Try to swap out running ``req``'s live sequences (one SwapOutSequences).

        Args:
            req: the victim.
            grown: sequence ids that AppendSlots grew, or that were swapped in, earlier in this step.

        Returns:
            SWAPPED when its sequences are swapped out (the caller requeues it); REFUSED when the
            host tier is off or full, SKIPPED when no sequence holds blocks or one grew this step
            (nothing changed in the memory service: the caller preempts it by recompute).

        Raises:
            client.errors.ServiceError: any other refusal (a lost lease: client.engine.recovery).
        """
        ids = req.seq_ids()
        if not ids or len(ids) > MAX_BATCH or grown.intersection(ids):
            return SwapOut.SKIPPED
        try:
            resp = self.memory.swap_out(self.lease_id(), ids)
        except OutOfHostBlocks as e:
            log.info("swap_out_refused", request_id=req.request_id, reason=e.reason, required=e.required,
                     available=e.available)
            return SwapOut.REFUSED
        except FailedPrecondition as e:
            if e.reason != HOST_TIER_OFF:
                raise
            if not self._warned_off:
                self._warned_off = True
                log.warning("host_tier_off", error=e.message,
                            hint="preemption_mode 'swap' needs a memory service started with --host-cache-memory; "
                                 "preempting by recompute")
            return SwapOut.REFUSED
        log.info("swapped_out", request_id=req.request_id, seq_ids=ids, host_blocks=resp.host_blocks_reserved,
                 device_blocks_released=resp.device_blocks_released)
        return SwapOut.SWAPPED

    def swap_in(self, out: SchedulerOutput, free: Callable[[Request], None]) -> SwapIn:
        """Swap in the swapped-out requests this step admitted (``out.swapped``): one SwapInSequences
        for all of them, their sequences' block tables and grants from the reply; the module's
        fallbacks on OUT_OF_BLOCKS and SWAP_LOST (then one call per request, to find the lost one).
        Requests that leave the step are dropped from ``out``; a lost one's sequences are freed at
        once with ``free`` (FreeSequences, reason PREEMPTED). Returns what the scheduler must apply.

        Raises:
            client.errors.ServiceError: any other refusal.
        """
        result = SwapIn()
        pending = list(out.swapped)
        one_by_one = False
        while pending:
            batch = pending[:1] if one_by_one else pending[:MAX_BATCH]
            ids = [i for r in batch for i in r.seq_ids()]
            # Their slots for this step in the same call: its reply's grant is the step's only one.
            grow = {x.seq.seq_id: x for x in out.scheduled if x.request in batch and x.seq.seq_id is not None}
            try:
                resp = self.memory.swap_in(self.lease_id(), ids,
                                           [(i, x.num_new_tokens, x.token_ids) for i, x in grow.items()])
            except (OutOfBlocks, QuotaExceeded) as e:
                later = out.admitted[out.admitted.index(batch[-1]):]
                for r in reversed(later):
                    result.unadmitted.append((r, False))
                    out.drop(r)
                pending = [r for r in pending if r in out.swapped]
                log.info("swap_in_deferred", request_ids=[r.request_id for r in later], reason=e.reason)
                continue
            except FailedPrecondition as e:
                if e.reason != SWAP_LOST:
                    raise
                if len(batch) > 1:
                    one_by_one = True
                    continue
                self._recompute(batch[0], out, e.message, free, result)
                pending.remove(batch[0])
                continue
            for r in batch:
                pending.remove(r)
            self._apply(batch, resp, out, grow, free, result)
        return result

    def _apply(self, reqs: list[Request], resp: mpb.SwapInSequencesResponse, out: SchedulerOutput,
               grow: dict, free: Callable[[Request], None], result: SwapIn) -> None:
        """Give ``reqs``' sequences their block tables and grants from a SwapInSequences reply
        (``grow``: seq_id -> its ScheduledSeq, grown in that call); those that run on go in
        ``result`` with their sequence ids, the others are recomputed."""
        by_id = {s.seq_id: (r, s) for r in reqs for s in r.seqs if s.seq_id is not None}
        lost: dict[int, Request] = {}
        for t, g in zip(resp.sequences, resp.grants):
            r, s = by_id[t.seq_id]
            x = grow.get(t.seq_id)
            if t.num_tokens != s.num_computed + (x.num_new_tokens if x else 0):  # not the slots it had
                lost[id(r)] = r  # not the KV it left with: recompute rather than guess
            s.block_table, s.grant = list(t.block_ids), g
        for r in reqs:
            if id(r) in lost:
                self._recompute(r, out, "the swapped-in block table does not match the tokens computed", free, result)
            else:
                result.swapped_in.append(r)
        log.info("swapped_in", request_ids=[r.request_id for r in reqs if id(r) not in lost])
        result.seq_ids.update(i for r in reqs if id(r) not in lost for i in r.seq_ids())

    @staticmethod
    def _recompute(req: Request, out: SchedulerOutput, why: str, free: Callable[[Request], None],
                   result: SwapIn) -> None:
        """Free swapped ``req``'s sequences; it leaves this step and waits at the front, recomputed."""
        free(req)
        result.unadmitted.append((req, True))
        out.drop(req)
        log.warning("swap_lost", request_id=req.request_id, error=why)
