"""The disk tier: slots in preallocated files behind the host tier, and their index (headers only).

The third tier of SGLang's HiCache (L3), LMCache's local disk backend and Dynamo's KVBM G3: a
cached block evicted from the host tier is written to a disk slot, keeping its hash, and a prefix
lookup that continues past the host's hits reads it back through the host tier. The files outlive
the memory service, so a restarted node starts warm. DESIGN.md, "Disk tier": the memory service
owns the directory and keeps this index; workers write and read the slots as granted copies,
computing and checking each block's checksum (`compute_service.disk_io`), and a receipt proves
each copy. This module never reads or writes a payload.

Files: ``<dir>/<identity digest, 32 hex>/slab-NNN.bin``, each `SLAB_BYTES` or less, preallocated,
with fixed-size slots (`pagedkv.runtime.disk_block`). One folder per model identity: blocks of
another model, revision, KV dtype, block size, layout or fp8 scales never share a slot. Why slabs
and not one file per block: docs/benchmarks.md, section 21, "The disk tier's files".

Every slot is in one state:

- ``free``: nothing the index knows (an empty, torn or foreign slot after a restart);
- ``pending``: a write is granted and no receipt has proven it yet (never a hit);
- ``cached``: holds a block (proven, or found at start with a valid header): a hit. When no read
  is in flight from it (``pins == 0``) it can be evicted, least recently used first, and leaves
  before parents (a block no other disk block continues).

Bounded: the slots fit ``capacity_bytes``. At most ``max_pending_writes`` writes are in flight,
and an offload past that, or with no evictable slot, is dropped and counted. Nothing here blocks:
the workers do the I/O.

NOTE: invariants (checked by :meth:`DiskTier.check`):
  * ``num_free + num_cached + num_pending == num_slots``;
  * a slot is in ``free_queue``  <=>  free; in ``lru``  <=>  cached and unpinned;
  * ``cached[k] == s``  <=>  ``hash_of[s] == k`` and cached; ``pending[k] == s``  <=>  ``hash_of[s] == k``
    and pending;
  * ``children[k]`` = the cached and pending slots whose parent hash is ``k``.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.runtime.disk_block import HEADER_BYTES, MAGIC, identity_digest, slot_bytes, unpack_header
from pagedkv.runtime.logs import get_logger

log = get_logger("disk_tier")

FREE, PENDING, CACHED = "free", "pending", "cached"
#: Largest slab file (bytes): a few large files rather than one per block.
SLAB_BYTES = 1 << 30
#: Writes in flight by default; an offload past it is dropped and counted.
MAX_PENDING_WRITES = 64


def own_directory(path: Path) -> Path:
    """Create ``path`` (mode 0700) or check that it is this process's: a directory owned by this
    uid. One with group or other permission bits is tightened to 0700 (and logged).

    Raises:
        PermissionError: another uid owns it, or it is not a directory (a symlink included).
    """
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"--disk-cache-dir {path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"--disk-cache-dir {path} is owned by uid {st.st_uid}, not this service's uid "
                              f"{os.getuid()}: the disk tier's directory must be the memory service's alone")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
        log.warning("disk_dir_mode_tightened", path=str(path), mode=oct(stat.S_IMODE(st.st_mode)))
    return path


@dataclass(frozen=True, slots=True)
class SlotLocation:
    """Where a slot's bytes are: its slab file and byte offset."""

    path: str
    offset: int


class DiskTier:
    """The disk tier of one model identity under ``directory``.

    Args:
        directory: ``--disk-cache-dir`` (created 0700, or checked: `own_directory`).
        identity: the model identity (JSON-able: name, source, revision, KV dtype, block size,
            layout, fp8 scales' digest); its digest names the folder.
        block_nbytes: bytes of one block's payload.
        capacity_bytes: ``--disk-cache-size``: slots and headers never exceed it.
        max_pending_writes: writes in flight at most.
        slab_bytes: largest slab file.

    Raises:
        ValueError: a capacity smaller than one slot.
        PermissionError: a directory that is not this service's (`own_directory`).
        OSError: the folder cannot be made or read.
    """

    def __init__(self, directory: Path, identity: dict, block_nbytes: int, capacity_bytes: int, *,
                 max_pending_writes: int = MAX_PENDING_WRITES, slab_bytes: int = SLAB_BYTES):
        self.slot_bytes = slot_bytes(block_nbytes)
        if capacity_bytes < self.slot_bytes:
            raise ValueError(f"--disk-cache-size {capacity_bytes} B holds no block: one needs {self.slot_bytes} B")
        self.block_nbytes = block_nbytes
        self.identity = identity_digest(identity)
        self.folder = own_directory(directory) / self.identity.hex()[:32]
        self.folder.mkdir(mode=0o700, exist_ok=True)
        _write_identity(self.folder / "identity.json", identity)
        self.slots_per_slab = max(1, slab_bytes // self.slot_bytes)
        #: Slots in the tier (fewer than the capacity allows when the file system ran out of space).
        self.num_slots = self._preallocate(capacity_bytes // self.slot_bytes)
        if self.num_slots == 0:
            raise OSError(errno.ENOSPC, f"no space for one disk-tier slot under {self.folder}")
        self.max_pending_writes = max_pending_writes
        #: epochs[s]: bumped each time slot s is handed out anew (a grant naming its old use no longer matches).
        self.epochs = np.zeros(self.num_slots, dtype=np.int64)
        self.state = [FREE] * self.num_slots
        self.free_queue: deque[int] = deque()
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.pins = [0] * self.num_slots
        self.hash_of: list[bytes | None] = [None] * self.num_slots
        self.tokens: list[tuple[int, ...] | None] = [None] * self.num_slots
        self.parent: list[bytes] = [b""] * self.num_slots
        self.cached: dict[bytes, int] = {}
        self.pending: dict[bytes, int] = {}
        self.children: Counter[bytes] = Counter()
        #: Writes proven; offloads to disk dropped (no room, queue full, or unproven); reads proven.
        self.writes = self.dropped = self.reads = 0
        #: Prompt tokens found here; slots evicted; reads whose header or checksum failed (dropped).
        self.hits = self.evictions = self.checksum_failures = 0
        #: Blocks found at start (a warm restart), and slots whose header was there but torn or flipped.
        self.recovered = self.unreadable_at_start = 0
        #: Called as ``on_stored(s, hash, parent, tokens)`` / ``on_removed(s, hash)`` (KV events, medium DISK).
        self.on_stored: Callable[[int, bytes, bytes, tuple[int, ...]], None] | None = None
        self.on_removed: Callable[[int, bytes], None] | None = None
        self._sequence = self._scan()

    # ------------------------------------------------------------------- files
    def location(self, s: int) -> SlotLocation:
        """Slab file and byte offset of slot ``s``."""
        return SlotLocation(str(self._slab(s // self.slots_per_slab)), (s % self.slots_per_slab) * self.slot_bytes)

    def slabs(self) -> list[str]:
        """Every slab file's path, in slot order (slot ``s`` is in ``slabs()[s // slots_per_slab]``)."""
        return [str(self._slab(i)) for i in range(-(-self.num_slots // self.slots_per_slab))]

    def _slab(self, i: int) -> Path:
        return self.folder / f"slab-{i:03d}.bin"

    def _preallocate(self, want: int) -> int:
        """Create or extend the slab files for ``want`` slots; returns the slots that got space
        (fewer on ENOSPC, logged)."""
        made = 0
        for i in range(-(-want // self.slots_per_slab)):
            n = min(self.slots_per_slab, want - made)
            fd = os.open(self._slab(i), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                os.posix_fallocate(fd, 0, n * self.slot_bytes)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EFBIG):
                    raise
                fit = os.fstat(fd).st_size // self.slot_bytes
                log.warning("disk_tier_short_of_space", slab=str(self._slab(i)), slots=made + fit, wanted=want,
                            error=str(e))
                return made + min(fit, n)
            finally:
                os.close(fd)
            made += n
        return made

    def _scan(self) -> int:
        """Rebuild the index from every slot's header (the memory service reads headers only): a
        valid header of this identity is a cached block; the newest copy of a hash wins; the rest is
        free. Returns the next write's sequence number."""
        found: list[tuple[int, int, object]] = []
        for i, path in enumerate(self.slabs()):
            first = i * self.slots_per_slab
            with open(path, "rb", buffering=0) as f:
                for s in range(first, min(first + self.slots_per_slab, self.num_slots)):
                    raw = os.pread(f.fileno(), HEADER_BYTES, (s - first) * self.slot_bytes)
                    h = unpack_header(raw, self.identity)
                    if h is None or h.payload_bytes != self.block_nbytes:
                        self.unreadable_at_start += raw[:len(MAGIC)] == MAGIC  # a torn or flipped header
                        self.free_queue.append(s)
                        continue
                    found.append((h.sequence, s, h))
        found.sort(key=lambda t: t[0])  # oldest first: the LRU order
        newest = 0
        for seq, s, h in found:
            old = self.cached.get(h.block_hash)
            if old is not None:  # a later copy of the same block: keep the newest
                self._forget(old, evicted=False)
                self.lru.pop(old)
                self._release(old)
            self.state[s] = CACHED
            self._set(s, h.block_hash, h.tokens, h.parent_hash if any(h.parent_hash) else b"")
            self.cached[h.block_hash] = s
            self.lru[s] = None
            newest = max(newest, seq)
        self.recovered = len(self.cached)
        if self.recovered:
            log.info("disk_tier_recovered", blocks=self.recovered, slots=self.num_slots, folder=str(self.folder))
        return newest + 1

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return len(self.cached) + sum(1 for s in range(self.num_slots) if self.state[s] == CACHED
                                      and self.hash_of[s] is None)

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks on disk (cached slots, headers included)."""
        return len(self.cached) * self.slot_bytes

    # ------------------------------------------------------------------- write
    def reserve_write(self, block_hash: bytes, tokens: tuple[int, ...], parent: bytes) -> tuple[int, int] | None:
        """A pending slot for the content of an evicted host block: ``(slot, write sequence)``, or
        None when nothing is to write (the block is on disk already: made most recent; or being
        written) or it cannot be written now (``max_pending_writes`` in flight, or no free or
        evictable slot: counted as dropped)."""
        s = self.cached.get(block_hash)
        if s is not None:
            if s in self.lru:
                self.lru.move_to_end(s)
            return None
        if block_hash in self.pending:
            return None
        if len(self.pending) >= self.max_pending_writes:
            self.dropped += 1
            return None
        s = self._take()
        if s is None:
            self.dropped += 1
            return None
        self.state[s] = PENDING
        self._set(s, block_hash, tokens, parent)
        self.pending[block_hash] = s
        seq, self._sequence = self._sequence, self._sequence + 1
        return s, seq

    def write_proven(self, s: int) -> None:
        """A receipt proves the write into pending slot ``s``: a cached hit (a "stored" event)."""
        assert self.state[s] == PENDING, f"disk slot {s} is {self.state[s]}, not pending"
        k = self.hash_of[s]
        del self.pending[k]
        self.state[s] = CACHED
        self.cached[k] = s
        self.lru[s] = None
        self.writes += 1
        if self.on_stored is not None:
            self.on_stored(s, k, self.parent[s], self.tokens[s])

    def write_dropped(self, s: int) -> None:
        """The write into pending slot ``s`` will never be proven (failed: ENOSPC, EIO; or its step
        did not run it): the slot is free again, the offload counted as dropped."""
        assert self.state[s] == PENDING, f"disk slot {s} is {self.state[s]}, not pending"
        del self.pending[self.hash_of[s]]
        self._release(s)
        self.dropped += 1

    # -------------------------------------------------------------------- read
    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The cached slot holding ``block_hash`` with exactly these ``tokens`` (re-checked), or None."""
        s = self.cached.get(block_hash)
        return s if s is not None and self.tokens[s] == tokens else None

    def pin(self, slots: Iterable[int]) -> None:
        """A read from each cached slot starts: it cannot be evicted until :meth:`unpin`."""
        for s in slots:
            assert self.state[s] == CACHED, f"pin of disk slot {s} in state {self.state[s]}"
            self.pins[s] += 1
            self.lru.pop(s, None)

    def unpin(self, s: int, *, read: bool | None) -> None:
        """A read from ``s`` ended: ``read`` True (proven), None (not run: the sequence went first),
        or False (the worker found its header or checksum wrong: the block is dropped from the
        index at once, counted, and never served again)."""
        assert self.pins[s] > 0, f"unpin of disk slot {s} with no pin"
        self.pins[s] -= 1
        self.reads += read is True
        if read is False and self.hash_of[s] is not None:
            self.checksum_failures += 1
            self._forget(s, evicted=True)
        if self.pins[s] == 0:
            if self.hash_of[s] is None:
                self._release(s)
            else:
                self.lru[s] = None

    # ----------------------------------------------------------------- helpers
    def _set(self, s: int, k: bytes, tokens: tuple[int, ...], parent: bytes) -> None:
        self.hash_of[s], self.tokens[s], self.parent[s] = k, tokens, parent
        if parent:
            self.children[parent] += 1

    def _take(self) -> int | None:
        """A free slot, else the least recently used evictable leaf's (its epoch bumped); None if none."""
        if self.free_queue:
            s = self.free_queue.popleft()
        else:
            s = next((s for s in self.lru if not self.children[self.hash_of[s]]), None)
            if s is None:
                return None
            del self.lru[s]
            self._forget(s, evicted=True)
            self.state[s] = FREE
        self.epochs[s] += 1
        return s

    def _forget(self, s: int, evicted: bool) -> None:
        """Cached slot ``s`` leaves the index (a "removed" event when evicted or dropped)."""
        k = self.hash_of[s]
        del self.cached[k]
        self._unset(s)
        if evicted:
            self.evictions += 1
            if self.on_removed is not None:
                self.on_removed(s, k)

    def _unset(self, s: int) -> None:
        if self.parent[s]:
            self.children[self.parent[s]] -= 1
            if not self.children[self.parent[s]]:
                del self.children[self.parent[s]]
        self.hash_of[s], self.tokens[s], self.parent[s] = None, None, b""

    def _release(self, s: int) -> None:
        if self.hash_of[s] is not None:
            self._unset(s)
        self.state[s] = FREE
        self.free_queue.append(s)

    def stats(self) -> dict[str, int]:
        """What GetStats and the metrics report (blocks and bytes on disk, and the counters)."""
        return {"disk_blocks": len(self.cached), "disk_bytes": self.nbytes, "disk_slots": self.num_slots,
                "disk_hits": self.hits, "disk_writes": self.writes, "disk_reads": self.reads,
                "disk_dropped": self.dropped, "disk_checksum_failures": self.checksum_failures,
                "disk_evictions": self.evictions, "disk_recovered": self.recovered}

    def check(self) -> None:
        """Assert the module's invariants (O(num_slots))."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "disk free queue holds a slot twice"
        children: Counter[bytes] = Counter()
        for s, st in enumerate(self.state):
            assert (s in free) == (st == FREE), f"disk slot {s}: state {st}, in free queue {s in free}"
            assert (s in self.lru) == (st == CACHED and self.pins[s] == 0), f"disk slot {s}: lru vs state {st}"
            assert self.pins[s] == 0 or st == CACHED, f"disk slot {s}: pinned in state {st}"
            if st == FREE:
                assert self.hash_of[s] is None, f"disk slot {s}: free with a hash"
            if st == CACHED and self.hash_of[s] is None:
                assert self.pins[s] > 0, f"disk slot {s}: cached without a hash and unpinned"
            if self.hash_of[s] is not None and self.parent[s]:
                children[self.parent[s]] += 1
        assert all(self.state[s] == CACHED and self.hash_of[s] == k for k, s in self.cached.items())
        assert all(self.state[s] == PENDING and self.hash_of[s] == k for k, s in self.pending.items())
        assert children == self.children, "disk children counts disagree with the slots' parents"
        assert self.num_free + self.num_cached + self.num_pending == self.num_slots


def _write_identity(path: Path, identity: dict) -> None:
    """The identity a folder holds, readable (written once; atomically)."""
    if path.exists():
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


__all__ = ["CACHED", "FREE", "PENDING", "DiskTier", "SlotLocation", "own_directory"]
