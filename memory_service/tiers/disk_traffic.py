"""The disk tier's traffic with the host tier: write-through, reads for a prefix, and the work queue.

Mixed into :class:`memory_service.tiers.manager.Tiers`. DESIGN.md, "Disk tier"; the memory service
decides and the workers move the bytes:

- **Write-through** (SGLang HiCache's ``write_through`` policy from host to L3): a block whose
  content is proven in the host tier gets a disk slot at once. The host block is pinned, and a
  write is queued. A host block evicted later is then already on disk, and the eviction waits for
  nothing. When the disk cannot take it (``max_pending_writes`` in flight, or no evictable slot),
  the write is dropped and counted.
- **Reads for a prefix** (:meth:`TierDisk.prefetch_disk`): the disk's blocks continuing a prompt's
  device and host hits get a pending host block each (the read's destination), their slots are
  pinned, and reads are queued. Once a receipt proves a read, its host block is a cached hit like
  any other, so the prompt's allocation reloads it to the device (:mod:`memory_service.tiers.manager`).
  A request whose prefix is on disk waits for its reads, and the others go on.
- **The queue**: a scheduler takes work (:meth:`TierDisk.take_disk_work`), has a worker do it off
  the step path (``CopyDiskBlocks``), and settles it with the worker's receipts
  (:meth:`TierDisk.settle_disk_work`). Work taken and not settled within ``timeout`` is dropped,
  as if the worker had died.

Nothing here touches KV bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from memory_service.manager.requests import DISK
from memory_service.tiers.disk_tier import DiskTier
from pagedkv.runtime.block_hash import CacheKey, leading_hits

WRITE, READ = "write", "read"
#: Seconds a scheduler may hold taken disk work before it is dropped (its worker presumed gone).
DISK_WORK_TIMEOUT = 30.0


@dataclass(slots=True)
class DiskWork:
    """One granted copy between a host block and a disk slot."""

    work_id: int
    kind: str  # WRITE (host block -> disk slot) or READ (disk slot -> host block)
    host: int
    host_epoch: int
    slot: int
    slot_epoch: int
    block_hash: bytes
    parent: bytes  # b"" for a first block
    tokens: tuple[int, ...]
    sequence: int  # a write's number (the slot's LRU order after a restart); 0 for a read
    taken_at: float | None = None  # when a scheduler took it; None while queued


class TierDisk:
    """The disk half of :class:`~memory_service.tiers.manager.Tiers` (needs its ``host`` and ``pool``)."""

    disk: DiskTier | None = None

    def attach_disk(self, disk: DiskTier) -> None:
        """Put ``disk`` behind the host tier (there must be one: it stages every disk copy)."""
        assert self.host is not None, "a disk tier stages its copies through the host tier"
        self.disk = disk
        self.disk_queue: deque[DiskWork] = deque()
        self.disk_taken: dict[int, DiskWork] = {}
        #: Block hash -> its queued or taken read (a second prompt on the same block waits for it too).
        self.disk_reading: dict[bytes, DiskWork] = {}
        self._next_work = 1
        self.host.on_cached = self._write_through
        disk.on_stored = lambda s, k, parent, toks: self.cache.emit(
            "stored", block_id=s, block_hash=k, parent_hash=parent, token_ids=toks, medium=DISK)
        disk.on_removed = lambda s, k: self.cache.emit("removed", block_id=s, block_hash=k, medium=DISK)

    # -------------------------------------------------------------- write-through
    def _write_through(self, h: int) -> None:
        host = self.host
        got = self.disk.reserve_write(host.hash_of[h], host.tokens[h], host.parent[h])
        if got is None:
            return
        s, seq = got
        host.pin([h])
        self._queue(WRITE, h, s, seq)

    def _queue(self, kind: str, h: int, s: int, seq: int) -> DiskWork:
        host = self.host
        w = DiskWork(self._next_work, kind, h, int(host.epochs[h]), s, int(self.disk.epochs[s]), host.hash_of[h],
                     host.parent[h], host.tokens[h], seq)
        self._next_work += 1
        self.disk_queue.append(w)
        return w

    # --------------------------------------------------------------------- reads
    def prefetch_disk(self, token_ids: Seq[int], key: CacheKey, parent: bytes | None, start: int) -> tuple[int, int]:
        """Queue reads of the disk's blocks continuing a lookup (full blocks from block index
        ``start``, ``parent`` the hash before it; never the block holding the last token), each
        into a fresh pending host block, as far as the host tier has room. Returns ``(disk blocks
        found, reads of them still in flight)``: the prompt's allocation finds them in the host
        tier once that second count is 0."""
        if self.disk is None or not token_ids:
            return 0, 0
        hits = leading_hits(token_ids, self.pool.block_size, key, self.disk.lookup, parent, start)
        in_flight = 0
        for k, s in hits:
            if k in self.disk_reading:
                in_flight += 1
                continue
            h = self.host.reserve_offload(k, self.disk.tokens[s], self.disk.parent[s])
            if h is None:  # on the host already (a read just proven), or no room there now
                if self.host.lookup(k, self.disk.tokens[s]) is None:
                    break
                continue
            self.disk.pin([s])
            self.disk_reading[k] = self._queue(READ, h, s, 0)
            in_flight += 1
        return len(hits), in_flight

    # ---------------------------------------------------------------------- queue
    def take_disk_work(self, limit: int, now: float) -> list[DiskWork]:
        """Up to ``limit`` queued copies for a scheduler to have a worker do: reads first (a request
        waits for them), then writes, each oldest first."""
        if self.disk is None or not self.disk_queue:
            return []
        reads = [w for w in self.disk_queue if w.kind == READ]
        out = (reads + [w for w in self.disk_queue if w.kind == WRITE])[:limit]
        taken = {w.work_id for w in out}
        self.disk_queue = deque(w for w in self.disk_queue if w.work_id not in taken)
        for w in out:
            w.taken_at = now
            self.disk_taken[w.work_id] = w
        return out

    def settle_disk_work(self, work_id: int, ok: bool | None) -> bool:
        """A taken copy ended: ``ok`` True (a receipt proves it), False (the worker found the slot's
        header or checksum wrong: a read's block is dropped and counted; or a write failed: ENOSPC,
        EIO), None (not done). Returns False for work no longer taken (settled or expired before)."""
        w = self.disk_taken.pop(work_id, None)
        if w is None:
            return False
        host, disk = self.host, self.disk
        if w.kind == WRITE:
            if ok:
                disk.write_proven(w.slot)
            else:
                disk.write_dropped(w.slot)
            host.unpin(w.host, reloaded=False)
        else:
            del self.disk_reading[w.block_hash]
            if ok:
                disk.hits += self.pool.block_size
                host.offload_proven(w.host, from_disk=True)
            else:
                host.offload_dropped(w.host, from_disk=True)
            disk.unpin(w.slot, read=ok)
        return True

    def expire_disk_work(self, now: float, timeout: float = DISK_WORK_TIMEOUT) -> int:
        """Drop work taken more than ``timeout`` seconds ago (its worker died or hangs); returns how many."""
        old = [w.work_id for w in self.disk_taken.values() if now - w.taken_at > timeout]
        for i in old:
            self.settle_disk_work(i, None)
        return len(old)

    def disk_pins(self) -> dict[int, int]:
        """Host block -> pins held by queued or taken writes (for the invariant check)."""
        out: dict[int, int] = {}
        for w in [*self.disk_queue, *self.disk_taken.values()]:
            if w.kind == WRITE:
                out[w.host] = out.get(w.host, 0) + 1
        return out

    def disk_read_targets(self) -> set[int]:
        """Host blocks pending as the destination of a queued or taken read."""
        return {w.host for w in [*self.disk_queue, *self.disk_taken.values()] if w.kind == READ}


__all__ = ["DISK_WORK_TIMEOUT", "READ", "WRITE", "DiskWork", "TierDisk"]
