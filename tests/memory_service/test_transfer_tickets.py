"""The memory-service side of node transfers, in process: ExportPrefix pins, tickets, an allocation
that reads another node's blocks, and its receipt; exact block ids, epochs, hashes and refcounts.

Two block managers play node A (exports) and node B (reads): pools of 8 blocks of 4 tokens. A
"step" plays an honest worker on B: it does the node transfers its grant names and hands in the
receipt listing them (memory_service.transfers has the whole flow).
"""

from __future__ import annotations

import os

import pytest

from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Commit, Receipt, RemotePrefix
from memory_service.step_grants import GrantSigner
from memory_service.tiers.manager import DEVICE, REMOTE
from memory_service.transfers import MAX_SOURCES, SOURCE_TTL, NodeTransfers
from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.block_hash import CacheKey, chain_hashes
from pagedkv.runtime.errors import (
    TRANSFER_TICKET_REFUSED,
    TRANSFERS_OFF,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from pagedkv.runtime.grants import copy_tuple, token_digest
from pagedkv.runtime.transfer import load_transfer_key, sign_source, source_digest, ticket_signed

BS = 4
KEY = CacheKey("model", "")
PROMPT = tuple(range(100, 122))  # 22 tokens: 5 full blocks + 2 (the 6th holds the last token)
TRANSFER_KEY = bytes(range(32))


def manager() -> tuple[BlockManager, str]:
    m = BlockManager(8, BS)
    lease, _ = m.leases.open(None, "test")
    return m, lease.lease_id


def descriptor(node_blocks=8, dtype="float32", model="smollm2", generation=7) -> mpb.PoolDescriptor:
    lay = mpb.PoolLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=BS, dtype=dtype, num_blocks=node_blocks)
    return mpb.PoolDescriptor(generation=generation, layout=lay, block_nbytes=2 * 2 * BS * 8 * 4, model=model)


def source(agent="a/1/g7", blocks=8) -> grant_pb2.TransferSource:
    return grant_pb2.TransferSource(agent_name=agent, agent_metadata=b"nixl-metadata", base_address=0x10000,
                                    num_blocks=blocks, block_bytes=2 * 2 * BS * 8 * 4)


#: The pool generation's plane key, which the workers that map the pool hold.
PLANE_KEY = bytes(range(100, 132))


def publish(t: NodeTransfers, generation: int, s: grant_pb2.TransferSource, withdraw: bool = False,
            key: bytes = PLANE_KEY) -> None:
    """PublishTransferSource as a worker sends it: signed with the plane key (or ``key``)."""
    t.publish(mpb.PublishTransferSourceRequest(pool_generation=generation, source=s, withdraw=withdraw,
                                               signature=sign_source(key, generation, s, withdraw)), PLANE_KEY)


def node(name: str, key: bytes | None = TRANSFER_KEY, clock=lambda: 0.0, **kw) -> NodeTransfers:
    t = NodeTransfers(name, descriptor(**kw), key, wall_clock=lambda: 1000.0, clock=clock)
    if key is not None:
        publish(t, t.descriptor.generation, source(f"{name}/1/g7"))
    return t


def cached_on(m: BlockManager, lease: str, tokens=PROMPT) -> list[int]:
    """Compute ``tokens`` on ``m`` (committed without a worker: in-process) and free them: cached."""
    (s,) = m.allocate(lease, [Allocation(len(tokens), tokens, KEY)])
    m.commit_computed(lease, [Commit(s.seq_id, len(tokens))])
    m.free(lease, [s.seq_id])
    return s.block_ids


def test_export_pins_the_cached_full_blocks_as_a_sequence_of_the_lease_and_free_unpins():
    a, lease = manager()
    blocks = cached_on(a, lease)
    assert blocks == [0, 1, 2, 3, 4, 5] and all(a.pool.ref_counts[b] == 0 for b in blocks)
    pin = a.export_prefix(lease, PROMPT, KEY)
    assert pin.block_ids == [0, 1, 2, 3, 4]  # 5 full blocks; never the one holding the last token
    assert pin.num_tokens == pin.num_proven == 20
    assert pin.block_hashes == chain_hashes(PROMPT, BS, KEY, 5)
    assert [int(a.pool.ref_counts[b]) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    a.check_invariants()
    a.free(lease, [pin.seq_id])
    assert [int(a.pool.ref_counts[b]) for b in range(8)] == [0] * 8
    assert a.lookup_prefix(PROMPT, KEY) == (20, 0)  # still cached
    a.check_invariants()


def test_export_of_an_uncached_prompt_or_another_salt_pins_nothing():
    a, lease = manager()
    cached_on(a, lease)
    before = a.stats()
    assert a.export_prefix(lease, tuple(range(500, 522)), KEY) is None
    assert a.export_prefix(lease, PROMPT, CacheKey("model", "tenant-b")) is None
    assert a.stats() == before and not a.sequences


def test_ticket_is_signed_names_blocks_epochs_hashes_and_the_newest_source():
    a, lease = manager()
    cached_on(a, lease)
    t = node("a")
    publish(t, 7, source("a/2/g7"))
    pin = a.export_prefix(lease, PROMPT, KEY)
    ticket = t.ticket(pin, 10.0, a.pool.epochs)
    assert ticket_signed(TRANSFER_KEY, ticket) and not ticket_signed(bytes(32), ticket)
    assert list(ticket.block_ids) == [0, 1, 2, 3, 4]
    assert list(ticket.block_epochs) == [int(a.pool.epochs[b]) for b in range(5)]
    assert list(ticket.block_hashes) == chain_hashes(PROMPT, BS, KEY, 5)
    assert ticket.source.agent_name == "a/2/g7" and ticket.expires_at == 1010.0 and ticket.node_name == "a"
    assert ticket.model == "smollm2" and ticket.layout.dtype == "float32"


def remote_of(a: BlockManager, lease: str) -> tuple[mpb.TransferTicket, RemotePrefix]:
    cached_on(a, lease)
    pin = a.export_prefix(lease, PROMPT, KEY)
    ticket = node("a").ticket(pin, 10.0, a.pool.epochs)
    return ticket, node("b").take(ticket)


def test_allocation_reads_the_remote_blocks_past_its_own_prefix_and_registers_them_on_the_receipt():
    a, la = manager()
    ticket, remote = remote_of(a, la)
    b, lb = manager()
    (s,) = b.allocate(lb, [Allocation(len(PROMPT), PROMPT, KEY, remote)])
    assert s.block_ids == [0, 1, 2, 3, 4, 5] and s.num_cached_tokens == s.num_transferred_tokens == 20
    assert s.num_proven == 20  # readable in its first step: the transfers run before its writes
    digest = source_digest(ticket.source)
    copies = b.tiers.grant_copies(s)
    assert [(c.src, c.dst, c.src_medium, c.dst_medium, c.src_epoch, c.source) for c in copies] == [
        (i, i, REMOTE, DEVICE, int(a.pool.epochs[i]), digest) for i in range(5)]
    signer = GrantSigner(bytes(32), 1, b.pool.epochs)
    grant = signer.grant(s, 10.0, copies)
    assert [copy_tuple(c) for c in grant.copies] == [b.tiers.copy_key(c) for c in copies]
    assert all(c.src_medium == grant_pb2.MEDIUM_REMOTE and c.src_source == digest for c in grant.copies)
    assert b.lookup_prefix(PROMPT, KEY) == (0, 0)  # pending: not a hit before the receipt
    b.check_invariants()
    # The worker's receipt for positions 20..22, listing the transfers it did.
    r = Receipt(s.seq_id, 20, 22, token_digest(PROMPT[20:22]), (5,), (int(b.pool.epochs[5]),),
                tuple(copy_tuple(c) for c in grant.copies))
    b.commit_receipts(lb, [r])  # settles the transfers (as a reload: registered there, block 5 is partial)
    assert b.lookup_prefix(PROMPT, KEY) == (20, 0) and b.tiers.transfers_proven == 5
    assert not s.reloads
    b.check_invariants()
    b.free(lb, [s.seq_id])
    assert b.stats().used_blocks == 0


def test_own_cached_prefix_first_then_only_the_rest_is_read():
    a, la = manager()
    _, remote = remote_of(a, la)
    b, lb = manager()
    cached_on(b, lb, PROMPT[:9])  # 2 full blocks here
    (s,) = b.allocate(lb, [Allocation(len(PROMPT), PROMPT, KEY, remote)])
    assert s.num_cached_tokens == 20 and s.num_transferred_tokens == 12
    assert [(c.src, c.dst) for c in b.tiers.grant_copies(s)] == [(2, s.block_ids[2]), (3, s.block_ids[3]),
                                                                 (4, s.block_ids[4])]
    b.check_invariants()


def test_blocks_whose_hash_differs_are_computed_here():
    a, la = manager()
    _, remote = remote_of(a, la)
    b, lb = manager()
    other = PROMPT[:8] + (999,) + PROMPT[9:]  # block 2 differs: blocks 0 and 1 only
    (s,) = b.allocate(lb, [Allocation(len(other), other, KEY, remote)])
    assert s.num_transferred_tokens == 8
    b.free(lb, [s.seq_id])
    (s2,) = b.allocate(lb, [Allocation(len(PROMPT), PROMPT, CacheKey("model", "salt"), remote)])
    assert s2.num_transferred_tokens == 0 and not s2.reloads  # another salt: no hash matches
    b.check_invariants()


def test_a_sequence_freed_before_its_receipt_drops_the_transfers_and_leaks_nothing():
    a, la = manager()
    _, remote = remote_of(a, la)
    b, lb = manager()
    (s,) = b.allocate(lb, [Allocation(len(PROMPT), PROMPT, KEY, remote)])
    b.free(lb, [s.seq_id])
    assert b.tiers.transfers_dropped == 5 and b.stats().used_blocks == 0
    assert b.lookup_prefix(PROMPT, KEY) == (0, 0)
    b.check_invariants()


def test_refused_tickets_change_nothing():
    a, la = manager()
    ticket, _ = remote_of(a, la)
    b = node("b")
    forged = mpb.TransferTicket()
    forged.CopyFrom(ticket)
    forged.block_ids[0] = 7
    with pytest.raises(PermissionDeniedError):
        b.take(forged)
    for other, why in ((node("c", dtype="bfloat16"), "bfloat16"), (node("c", model="other"), "other"),
                       (node("a"), "own")):
        with pytest.raises(FailedPreconditionError) as e:
            other.take(ticket)
        assert e.value.reason == TRANSFER_TICKET_REFUSED and why in str(e.value)
    late = NodeTransfers("b", descriptor(), TRANSFER_KEY, wall_clock=lambda: 2000.0)
    with pytest.raises(FailedPreconditionError, match="expired"):
        late.take(ticket)
    with pytest.raises(FailedPreconditionError) as e:
        node("b", key=None).take(ticket)
    assert e.value.reason == TRANSFERS_OFF


def test_ticket_needs_a_key_and_a_published_source():
    a, la = manager()
    cached_on(a, la)
    pin = a.export_prefix(la, PROMPT, KEY)
    with pytest.raises(FailedPreconditionError) as e:
        node("a", key=None).ticket(pin, 10.0, a.pool.epochs)
    assert e.value.reason == TRANSFERS_OFF
    quiet = NodeTransfers("a", descriptor(), TRANSFER_KEY)
    with pytest.raises(FailedPreconditionError, match="no live worker") as e:
        quiet.ticket(pin, 10.0, a.pool.epochs)
    assert e.value.reason == TRANSFERS_OFF


def test_publish_refuses_a_source_for_another_pool():
    t = node("a")
    with pytest.raises(FailedPreconditionError):
        publish(t, 8, source())
    bogus = source()
    bogus.mem_type = "BOGUS"
    huge = source()
    huge.agent_metadata = b"m" * (64 << 10 | 1)
    for s in (source(blocks=9), grant_pb2.TransferSource(agent_name="", agent_metadata=b"m", base_address=1,
                                                         num_blocks=8, block_bytes=source().block_bytes), bogus, huge):
        with pytest.raises(InvalidArgumentError):
            publish(t, 7, s)
    assert list(t.sources) == ["a/1/g7"]


def test_only_a_worker_holding_the_plane_key_publishes_and_a_gone_one_leaves_the_tickets():
    a, lease = manager()
    cached_on(a, lease)
    now = [0.0]
    t = node("a", clock=lambda: now[0])
    pin = a.export_prefix(lease, PROMPT, KEY)
    for i in range(MAX_SOURCES + 1):  # another local process, without the plane key
        with pytest.raises(PermissionDeniedError, match="plane key"):
            publish(t, 7, source(f"fake/{i}/g7"), key=bytes(32))
    with pytest.raises(PermissionDeniedError):  # a real signature does not cover another source
        t.publish(mpb.PublishTransferSourceRequest(pool_generation=7, source=source("fake/x/g7"),
                                                   signature=sign_source(PLANE_KEY, 7, source("a/1/g7"))), PLANE_KEY)
    assert list(t.sources) == ["a/1/g7"] and t.ticket(pin, 10.0, a.pool.epochs).source.agent_name == "a/1/g7"
    now[0] = SOURCE_TTL / 2
    publish(t, 7, source("a/2/g7"))
    now[0] = SOURCE_TTL + 1  # a/1 was not published again: its worker is gone
    assert t.ticket(pin, 10.0, a.pool.epochs).source.agent_name == "a/2/g7" and list(t.sources) == ["a/2/g7"]
    with pytest.raises(PermissionDeniedError):  # withdrawing is signed too
        t.publish(mpb.PublishTransferSourceRequest(pool_generation=7, source=source("a/2/g7"), withdraw=True,
                                                   signature=sign_source(PLANE_KEY, 7, source("a/2/g7"))), PLANE_KEY)
    publish(t, 7, source("a/2/g7"), withdraw=True)  # the worker stops
    with pytest.raises(FailedPreconditionError, match="no live worker"):
        t.ticket(pin, 10.0, a.pool.epochs)


def test_transfer_key_file_must_be_private_and_hold_32_bytes(tmp_path):
    p = tmp_path / "key"
    p.write_text(TRANSFER_KEY.hex() + "\n")
    os.chmod(p, 0o600)
    assert load_transfer_key(p) == TRANSFER_KEY
    os.chmod(p, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_transfer_key(p)
    p.write_text("abcd")
    os.chmod(p, 0o600)
    with pytest.raises(ValueError, match="32 bytes"):
        load_transfer_key(p)


def test_an_fp8_node_exports_no_ticket_since_no_node_could_take_it():
    a, la = manager()
    cached_on(a, la)
    pin = a.export_prefix(la, PROMPT, KEY)
    fp8 = node("a", dtype="fp8_e4m3")
    for export in (fp8.require_export, lambda: fp8.ticket(pin, 10.0, a.pool.epochs)):
        with pytest.raises(FailedPreconditionError, match="fp8") as e:
            export()
        assert e.value.reason == TRANSFERS_OFF  # the scheduler computes the prompt here instead
    node("a").require_export()  # a float32 node with a key exports
