"""Which worker runs a request: the least loaded at admission, a decode worker once its prompt is
computed (disaggregated prefill and decode over one pool), another one when its worker fails.

A mixin of :class:`client.engine.scheduler.Scheduler`: it reads the scheduler's ``running``,
``waiting`` (under its ``_lock``), ``prefill_workers``, ``decode_workers``, ``down`` and
``num_workers``, and counts ``handoffs``. Moving a request is a scheduling decision, never a copy:
every worker maps the same pool (DESIGN.md).
"""

from __future__ import annotations

import collections
import threading

from client.request import Request


class WorkerPlacement:
    """Worker choice for requests (mixed into ``Scheduler``)."""

    running: list[Request]
    waiting: collections.deque[Request]
    prefill_workers: list[int]
    decode_workers: list[int]
    down: set[int]
    num_workers: int
    handoffs: int
    _lock: threading.Lock

    def _least_loaded(self, workers: list[int]) -> int:
        """The least loaded of ``workers`` that is not down (of any live worker when none of them is)."""
        live = [w for w in workers if w not in self.down] or \
            [w for w in range(self.num_workers) if w not in self.down] or workers
        load = collections.Counter(r.worker for r in self.running)
        return min(live, key=lambda w: load[w])

    def repin(self, worker: int) -> list[Request]:
        """Pin every request pinned to ``worker`` (running, waiting or swapped) to the least loaded
        live worker of its phase; returns them."""
        with self._lock:
            pinned = [r for r in [*self.running, *self.waiting] if r.worker == worker]
        for r in pinned:
            prefilled = all(s.num_computed >= len(s.tokens) - 1 for s in r.live_seqs()) and r.seqs
            r.worker = self._least_loaded(self.decode_workers if prefilled else self.prefill_workers)
        return pinned

    def hand_off(self, req: Request) -> bool:
        """Move ``req`` from a prefill-only worker to the least loaded decode worker once its prompt is
        computed (every live sequence past its prompt); True when it moved. Its KV stays where it is:
        every worker maps the pool (DESIGN.md: a sequence may move between workers between steps)."""
        if (req.worker in self.decode_workers and req.worker not in self.down) or req.finished:
            return False
        if any(s.num_computed < len(s.tokens) - 1 for s in req.live_seqs()):
            return False
        req.worker = self._least_loaded(self.decode_workers)
        self.handoffs += 1
        return True


__all__ = ["WorkerPlacement"]
