"""The host tier on the worker's side: its memory, the grant checks of tier copies, their order, receipts.

DESIGN.md, "Tiers and transfers": the host tier is a sealed memfd with the pool's per-block layout
that every worker maps read-write; one epoch table covers both tiers (host block h at
``num_blocks + h``). A worker does every copy of every grant of its step, offloads (device -> host)
first, then reloads (host -> device), then copy-on-write, all before the forward; it refuses a
copy outside its tier, with a stale epoch, host -> host, or to a host tier it does not map, before
it touches a byte; its receipts list (and sign) the tier copies of each sequence's grant.
"""

from __future__ import annotations

import asyncio
import os
import time
import types

import numpy as np
import pytest
import torch
from helpers.refusals import refusal

from compute_service.grant_check import check_grants, sign_receipts
from compute_service.pool_map import map_handle, map_pool
from compute_service.worker import Worker
from memory_service.layout import PoolLayout
from memory_service.pool import CpuPool
from memory_service.worker_socket import WorkerSocketServer
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime.errors import PermissionDeniedError
from pagedkv.runtime.grants import copy_tuple, receipt_signed, sign_grant, token_digest
from pagedkv.runtime.pool_socket import PoolHandle

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32", num_blocks=8)
HOST_BLOCKS = 4
DEV, HOST = grant_pb2.MEDIUM_DEVICE, grant_pb2.MEDIUM_HOST
BLOCK = LAYOUT.shape[1:]  # [num_layers, 2, block_size, num_kv_heads, head_dim]
VOCAB = 32


def views(pool: CpuPool) -> tuple[np.ndarray, np.ndarray | None]:
    """The memory service side's own views of the pool and host tier (its test-only mappings)."""
    dev = np.frombuffer(pool.map(), dtype=np.float32).reshape(LAYOUT.shape)
    host = np.frombuffer(pool.map_host(), dtype=np.float32).reshape(pool.host_num_blocks, *BLOCK) \
        if pool.host_num_blocks else None
    return dev, host


def fill(pool: CpuPool) -> tuple[np.ndarray, np.ndarray | None]:
    """Distinct bytes in every block (device b: 1000 b + i; host h: -1000 (h + 1) - i) and distinct
    epochs (device b: 10 + b; host h: 50 + h); returns the writable views."""
    dev, host = views(pool)
    n = int(np.prod(BLOCK))
    dev[:] = (1000 * np.arange(LAYOUT.num_blocks)[:, None] + np.arange(n)).reshape(dev.shape)
    pool.epochs[:] = 10 + np.arange(LAYOUT.num_blocks)
    if host is not None:
        host[:] = (-1000 * (np.arange(pool.host_num_blocks)[:, None] + 1) - np.arange(n)).reshape(host.shape)
        pool.host_epochs[:] = 50 + np.arange(pool.host_num_blocks)
    return dev, host


def mapped(pool: CpuPool):
    """What a worker maps from the fds the worker socket would send (duplicates; the pool keeps its own)."""
    handle = PoolHandle(pool.worker_descriptor(), pool.plane_key,
                        {k: os.dup(fd) for k, fd in pool.worker_fds().items()})
    try:
        return map_handle(handle)
    finally:
        handle.close()


@pytest.fixture
def tiered():
    pool = CpuPool(LAYOUT, pool_id="tiers", host_num_blocks=HOST_BLOCKS)
    dev, host = fill(pool)
    m = mapped(pool)
    yield pool, m, dev, host
    m.close()
    pool.close()


class Model:
    """Stands in for the decoder: notes the pool and host tier as the forward sees them, returns fixed logits."""

    device = torch.device("cpu")

    def __init__(self, pool):
        self.pool, self.seen = pool, None

    def __call__(self, input_ids, positions, kv_pool, slots, plan, logits_indices, kv_scales=None):
        host = self.pool.host_tensor
        self.seen = (kv_pool.clone(), None if host is None else host.clone())
        logits = torch.zeros(len(logits_indices), VOCAB)
        logits[:, 7] = 1.0
        return logits


def copy(src, dst, src_medium, dst_medium, epochs, host_epochs, *, src_epoch=None, dst_epoch=None):
    """A GrantedCopy with the epochs the tables hold (unless given)."""
    def epoch(table_id, medium):
        table = host_epochs if medium == HOST else epochs
        return int(table[table_id]) if table is not None and table_id < len(table) else 1

    return grant_pb2.GrantedCopy(
        src=src, dst=dst, src_medium=src_medium, dst_medium=dst_medium,
        src_epoch=epoch(src, src_medium) if src_epoch is None else src_epoch,
        dst_epoch=epoch(dst, dst_medium) if dst_epoch is None else dst_epoch)


def sequence(pool, seq_id: int, table: list[int], tokens: list[int], copies) -> cpb.StepSequence:
    grant = sign_grant(pool.plane_key, grant_pb2.StepGrant(
        pool_generation=pool.generation, seq_id=seq_id, block_ids=table, block_epochs=pool.epochs[table].tolist(),
        readable_tokens=0, write_end=len(tokens), token_digest=token_digest(tokens), copies=copies,
        expires_at=time.time() + 60))
    return cpb.StepSequence(seq_id=seq_id, token_ids=tokens, positions=range(len(tokens)), block_ids=table, grant=grant)


async def test_host_tier_is_one_memory_seen_from_both_sides(tmp_path):
    pool = CpuPool(LAYOUT, pool_id="hostmap", host_num_blocks=HOST_BLOCKS)
    server = WorkerSocketServer(pool, tmp_path / "w.sock")
    await server.start()
    try:
        desc = pool.descriptor()
        assert (desc.host_num_blocks, desc.host_nbytes) == (HOST_BLOCKS, HOST_BLOCKS * LAYOUT.block_nbytes)
        fds = pool.worker_fds()
        assert sorted(fds) == ["epochs", "host", "pool"]
        assert os.readlink(f"/proc/self/fd/{fds['host']}").startswith(f"/memfd:pagedkv-host-hostmap-g{pool.generation}")
        # One epoch table for both tiers: the device and host parts are views of it.
        assert pool.all_epochs.shape == (LAYOUT.num_blocks + HOST_BLOCKS,) and pool.epochs.shape == (LAYOUT.num_blocks,)
        assert np.shares_memory(pool.epochs, pool.all_epochs) and np.shares_memory(pool.host_epochs, pool.all_epochs)
        dev, host = fill(pool)

        m = await asyncio.to_thread(map_pool, desc)
        try:
            assert m.host_tensor.shape == (HOST_BLOCKS, *BLOCK) and m.host_tensor.dtype == torch.float32
            assert m.host_num_blocks == HOST_BLOCKS and m.host_tensor.device.type == "cpu"
            assert torch.equal(m.host_tensor, torch.from_numpy(host.copy()))
            assert m.all_epochs.tolist() == pool.all_epochs.tolist()
            assert m.host_epochs.tolist() == [50, 51, 52, 53] and m.epochs.tolist() == list(range(10, 18))
            pool.all_epochs[LAYOUT.num_blocks + 2] += 1  # a bump by the memory service shows at once
            assert m.host_epochs[2] == 53
            with pytest.raises(ValueError, match="read-only"):
                m.host_epochs[0] = 0
            m.host_tensor[3].fill_(2.5)  # the worker writes, the memory service's mapping sees it
            assert (host[3] == 2.5).all() and not (host[2] == 2.5).any()
        finally:
            m.close()
        with pytest.raises(PermissionError):  # sealed at its size
            os.ftruncate(fds["host"], 4096)
    finally:
        await server.close()
        pool.close()


def test_no_host_tier_sends_no_host_fd():
    pool = CpuPool(LAYOUT, pool_id="nohost")
    try:
        assert sorted(pool.worker_fds()) == ["epochs", "pool"] and pool.host_epochs.shape == (0,)
        assert pool.descriptor().host_num_blocks == 0
        with pytest.raises(ValueError, match="no host tier"):
            pool.map_host()
        m = mapped(pool)
        assert m.host_tensor is None and m.host_epochs is None and m.host_num_blocks == 0
        m.close()
    finally:
        pool.close()


def test_offload_reload_and_copy_on_write_run_in_order_before_the_forward(tiered):
    pool, m, dev, host = tiered
    old_dev, old_host = dev.copy(), host.copy()
    ep, hep = pool.epochs, pool.host_epochs
    # Sequence 1: block 2 goes to host block 1 (its old bytes), then host block 0 comes back into
    # block 2, then block 2 (now host block 0's bytes) is copied into block 3. Listed in reverse:
    # the worker orders them.
    cow = copy(2, 3, DEV, DEV, ep, hep)
    reload = copy(0, 2, HOST, DEV, ep, hep)
    offload = copy(2, 1, DEV, HOST, ep, hep)
    first = sequence(pool, 1, [2, 3], [1, 2, 3, 4, 5], [cow, reload, offload])
    # Sequence 2: its own offload, block 5 -> host block 3.
    second = sequence(pool, 2, [5], [6], [copy(5, 3, DEV, HOST, ep, hep)])
    request = cpb.StepRequest(pool_generation=pool.generation, sequences=[first, second],
                              copies=[cpb.BlockCopy(src=2, dst=3)])
    model = Model(m)
    response = Worker(model, types.SimpleNamespace(vocab_size=VOCAB, sliding_window=None), m).step(request)

    want_dev, want_host = old_dev.copy(), old_host.copy()
    want_host[1] = old_dev[2]
    want_host[3] = old_dev[5]
    want_dev[2] = old_host[0]
    want_dev[3] = old_host[0]
    assert np.array_equal(dev, want_dev) and np.array_equal(host, want_host)
    # The forward saw every copy done.
    assert np.array_equal(model.seen[0].numpy(), want_dev) and np.array_equal(model.seen[1].numpy(), want_host)

    r1, r2 = (r.receipt for r in response.results)
    assert [copy_tuple(c) for c in r1.copies] == [copy_tuple(reload), copy_tuple(offload)]  # tier copies, grant order
    assert [copy_tuple(c) for c in r2.copies] == [copy_tuple(second.grant.copies[0])]
    assert receipt_signed(pool.plane_key, r1) and receipt_signed(pool.plane_key, r2)
    assert (r1.start, r1.end, list(r1.block_ids)) == (0, 5, [2, 3])
    # Receipts signed from the grants themselves (no check's answer) are the same.
    again = [cpb.StepResult(seq_id=s.seq_id) for s in request.sequences]
    sign_receipts(request, again, pool.plane_key, LAYOUT.block_size)
    assert [r.receipt for r in again] == [r1, r2]
    del r1.copies[0]  # the signature covers the copies
    assert not receipt_signed(pool.plane_key, r1)


def test_plan_dedupes_and_orders_every_grant_copy(tiered):
    pool, m, _, _ = tiered
    ep, hep = pool.epochs, pool.host_epochs
    shared = copy(4, 0, DEV, HOST, ep, hep)
    request = cpb.StepRequest(pool_generation=pool.generation, sequences=[
        sequence(pool, 1, [4], [1], [copy(6, 7, DEV, DEV, ep, hep), shared]),
        sequence(pool, 2, [6], [2], [copy(2, 6, HOST, DEV, ep, hep), shared])])
    checked = check_grants(request, pool.plane_key, pool.generation, m.epochs, host_epochs=m.host_epochs)
    plan = checked.plan
    assert (plan.offloads, plan.reloads, plan.copy_on_write) == ([(4, 0)], [(2, 6)], [(6, 7)])
    assert [len(c.tier_copies) for c in checked] == [1, 2]
    # A request's own copies are copy-on-write only: an offload's ids there are no grant's copy-on-write.
    request.copies.add(src=4, dst=0)
    with pytest.raises(PermissionDeniedError, match="copy 4 -> 0 is in no grant"):
        check_grants(request, pool.plane_key, pool.generation, m.epochs, host_epochs=m.host_epochs)


REFUSALS = {
    "stale host epoch": (lambda ep, hep: [copy(0, 2, HOST, DEV, ep, hep, src_epoch=int(hep[0]) + 1)],
                         "handed out anew"),
    "host id out of range": (lambda ep, hep: [copy(2, HOST_BLOCKS, DEV, HOST, ep, hep)], "outside its tier"),
    "device id out of range": (lambda ep, hep: [copy(0, LAYOUT.num_blocks, HOST, DEV, ep, hep)], "outside its tier"),
    "host to host": (lambda ep, hep: [copy(0, 1, HOST, HOST, ep, hep)], "not a device->device"),
    "two offloads into one host block": (
        lambda ep, hep: [copy(2, 1, DEV, HOST, ep, hep), copy(3, 1, DEV, HOST, ep, hep)], "write one block"),
}


@pytest.mark.parametrize("what", sorted(REFUSALS))
def test_bad_tier_copy_is_refused_and_nothing_is_written(tiered, what):
    pool, m, dev, host = tiered
    make, reason = REFUSALS[what]
    # A good copy-on-write and offload ride along: they are not done either.
    copies = [copy(2, 3, DEV, DEV, pool.epochs, pool.host_epochs), copy(5, 2, DEV, HOST, pool.epochs, pool.host_epochs),
              *make(pool.epochs, pool.host_epochs)]
    request = cpb.StepRequest(pool_generation=pool.generation, sequences=[sequence(pool, 1, [2, 3], [1, 2], copies)])
    before_dev, before_host = dev.copy(), host.copy()
    model = Model(m)
    worker = Worker(model, types.SimpleNamespace(vocab_size=VOCAB, sliding_window=None), m)
    message = refusal(lambda: worker.step(request))
    assert "nothing was read or written" in message and reason in message
    assert model.seen is None and np.array_equal(dev, before_dev) and np.array_equal(host, before_host)


def test_host_copy_without_a_host_tier_is_refused():
    pool = CpuPool(LAYOUT, pool_id="nohost2")
    m = mapped(pool)
    try:
        dev, _ = fill(pool)
        before = dev.copy()
        offload = grant_pb2.GrantedCopy(src=2, src_epoch=int(pool.epochs[2]), dst=0, dst_epoch=0, src_medium=DEV,
                                        dst_medium=HOST)
        cow = copy(2, 3, DEV, DEV, pool.epochs, None)
        request = cpb.StepRequest(pool_generation=pool.generation,
                                  sequences=[sequence(pool, 1, [2, 3], [1, 2], [cow, offload])])
        worker = Worker(Model(m), types.SimpleNamespace(vocab_size=VOCAB, sliding_window=None), m)
        assert "maps none" in refusal(lambda: worker.step(request))
        assert np.array_equal(dev, before)
    finally:
        m.close()
        pool.close()


def test_tier_copy_kernel_merges_runs_and_checks_ids():
    from kernels.tier_copy import block_runs, copy_blocks_between

    assert block_runs([(5, 1), (3, 0), (6, 2), (9, 4)]) == [(3, 0, 1), (5, 1, 2), (9, 4, 1)]
    src = torch.arange(10 * 4, dtype=torch.float32).view(10, 1, 2, 2, 1, 1)
    dst = torch.zeros(6, 1, 2, 2, 1, 1)
    copy_blocks_between(src, dst, [(5, 1), (3, 0), (6, 2), (9, 4)])
    assert [int(dst[i].sum()) for i in range(6)] == [int(src[s].sum()) if s is not None else 0
                                                     for s in (3, 5, 6, None, 9, None)]
    with pytest.raises(ValueError, match="repeats"):
        copy_blocks_between(src, dst, [(1, 0), (2, 0)])
    with pytest.raises(ValueError, match="lie in"):
        copy_blocks_between(src, dst, [(10, 0)])


def test_mapping_refuses_a_short_host_memfd():
    pool = CpuPool(LAYOUT, pool_id="short", host_num_blocks=2)
    try:
        desc = pool.worker_descriptor()
        desc.host_num_blocks = 3  # more blocks than the memfds (host tier, epoch table) hold
        desc.host_nbytes = 3 * LAYOUT.block_nbytes
        handle = PoolHandle(desc, pool.plane_key, {k: os.dup(fd) for k, fd in pool.worker_fds().items()})
        try:
            with pytest.raises(ValueError, match="memfd holds"):
                map_handle(handle)
        finally:
            handle.close()
    finally:
        pool.close()



class WritingModel(Model):
    """Also writes each new token's K and V (every layer): token id + 0.5 in its slot."""

    def __call__(self, input_ids, positions, kv_pool, slots, plan, logits_indices, kv_scales=None):
        bs = kv_pool.shape[3]
        for tok, slot in zip(input_ids.tolist(), slots.tolist()):
            kv_pool[slot // bs, :, :, slot % bs] = tok + 0.5
        return super().__call__(input_ids, positions, kv_pool, slots, plan, logits_indices, kv_scales)


def test_memory_service_offload_and_reload_round_trip_through_the_worker():
    # The memory service's own block manager and signer over the pool's epoch table: a cached
    # prompt evicted by a larger allocation is offloaded in its new owner's step, and the same
    # prompt later reloads from the host tier, byte for byte.
    from memory_service.manager.block_manager import BlockManager
    from memory_service.manager.requests import Allocation
    from memory_service.step_grants import GrantSigner

    pool = CpuPool(LAYOUT, pool_id="roundtrip", host_num_blocks=HOST_BLOCKS)
    m = mapped(pool)
    try:
        dev, host = views(pool)
        bs = LAYOUT.block_size
        manager = BlockManager(LAYOUT.num_blocks, bs, lease_ttl=30.0, epochs=pool.epochs,
                               host_num_blocks=HOST_BLOCKS, host_epochs=pool.host_epochs)
        signer = GrantSigner(pool.plane_key, pool.generation, pool.epochs, host_epochs=pool.host_epochs)
        lease = manager.leases.create().lease_id
        worker = Worker(WritingModel(m), types.SimpleNamespace(vocab_size=VOCAB, sliding_window=None), m)

        def step(seq, tokens):
            grant = signer.grant(seq, 30.0, manager.tiers.grant_copies(seq))
            start = grant.readable_tokens
            request = cpb.StepRequest(pool_generation=pool.generation, sequences=[cpb.StepSequence(
                seq_id=seq.seq_id, token_ids=tokens[start:], positions=range(start, len(tokens)),
                block_ids=grant.block_ids, grant=grant)])
            (result,) = worker.step(request).results
            manager.commit_receipts(lease, signer.receipts([result.receipt]))
            return grant, result.receipt

        prompt = tuple(range(1, 2 * bs + 1))  # two full blocks
        (a,) = manager.allocate(lease, [Allocation(len(prompt), prompt)])
        step(a, prompt)
        a_blocks = list(a.block_ids)
        kv_of_prompt = dev[a_blocks].copy()
        assert (kv_of_prompt[0, :, :, 1] == 2.5).all()
        manager.free(lease, [a.seq_id])

        # Every device block is needed: the prompt's cached blocks are handed out and offloaded first.
        other = tuple(20 + i % 10 for i in range(LAYOUT.num_blocks * bs))
        (b,) = manager.allocate(lease, [Allocation(len(other), other)])
        grant, receipt = step(b, other)
        offloads = [(c.src, c.dst) for c in grant.copies if c.dst_medium == HOST]
        assert sorted(s for s, _ in offloads) == sorted(a_blocks) and len(receipt.copies) == 2
        for src, dst in offloads:
            assert np.array_equal(host[dst], kv_of_prompt[a_blocks.index(src)])  # the old bytes, not b's
        manager.free(lease, [b.seq_id])
        kv_of_other = dev.copy()

        # The prompt again (and one token more): its blocks come back from the host tier, into
        # device blocks whose cached bytes (the other prompt's) are offloaded first in the same step.
        (c,) = manager.allocate(lease, [Allocation(len(prompt) + 1, (*prompt, 9))])
        grant, receipt = step(c, (*prompt, 9))
        reloads = [(cp.src, cp.dst) for cp in grant.copies if cp.src_medium == HOST]
        offloads = [(cp.src, cp.dst) for cp in grant.copies if cp.dst_medium == HOST]
        assert len(reloads) == 2 and grant.readable_tokens == len(prompt)
        assert {d for _, d in reloads} & {s for s, _ in offloads}  # order matters in this step
        assert np.array_equal(dev[list(c.block_ids)[:2]], kv_of_prompt)
        for src, dst in offloads:
            assert np.array_equal(host[dst], kv_of_other[src])
        assert [copy_tuple(cp) for cp in receipt.copies] == [copy_tuple(cp) for cp in grant.copies]
        assert receipt_signed(pool.plane_key, receipt)
        manager.check_invariants()
    finally:
        m.close()
        pool.close()
