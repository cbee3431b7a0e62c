"""memory_service.tiers.disk_tier with compute_service.disk_io: the disk tier's slots, index and bytes.

References: exact slot ids and counters after each operation, the index rebuilt by a second
DiskTier over the same files (a restart), the payload bytes compared with what was written, and
`DiskTier.check` after every step.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from compute_service.disk_io import SlabIO, header_for, open_slab
from memory_service.tiers.disk_tier import CACHED, FREE, PENDING, DiskTier, own_directory
from pagedkv.runtime import test_hooks
from pagedkv.runtime.block_hash import CacheKey, chain_hashes
from pagedkv.runtime.disk_block import HEADER_BYTES, slot_bytes

BLOCK_NBYTES = 3 * 4096 + 100  # not page-aligned: the slot pads it
IDENTITY = {"model": "tiny", "revision": "main", "kv_dtype": "bfloat16", "block_size": 4, "layout": [2, 2, 16]}
TOKENS = list(range(100, 140))
HASHES = chain_hashes(TOKENS, 4, CacheKey("tiny"), 10)


def block(i: int) -> tuple[bytes, tuple[int, ...], bytes]:
    """(hash, tokens, parent hash) of block ``i`` of the test prompt."""
    return HASHES[i], tuple(TOKENS[4 * i:4 * i + 4]), HASHES[i - 1] if i else b""


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK_NBYTES, dtype=np.uint8)


def tier(path, slots: int = 4, **kw) -> DiskTier:
    t = DiskTier(path, IDENTITY, BLOCK_NBYTES, slots * slot_bytes(BLOCK_NBYTES), **kw)
    t.check()
    return t


def write(t: DiskTier, i: int, proven: bool = True) -> int | None:
    """Reserve a slot for block ``i``, write it as a worker does, and settle it."""
    got = t.reserve_write(*block(i))
    if got is None:
        return None
    s, seq = got
    loc = t.location(s)
    fd, direct = open_slab(loc.path, direct=i % 2 == 1)  # both ways: one file, the same bytes
    io = SlabIO(fd, t.slot_bytes, direct)
    try:
        k, tokens, parent = block(i)
        io.write(loc.offset // t.slot_bytes, header_for(payload(i), identity=t.identity, block_hash=k,
                                                         parent_hash=parent, tokens=tokens, sequence=seq), payload(i))
    finally:
        io.close()
    (t.write_proven if proven else t.write_dropped)(s)
    t.check()
    return s


def read(t: DiskTier, s: int):
    loc = t.location(s)
    fd, direct = open_slab(loc.path)
    io = SlabIO(fd, t.slot_bytes, direct)
    into = np.zeros(BLOCK_NBYTES, dtype=np.uint8)
    try:
        return io.read(loc.offset // t.slot_bytes, into), into
    finally:
        io.close()


def test_write_read_and_restart_finds_every_block(tmp_path):
    t = tier(tmp_path / "disk")
    assert [write(t, i) for i in range(3)] == [0, 1, 2]
    assert (t.writes, len(t.cached), t.nbytes) == (3, 3, 3 * t.slot_bytes)
    assert t.lookup(*block(1)[:2]) == 1 and t.lookup(HASHES[1], (0, 0, 0, 0)) is None, "tokens are re-checked"
    result, got = read(t, 1)
    assert result.ok and np.array_equal(got, payload(1))
    assert result.header.block_hash == HASHES[1] and result.header.parent_hash == HASHES[0]
    # A restart over the same files: the same blocks, at the same slots, in the same LRU order.
    again = tier(tmp_path / "disk")
    assert again.recovered == 3 and again.cached == t.cached and list(again.lru) == [0, 1, 2]
    assert [again.tokens[s] for s in range(3)] == [block(i)[1] for i in range(3)]
    assert write(again, 3) == 3 and again.reserve_write(*block(0)) is None, "block 0 is on disk already"
    assert list(again.lru) == [1, 2, 3, 0], "a write of a block already there makes it the most recent"
    assert stat_mode(tmp_path / "disk") == 0o700 and stat_mode(again.folder) == 0o700


def stat_mode(p) -> int:
    return os.stat(p).st_mode & 0o777


def test_eviction_is_lru_leaves_first_and_bounded(tmp_path):
    t = tier(tmp_path / "disk", slots=3)
    for i in range(3):
        write(t, i)
    assert t.reserve_write(*block(0)) is None
    # Full: block 3 evicts the least recent leaf. Block 0 is most recent but has a child (1), and
    # 1 has a child (2); 2 is the only leaf.
    assert write(t, 3) == 2 and t.evictions == 1 and HASHES[2] not in t.cached
    assert t.epochs.tolist() == [1, 1, 2], "a slot handed out anew gets a new epoch"
    assert sorted(os.path.getsize(p) for p in t.slabs()) == [3 * t.slot_bytes], "the files never grow"
    t.pin([t.cached[HASHES[3]]])
    assert write(t, 5) == 1, "block 1 lost its only child: the least recent leaf now"
    assert write(t, 6) == 0, "then block 0 (its child went too)"
    t.pin([0, 1])
    # Every cached slot is pinned now (a read in flight): nothing to evict, the offload is dropped.
    assert t.reserve_write(*block(7)) is None and t.dropped == 1
    t.check()


def test_pending_writes_are_bounded_and_unproven_ones_dropped(tmp_path):
    t = tier(tmp_path / "disk", slots=4, max_pending_writes=2)
    a, b = t.reserve_write(*block(0)), t.reserve_write(*block(1))
    assert a[0] == 0 and b[0] == 1 and a[1] < b[1]
    assert t.reserve_write(*block(2)) is None and t.dropped == 1, "the write queue is full"
    assert t.reserve_write(*block(0)) is None and t.dropped == 1, "being written already: nothing to do"
    assert t.state[:2] == [PENDING, PENDING] and t.lookup(*block(0)[:2]) is None, "a pending slot is never a hit"
    t.write_dropped(0)
    assert t.state[0] == FREE and t.dropped == 2
    t.write_proven(1)
    assert t.state[1] == CACHED
    t.check()


def test_corrupt_payload_is_never_served_and_is_counted(tmp_path):
    t = tier(tmp_path / "disk")
    s = write(t, 0)
    loc = t.location(s)
    with open(loc.path, "r+b") as f:  # flip one payload bit
        f.seek(loc.offset + HEADER_BYTES + 777)
        byte = f.read(1)[0]
        f.seek(loc.offset + HEADER_BYTES + 777)
        f.write(bytes([byte ^ 0x10]))
    t.pin([s])
    result, got = read(t, s)
    assert not result.ok and result.reason == "checksum" and not got.any(), "nothing copied out"
    t.unpin(s, read=False)
    assert t.checksum_failures == 1 and HASHES[0] not in t.cached and t.state[s] == FREE
    t.check()


def test_torn_write_keeps_the_old_header_and_fails_its_checksum(tmp_path):
    """A write stopped between its payload and its header (a crash): the slot's old header now
    names bytes that are not its block's; after a restart the read fails and drops it."""
    t = tier(tmp_path / "disk", slots=1)
    s = write(t, 0)
    t.pin([s])
    t.unpin(s, read=True)

    class Crash(Exception):
        pass

    def crash(**kw):
        raise Crash

    t2 = tier(tmp_path / "disk", slots=1)
    got = t2.reserve_write(*block(1))  # evicts block 0's slot
    assert got is not None and got[0] == s
    remove = test_hooks.register("disk.between_payload_and_header", crash)
    with pytest.raises(Crash):
        k, tokens, parent = block(1)
        loc = t2.location(s)
        fd, direct = open_slab(loc.path)
        io = SlabIO(fd, t2.slot_bytes, direct)
        try:
            io.write(0, header_for(payload(1), identity=t2.identity, block_hash=k, parent_hash=parent, tokens=tokens,
                                   sequence=got[1]), payload(1))
        finally:
            io.close()
            remove()
    restarted = tier(tmp_path / "disk", slots=1)
    assert restarted.cached == {HASHES[0]: s}, "the old header is found again"
    restarted.pin([s])
    result, _ = read(restarted, s)
    assert not result.ok and result.reason == "checksum"
    restarted.unpin(s, read=False)
    assert restarted.checksum_failures == 1 and not restarted.cached
    restarted.check()


def test_identities_never_share_slots(tmp_path):
    t = tier(tmp_path / "disk")
    write(t, 0)
    other = DiskTier(tmp_path / "disk", {**IDENTITY, "revision": "v2"}, BLOCK_NBYTES, 4 * slot_bytes(BLOCK_NBYTES))
    assert other.folder != t.folder and not other.cached and other.recovered == 0
    bigger = DiskTier(tmp_path / "disk", {**IDENTITY, "block_size": 8}, BLOCK_NBYTES, 4 * slot_bytes(BLOCK_NBYTES))
    assert not bigger.cached
    assert tier(tmp_path / "disk").cached == {HASHES[0]: 0}


def test_directory_of_another_uid_or_too_small_a_size_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir(mode=0o755)
    own_directory(d)
    assert stat_mode(d) == 0o700, "group and other bits are removed"
    monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 1)
    with pytest.raises(PermissionError, match="owned by uid"):
        own_directory(d)
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    with pytest.raises(PermissionError, match="not a directory"):
        own_directory(tmp_path / "file")
    with pytest.raises(ValueError, match="holds no block"):
        DiskTier(tmp_path / "small", IDENTITY, BLOCK_NBYTES, 100)


def test_a_full_file_system_shrinks_the_tier(tmp_path, monkeypatch):
    """posix_fallocate failing with ENOSPC part-way: the tier keeps the slots that got space."""
    real = os.posix_fallocate
    calls = []

    def fallocate(fd, offset, length):
        calls.append(length)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    t = DiskTier(tmp_path / "disk", IDENTITY, BLOCK_NBYTES, 6 * slot_bytes(BLOCK_NBYTES),
                 slab_bytes=2 * slot_bytes(BLOCK_NBYTES))
    assert t.num_slots == 2 and len(t.slabs()) == 1
    t.check()


def test_the_block_manager_reads_a_prompts_disk_blocks_through_the_host_tier(tmp_path):
    """Blocks on disk after a restart: PrefetchPrefix's path queues one read per block (pending host
    blocks, pinned slots), settling them makes the host tier hold them (a lookup finds them there),
    a failed read drops its slot and counts it; the write-through of a block proven in the host tier
    is queued at once; the invariants hold throughout; the metrics and events show the disk."""
    from memory_service.manager.block_manager import BlockManager
    from memory_service.metrics import BlockManagerCollector

    t = tier(tmp_path / "disk", slots=6)
    for i in range(3):
        write(t, i)
    key = CacheKey("tiny")
    restarted = tier(tmp_path / "disk", slots=6)
    m = BlockManager(8, 4, host_num_blocks=4, disk=restarted)
    m.check_invariants()
    prompt = TOKENS[:13]  # blocks 0-2 full, the last token in block 3
    assert m.prefetch_prefix(prompt, key) == (0, 0, 12, 3)
    m.check_invariants()
    assert m.prefetch_prefix(prompt, key) == (0, 0, 12, 3), "the reads in flight are not queued twice"
    work = m.tiers.take_disk_work(16, now=0.0)
    assert [(w.kind, w.slot, w.block_hash) for w in work] == [("read", s, HASHES[s]) for s in range(3)]
    assert {w.host for w in work} == {0, 1, 2} and all(restarted.pins[s] == 1 for s in range(3))
    m.check_invariants()
    assert m.tiers.settle_disk_work(work[0].work_id, True) and m.tiers.settle_disk_work(work[1].work_id, True)
    assert m.tiers.settle_disk_work(work[2].work_id, False)  # block 2's checksum failed
    assert not m.tiers.settle_disk_work(work[2].work_id, True), "settled once"
    m.check_invariants()
    assert m.lookup_prefix(prompt, key) == (0, 8)
    assert restarted.checksum_failures == 1 and HASHES[2] not in restarted.cached and restarted.hits == 8
    assert m.prefetch_prefix(prompt, key) == (0, 8, 0, 0), "block 2 is gone from disk: computed"
    # A block proven in the host tier is written through to disk at once (its host block pinned).
    h = m.tiers.host.reserve_offload(HASHES[5], block(5)[1], HASHES[4])
    m.tiers.host.offload_proven(h)
    assert m.prefetch_prefix(TOKENS[:9], CacheKey("other")) == (0, 0, 0, 0)
    (w,) = m.tiers.take_disk_work(16, now=1.0)
    assert (w.kind, w.host, w.block_hash) == ("write", h, HASHES[5]) and m.tiers.host.pins[h] == 1
    m.check_invariants()
    assert m.tiers.expire_disk_work(now=100.0) == 1 and restarted.dropped == 1 and m.tiers.host.pins[h] == 0
    m.check_invariants()
    metrics = {f.name: f.samples[0].value for f in BlockManagerCollector(m).collect()}
    assert metrics["pagedkv:disk_blocks"] == 2 and metrics["pagedkv:disk_checksum_failures"] == 1
    assert metrics["pagedkv:disk_hits"] == 8 and metrics["pagedkv:disk_dropped"] == 1
    media = [(e.kind, e.medium) for e in m.prefix_cache.events]
    assert ("removed", 3) in media and ("stored", 1) in media
