"""compute_service.disk_copier: a worker's disk-tier copies over a real mapped CPU pool and host tier.

References: the host block's bytes compared after a write and a read back, the slot header's
SHA-256 against hashlib's, the receipts' signatures under the plane key; and every refusal (a copy
not signed with the plane key, expired, of a host block handed out anew, a slot that holds another
block, a write that meets ENOSPC) says why and moves nothing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time

import pytest
import torch

from compute_service.disk_copier import DiskCopier
from compute_service.pool_map import map_handle
from memory_service.layout import PoolLayout
from memory_service.pool import CpuPool
from memory_service.tiers.disk_tier import DiskTier
from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime import test_hooks
from pagedkv.runtime.grants import disk_signed, sign_disk
from pagedkv.runtime.pool_socket import PoolHandle

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32", num_blocks=4)


@pytest.fixture
def mapped(tmp_path):
    p = CpuPool(LAYOUT, pool_id="disk", host_num_blocks=3)
    disk = DiskTier(tmp_path / "disk", {"model": "t"}, LAYOUT.block_nbytes, 4 * 8192 * 2)
    p.disk_tier = mpb.DiskTierInfo(folder=str(disk.folder), slot_bytes=disk.slot_bytes,
                                   slots_per_slab=disk.slots_per_slab, num_slots=disk.num_slots, identity=disk.identity)
    handle = PoolHandle(p.worker_descriptor(), p.plane_key, {k: os.dup(fd) for k, fd in p.worker_fds().items()})
    try:
        m = map_handle(handle)
    finally:
        handle.close()
    yield p, m, DiskCopier(m)
    m.close()
    p.close()


def copy(p, m, *, write: bool, host: int, slot: int, key=None, expires=60.0, epoch=None, block_hash=b"h" * 32):
    c = grant_pb2.DiskCopy(pool_generation=p.generation, work_id=7, write=write, host_block=host,
                           host_epoch=int(m.host_epochs[host]) if epoch is None else epoch, slot=slot, slot_epoch=1,
                           block_hash=block_hash, token_ids=[1, 2, 3, 4], sequence=3,
                           expires_at=time.time() + expires)
    return sign_disk(key or p.plane_key, c)


def test_a_write_and_a_read_back_move_the_block_checked(mapped):
    p, m, copier = mapped
    m.host_tensor[0].copy_(torch.randn(m.host_tensor[0].shape))
    (w,) = copier.run([copy(p, m, write=True, host=0, slot=2)])
    assert w.ok and disk_signed(p.plane_key, w) and w.work_id == 7
    assert w.checksum == hashlib.sha256(m.host_tensor[0].numpy().tobytes()).digest()
    (r,) = copier.run([copy(p, m, write=False, host=1, slot=2)])
    assert r.ok and r.checksum == w.checksum and torch.equal(m.host_tensor[1], m.host_tensor[0])
    (other,) = copier.run([copy(p, m, write=False, host=2, slot=2, block_hash=b"x" * 32)])
    assert (other.ok, other.failure) == (False, "header") and not m.host_tensor[2].any(), "nothing copied"


@pytest.mark.parametrize("bad", ["wrong key", "expired", "stale epoch", "slot outside"])
def test_a_copy_the_worker_may_not_do_is_refused(mapped, bad):
    p, m, copier = mapped
    m.host_tensor[0].fill_(1.5)
    kw = {"wrong key": {"key": b"\x05" * 32}, "expired": {"expires": -1.0},
          "stale epoch": {"epoch": int(m.host_epochs[0]) + 1}, "slot outside": {"slot": 99}}[bad]
    args = {"write": True, "host": 0, "slot": 1} | kw
    (r,) = copier.run([copy(p, m, **args)])
    assert (r.ok, r.failure) == (False, "refused") and disk_signed(p.plane_key, r)
    (back,) = copier.run([copy(p, m, write=False, host=1, slot=1)])
    assert (back.ok, back.failure) == (False, "header"), "nothing was written"


def test_a_full_disk_fails_the_write_as_io(mapped):
    p, m, copier = mapped

    def full(**kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    remove = test_hooks.register("disk.between_payload_and_header", full)
    try:
        (r,) = copier.run([copy(p, m, write=True, host=0, slot=0)])
    finally:
        remove()
    assert (r.ok, r.failure) == (False, "io")
