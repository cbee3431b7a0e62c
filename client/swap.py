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

from typing import TYPE_CHECKING

from client.errors import FailedPrecondition, OutOfBlocks, OutOfHostBlocks, QuotaExceeded
from client.request import Request
from pagedkv.errors import HOST_TIER_OFF, SWAP_LOST
from pagedkv.limits import MAX_BATCH
from pagedkv.logs import get_logger
from pagedkv.memory.v1 import memory_service_pb2 as mpb

if TYPE_CHECKING:
    from client.engine import Engine
    from client.scheduler import SchedulerOutput

log = get_logger("swap")


class Swapper:
    """The engine's swap preemption (the module's procedure).

    Args:
        engine: the engine whose memory client, lease and scheduler it uses, and whose
            ``swaps`` / ``swap_fallbacks`` it counts.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._warned_off = False

    @property
    def enabled(self) -> bool:
        """Whether the engine preempts by swap (``preemption_mode == "swap"``)."""
        return self.engine.scheduler.config.preemption_mode == "swap"

    def swap_out(self, req: Request, grown: set[int]) -> bool:
        """Try to preempt running ``req`` by swap (one SwapOutSequences for its live sequences).

        Args:
            req: the victim.
            grown: sequence ids that AppendSlots grew, or that were swapped in, earlier in this step.

        Returns:
            True when it is swapped out (the scheduler has requeued it, SWAPPED); False when the
            caller must preempt it by recompute (no sequence holds blocks, one grew this step, or
            the host tier is off or full: nothing changed in the memory service).

        Raises:
            client.errors.ServiceError: any other refusal (a lost lease: client.recovery).
        """
        ids = req.seq_ids()
        if not ids or len(ids) > MAX_BATCH or grown.intersection(ids):
            return False
        engine = self.engine
        try:
            resp = engine.memory.swap_out(engine.lease.lease_id, ids)
        except OutOfHostBlocks as e:
            engine.swap_fallbacks += 1
            log.info("swap_out_refused", request_id=req.request_id, reason=e.reason, required=e.required,
                     available=e.available)
            return False
        except FailedPrecondition as e:
            if e.reason != HOST_TIER_OFF:
                raise
            engine.swap_fallbacks += 1
            if not self._warned_off:
                self._warned_off = True
                log.warning("host_tier_off", error=e.message,
                            hint="preemption_mode 'swap' needs a memory service started with --host-cache-memory; "
                                 "preempting by recompute")
            return False
        engine.scheduler.preempt(req, swap=True)
        engine.swaps += 1
        log.info("swapped_out", request_id=req.request_id, seq_ids=ids, host_blocks=resp.host_blocks_reserved,
                 device_blocks_released=resp.device_blocks_released)
        return True

    def swap_in(self, out: SchedulerOutput) -> set[int]:
        """Swap in the swapped-out requests this step admitted (``out.swapped``): one SwapInSequences
        for all of them, their sequences' block tables and grants from the reply; the module's
        fallbacks on OUT_OF_BLOCKS and SWAP_LOST (then one call per request, to find the lost one).
        Returns the ids of the sequences swapped in.

        Raises:
            client.errors.ServiceError: any other refusal.
        """
        engine = self.engine
        pending = list(out.swapped)
        one_by_one = False
        done: set[int] = set()
        while pending:
            batch = pending[:1] if one_by_one else pending[:MAX_BATCH]
            ids = [i for r in batch for i in r.seq_ids()]
            # Their slots for this step in the same call: its reply's grant is the step's only one.
            grow = {x.seq.seq_id: x for x in out.scheduled if x.request in batch and x.seq.seq_id is not None}
            try:
                resp = engine.memory.swap_in(engine.lease.lease_id, ids,
                                             [(i, x.num_new_tokens, x.token_ids) for i, x in grow.items()])
            except (OutOfBlocks, QuotaExceeded) as e:
                later = out.admitted[out.admitted.index(batch[-1]):]
                for r in reversed(later):
                    engine.scheduler.unadmit(r)
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
                self._recompute(batch[0], out, e.message)
                pending.remove(batch[0])
                continue
            for r in batch:
                pending.remove(r)
            done.update(self._apply(batch, resp, out, grow))
        return done

    def _apply(self, reqs: list[Request], resp: mpb.SwapInSequencesResponse, out: SchedulerOutput,
               grow: dict) -> list[int]:
        """Give ``reqs``' sequences their block tables and grants from a SwapInSequences reply
        (``grow``: seq_id -> its ScheduledSeq, grown in that call); returns the ids of those that
        run on (not recomputed)."""
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
                self._recompute(r, out, "the swapped-in block table does not match the tokens computed")
            else:
                self.engine.scheduler.swapped_in(r)
        log.info("swapped_in", request_ids=[r.request_id for r in reqs if id(r) not in lost])
        return [i for r in reqs if id(r) not in lost for i in r.seq_ids()]

    def _recompute(self, req: Request, out: SchedulerOutput, why: str) -> None:
        """Free swapped ``req``'s sequences; it leaves this step and waits at the front, recomputed."""
        engine = self.engine
        engine._free([req], mpb.FREE_REASON_PREEMPTED)
        engine.scheduler.recompute_swapped(req)
        engine.scheduler.unadmit(req)
        out.drop(req)
        engine.swap_fallbacks += 1
        log.warning("swap_lost", request_id=req.request_id, error=why)
