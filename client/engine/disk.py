"""The engine's side of the disk tier: moving its copies, and holding requests whose prefix is on disk.

DESIGN.md, "Disk tier": the memory service decides and queues every copy between the host tier
and the disk; a worker moves the bytes. The engine connects the two:

- :class:`DiskMover`, a thread of its own, takes queued copies from the memory service
  (TakeDiskWork), has a worker do them (CopyDiskBlocks: the worker's I/O thread, beside its steps)
  and hands the worker's receipts back (SettleDiskWork). Steps never wait for the disk. A batch
  whose worker fails is not settled: the memory service drops it after its timeout, so a read is
  asked again and a write is counted as dropped.
- :class:`DiskGate` holds a waiting request while its prompt's blocks are read from disk. Before
  a new request is admitted it asks PrefetchPrefix, which queues the reads. While reads are
  pending, the request waits and the scheduler admits the others behind it (vLLM's requests
  waiting for remote KV). Once the blocks are in the host tier, the allocation finds them and
  reloads them like any host hit. A request waits at most ``max_wait`` seconds; after that it
  computes what is not there yet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from client.errors import ServiceError
from client.request import Request, Status
from client.services import MemoryClient, WorkerClient
from pagedkv.runtime.logs import get_logger

log = get_logger("engine.disk")

#: Most seconds a request waits for its prompt's blocks to come back from disk.
DISK_MAX_WAIT = 10.0
#: Seconds the mover sleeps when there is nothing to copy, or after a failure.
IDLE_SLEEP, ERROR_SLEEP = 0.01, 0.2
#: Seconds a step with nothing to run sleeps while requests wait for disk reads (no busy loop).
DISK_POLL = 0.005


class DiskMover:
    """Moves the disk tier's queued copies through the workers, in a daemon thread (:meth:`start`).

    Args:
        memory: the memory service.
        workers: the workers, used in turn.
        lease_id: the engine's lease now (a lost lease is replaced).
        generation: the pool generation now.
    """

    def __init__(self, memory: MemoryClient, workers: list[WorkerClient], lease_id: Callable[[], str],
                 generation: Callable[[], int]):
        self.memory, self.workers = memory, workers
        self.lease_id, self.generation = lease_id, generation
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next = 0
        #: Copies done (receipts handed in) and batches that failed.
        self.copies = self.failures = 0

    def start(self) -> DiskMover:
        self._thread = threading.Thread(target=self._run, name="disk-mover", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def move_once(self) -> int:
        """Take one batch, have a worker do it and settle it; returns the copies done (0: none queued).

        Raises:
            client.errors.ServiceError: a call failed (the batch is left to expire).
        """
        lease = self.lease_id()
        copies = self.memory.take_disk_work(lease).copies
        if not copies:
            return 0
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        try:
            receipts = worker.copy_disk_blocks(self.generation(), copies).receipts
        except Exception as e:  # noqa: BLE001 - a worker gone or refusing: the batch expires at the memory service
            self.failures += 1
            log.warning("disk_copies_failed", worker=worker.address, copies=len(copies), error=str(e)[:200])
            return 0
        self.memory.settle_disk_work(lease, list(receipts))
        self.copies += len(receipts)
        return len(receipts)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                done = self.move_once()
            except ServiceError as e:
                log.info("disk_work_unavailable", error=str(e)[:200])
                done = 0
                self._stop.wait(ERROR_SLEEP)
            if not done:
                self._stop.wait(IDLE_SLEEP)


class DiskGate:
    """Whether a waiting request may be admitted now (the scheduler's admission gate).

    Args:
        memory: the memory service.
        lease_id: the engine's lease now.
        model_id: the prefix-cache identity of the model.
        max_wait: most seconds a request waits for its disk reads.
    """

    def __init__(self, memory: MemoryClient, lease_id: Callable[[], str], model_id: str,
                 max_wait: float = DISK_MAX_WAIT, clock: Callable[[], float] = time.monotonic):
        self.memory, self.lease_id, self.model_id = memory, lease_id, model_id
        self.max_wait, self.clock = max_wait, clock
        self._waiting_since: dict[str, float] = {}
        #: Requests that waited for disk reads, and those that stopped waiting at ``max_wait``.
        self.waited = self.gave_up = 0

    def __call__(self, req: Request) -> bool:
        """True when ``req`` may be admitted: it is not new (swapped, resumed), its prompt has no block
        on disk, its disk reads are done, or it has waited ``max_wait``."""
        if req.status == Status.SWAPPED or any(s.num_computed for s in req.seqs):
            return True
        try:
            got = self.memory.prefetch_prefix(self.lease_id(), list(req.prompt_token_ids), self.model_id,
                                              req.cache_salt)
        except ServiceError as e:
            log.info("prefetch_failed", request_id=req.request_id, error=str(e)[:200])
            return True
        since = self._waiting_since.get(req.request_id)
        if got.disk_reads_pending == 0:
            self._waiting_since.pop(req.request_id, None)
            return True
        if since is None:
            self._waiting_since[req.request_id] = self.clock()
            self.waited += 1
            return False
        if self.clock() - since >= self.max_wait:
            self._waiting_since.pop(req.request_id, None)
            self.gave_up += 1
            log.warning("disk_reads_slow", request_id=req.request_id, pending=got.disk_reads_pending,
                        waited_s=round(self.clock() - since, 1))
            return True
        return False


__all__ = ["DISK_MAX_WAIT", "DISK_POLL", "DiskGate", "DiskMover"]
