"""Preemption and its counters: a running request gives up its KV by swap or by recompute.

vLLM's two modes (PagedAttention, section 4.5): by recompute the engine frees the victim's
sequences and it waits at the front of the queue to be computed again; by swap
(client.engine.swap) its KV goes to the host tier and comes back when it is readmitted. A swap that
the memory service refuses falls back to recompute. :class:`Preemption` does both and counts them
for the engine's stats; it holds no engine.
"""

from __future__ import annotations

from collections.abc import Callable

from client.engine.scheduler import Scheduler, SchedulerOutput
from client.engine.swap import SwapOut, Swapper
from client.request import Request
from pagedkv.memory.v1 import memory_service_pb2 as mpb


class Preemption:
    """Preempts requests and counts what it did.

    Args:
        scheduler: the engine's scheduler (it requeues the victims).
        swapper: the engine's swap client (client.engine.swap).
        free: frees requests' sequences with a reason (FreeSequences).
        flush: hands in the receipts waiting for the next AppendSlots (before a swap-in).
    """

    def __init__(self, scheduler: Scheduler, swapper: Swapper, free: Callable[[list[Request], int], None],
                 flush: Callable[[], None]):
        self.scheduler, self.swapper, self.free, self.flush = scheduler, swapper, free, flush
        #: Requests preempted, by recompute or by swap; of them by swap (SwapOutSequences).
        self.preemptions = 0
        self.swaps = 0
        #: Swap preemptions that fell back to recompute (host tier off or full, a swap-in's SWAP_LOST).
        self.swap_fallbacks = 0
        #: Tokens the recompute preemptions threw away (computed again at readmission).
        self.recomputed_tokens = 0

    def preempt(self, req: Request, grown: set[int] = frozenset(), over_quota: bool = False) -> bool:
        """Preempt running ``req``: by swap when the mode asks and the memory service can, else by
        recompute; returns whether by swap. ``grown``: sequence ids that may not be swapped out now
        (grown by AppendSlots, or swapped in, in this step). ``over_quota``: the lease's block quota
        ran out, not the pool: by recompute, since swapped-out blocks still count against the quota."""
        swap = self.scheduler.config.preemption_mode == "swap" and not over_quota
        outcome = self.swapper.swap_out(req, grown) if swap else None
        if outcome == SwapOut.SWAPPED:
            self.scheduler.preempt(req, swap=True)
            self.swaps += 1
        else:
            self.swap_fallbacks += outcome == SwapOut.REFUSED
            self.recompute(req, count=False)
        self.preemptions += 1
        return outcome == SwapOut.SWAPPED

    def recompute(self, req: Request, count: bool = True) -> None:
        """Preempt running ``req`` by recompute, whatever the mode: its sequences are freed and it
        waits at the front of the queue (``count``: as one more preemption)."""
        self.recomputed_tokens += sum(s.num_computed for s in req.seqs)
        self.free([req], mpb.FREE_REASON_PREEMPTED)
        self.scheduler.preempt(req)
        self.preemptions += count

    def swap_in(self, out: SchedulerOutput) -> set[int]:
        """Swap in the readmitted swapped-out requests and apply the outcome to the scheduler;
        returns the ids of the sequences swapped in."""
        self.flush()  # swap-in's reloads follow proven positions only
        result = self.swapper.swap_in(out, lambda r: self.free([r], mpb.FREE_REASON_PREEMPTED))
        self.scheduler.swap_in_done(result.unadmitted, result.swapped_in)
        self.swap_fallbacks += result.fallbacks
        return result.seq_ids

    def recompute_swapped(self, req: Request) -> None:
        """Swapped-out ``req`` cannot be swapped in (the blocks its sequences still share may be what
        keeps it out): free its sequences and compute it again."""
        self.free([req], mpb.FREE_REASON_PREEMPTED)
        self.scheduler.recompute_swapped(req)
        self.swap_fallbacks += 1
