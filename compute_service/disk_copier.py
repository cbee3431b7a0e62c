"""A worker's disk-tier copies: the memory service's DiskCopy grants, done beside the steps.

DESIGN.md, "Disk tier": the memory service decides, the workers move the bytes. A scheduler takes
queued copies from the memory service (TakeDiskWork) and hands them to a worker
(``ComputeService.CopyDiskBlocks``), which runs them on an I/O thread of its own, never on the
step's compute thread. A slow disk therefore delays no step.

Each copy is checked before any byte moves. Its signature must be this generation's plane key's,
it must not have expired, and its host block must still have the epoch it names (the shared epoch
table): the memory service pinned the block (a write) or reserved it (a read's destination). Then:

- **write** (host block -> disk slot): the block's bytes go into the slot, with a header that
  carries the hash, parent, tokens, the model identity and the payload's SHA-256
  (`compute_service.disk_io`);
- **read** (disk slot -> host block): the slot's header must name the block the grant expects,
  and the payload must match its checksum. Only then are the bytes copied into the host block.

One signed DiskReceipt per copy says what happened (``ok``, or ``failure``: "refused", "header",
"checksum", "io"). Only with it does the memory service count a slot as written or a host block as
read. A copy on a CUDA node reads and writes the host tier, which is host memory every worker
maps, so no device synchronization is needed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from compute_service.disk_io import SlabIO, header_for, open_slab
from compute_service.pool_map import MappedPool
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime.errors import POOL_GENERATION_MISMATCH, POOL_NOT_MAPPED, FailedPreconditionError
from pagedkv.runtime.grants import disk_signed, sign_disk
from pagedkv.runtime.logs import get_logger

log = get_logger("disk_copier")


class DiskCopier:
    """Does disk-tier copies over one mapped pool (its host tier and the descriptor's disk tier).

    Thread-safe: one batch at a time (a lock), on the caller's thread (the server runs it on an
    I/O executor). Slab files are opened on first use and kept open until :meth:`close`.
    """

    def __init__(self, pool: MappedPool):
        self.pool = pool
        info = pool.descriptor.disk_tier if pool.descriptor.HasField("disk_tier") else None
        self.info = info
        self._slabs: dict[int, SlabIO] = {}
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Close the slab files; later batches are refused (the pool is being dropped)."""
        with self._lock:
            self._closed = True
            for io in self._slabs.values():
                io.close()
            self._slabs.clear()

    def run(self, copies) -> list[grant_pb2.DiskReceipt]:
        """Do ``copies`` (DiskCopy grants) in order; one signed receipt each.

        Raises:
            FailedPreconditionError: the pool has no host or disk tier (nothing done).
        """
        pool = self.pool
        with self._lock:  # checked under the lock: :meth:`close` (a pool being dropped) waits for a batch in flight
            if self._closed or self.info is None or pool.host_tensor is None:
                raise FailedPreconditionError("no disk tier is mapped (the pool is being dropped, or the memory "
                                              "service runs without --disk-cache-dir); retry shortly",
                                              reason=POOL_NOT_MAPPED)
            return [sign_disk(pool.plane_key, self._one(c)) for c in copies]

    def _one(self, c: grant_pb2.DiskCopy) -> grant_pb2.DiskReceipt:
        pool, info = self.pool, self.info
        receipt = grant_pb2.DiskReceipt(pool_generation=pool.generation, work_id=c.work_id)
        host = pool.host_tensor
        if (c.pool_generation != pool.generation or not disk_signed(pool.plane_key, c) or c.expires_at < time.time()
                or c.host_block >= host.shape[0] or c.slot >= info.num_slots
                or int(pool.host_epochs[c.host_block]) != c.host_epoch):
            receipt.failure = "refused"
            return receipt
        block = host[c.host_block].reshape(-1).view(torch.uint8).numpy()  # the host block's bytes
        try:
            io = self._slab(c.slot // info.slots_per_slab)
            slot = c.slot % info.slots_per_slab
            if c.write:
                header = header_for(block, identity=bytes(info.identity), block_hash=bytes(c.block_hash),
                                    parent_hash=bytes(c.parent_hash) or None, tokens=c.token_ids,
                                    sequence=c.sequence)
                io.write(slot, header, block)
                receipt.ok, receipt.checksum = True, header.checksum
            else:
                result = io.read(slot, block, identity=bytes(info.identity), block_hash=bytes(c.block_hash))
                if result.ok:
                    receipt.ok, receipt.checksum = True, result.header.checksum  # the read checked the bytes against it
                else:
                    receipt.failure = result.reason
                    log.warning("disk_block_unreadable", slot=c.slot, reason=result.reason)
        except OSError as e:
            receipt.failure = "io"
            log.warning("disk_io_failed", slot=c.slot, write=c.write, error=str(e))
        return receipt

    def _slab(self, i: int) -> SlabIO:
        io = self._slabs.get(i)
        if io is None:
            path = Path(self.info.folder) / f"slab-{i:03d}.bin"
            fd, direct = open_slab(str(path))
            io = self._slabs[i] = SlabIO(fd, self.info.slot_bytes, direct)
        return io


def check_generation(pool: MappedPool | None, generation: int) -> MappedPool:
    """The mapped pool, if it is of ``generation``.

    Raises:
        FailedPreconditionError: no pool mapped, or another generation.
    """
    if pool is None:
        raise FailedPreconditionError("the worker has no pool mapped; retry shortly", reason=POOL_NOT_MAPPED)
    if generation != pool.generation:
        raise FailedPreconditionError(f"the request's pool generation {generation} is not the mapped pool's "
                                      f"{pool.generation}", reason=POOL_GENERATION_MISMATCH)
    return pool


__all__ = ["DiskCopier", "check_generation"]
