"""Least authority at the memory service, against real processes (memory_service/authz.py).

A second tenant that knows only the victim's lease id can do nothing to it; admin-only calls
and token ids need the admin token; per-lease quotas refuse before anything changes; listings
page through every sequence exactly once.
"""

from __future__ import annotations

import base64
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import ROOT, local_stack
from helpers.credentials import LEASE_SECRET, admin_md, computed, lease_md, new_lease

from client.errors import QuotaExceeded, error_info
from client.services import MemoryClient
from memory_service.leases import lease_id_of
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc

UNAUTHENTICATED, DENIED, NOT_FOUND = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                                      grpc.StatusCode.NOT_FOUND)
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
BAD_ADMIN = (("authorization", "Bearer not-the-token"),)


def refused(call, request, metadata=()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call(request, metadata=metadata)
    return exc.value


@pytest.fixture(scope="module")
def quota_service(tmp_path_factory):
    """A memory service of 64 blocks of 4 tokens, each lease held to 8 table entries and 3 sequences."""
    with local_stack(
        tmp_path_factory.mktemp("quota"),
        [
            "--num-blocks",
            "64",
            "--block-size",
            "4",
            "--lease-ttl",
            "30",
            "--max-blocks-per-lease",
            "8",
            "--max-sequences-per-lease",
            "3",
            "--grace",
            "0.1",
            "--max-leases",
            "12",
        ],
        num_workers=0,
        name="quota",
    ) as s:
        yield s.memory


@pytest.fixture
def stub(quota_service):
    with grpc.insecure_channel(quota_service.address) as ch:
        yield pb_grpc.MemoryServiceStub(ch)


def snapshot(stub, service) -> tuple:
    """Everything a refused call must leave as it was: the counters and every block table (with refcounts)."""
    stats = stub.GetStats(pb.GetStatsRequest())
    tables = stub.ListSequences(pb.ListSequencesRequest(), metadata=admin_md(service)).sequences
    return stats, list(tables)


def test_admin_token_file_is_private(quota_service):
    path = Path(quota_service.info["admin_token_file"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) == 43  # secrets.token_urlsafe(32)


def test_another_tenant_with_only_the_lease_id_cannot_touch_it(stub, quota_service):
    victim, vmd = new_lease(stub)
    (seq,) = stub.AllocateSequences(
        pb.AllocateSequencesRequest(
            lease_id=victim, sequences=[pb.SequenceAllocation(num_tokens=6, token_ids=range(6))]
        ),
        metadata=vmd,
    ).sequences
    (child,) = stub.ForkSequences(
        pb.ForkSequencesRequest(lease_id=victim, forks=[pb.SequenceFork(parent_seq_id=seq.seq_id)]), metadata=vmd
    ).children
    attacker, amd = new_lease(stub)
    s = seq.seq_id
    attempts = [
        ("KeepAlive", pb.KeepAliveRequest(lease_id=victim)),
        ("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=victim)),
        ("FreeSequences", pb.FreeSequencesRequest(lease_id=victim, seq_ids=[s])),
        ("ForkSequences", pb.ForkSequencesRequest(lease_id=victim, forks=[pb.SequenceFork(parent_seq_id=s)])),
        ("AppendSlots", pb.AppendSlotsRequest(lease_id=victim, appends=[pb.SlotAppend(seq_id=s, num_tokens=1)])),
        (
            "CommitComputedTokens",
            pb.CommitComputedTokensRequest(
                lease_id=victim, sequences=[pb.ComputedTokens(seq_id=s, num_computed_tokens=4)]
            ),
        ),
        (
            "AllocateSequences",
            pb.AllocateSequencesRequest(lease_id=victim, sequences=[pb.SequenceAllocation(num_tokens=1)]),
        ),
        ("ListSequences", pb.ListSequencesRequest(lease_id=victim)),
        ("GetBlockTable", pb.GetBlockTableRequest(seq_id=s)),
    ]
    before = snapshot(stub, quota_service)
    table = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s), metadata=vmd).sequence
    assert list(table.ref_counts) == [2, 2] and table.lease_id == ""  # the owner is not the admin: no lease ids
    messages = {}
    for rpc, request in attempts:
        for metadata, code in [((), UNAUTHENTICATED), (amd, DENIED), (BAD_ADMIN, UNAUTHENTICATED)]:
            err = refused(getattr(stub, rpc), request, metadata)
            assert (rpc, err.code()) == (rpc, code), err.details()
            assert error_info(err)[0] == code.name
            assert snapshot(stub, quota_service) == before, rpc
            assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s), metadata=vmd).sequence == table
        messages[rpc] = err.details()
    # The attacker's own lease cannot name the victim's sequences either.
    for rpc, request in [
        ("FreeSequences", pb.FreeSequencesRequest(lease_id=attacker, seq_ids=[s])),
        ("ForkSequences", pb.ForkSequencesRequest(lease_id=attacker, forks=[pb.SequenceFork(parent_seq_id=s)])),
        ("AppendSlots", pb.AppendSlotsRequest(lease_id=attacker, appends=[pb.SlotAppend(seq_id=s, num_tokens=1)])),
    ]:
        assert refused(getattr(stub, rpc), request, amd).code() == NOT_FOUND
        assert snapshot(stub, quota_service) == before
    # Nothing tells a live lease from an unknown one: the same refusal, word for word.
    denied = refused(stub.KeepAlive, pb.KeepAliveRequest(lease_id=victim), amd).details()
    unknown = refused(stub.KeepAlive, pb.KeepAliveRequest(lease_id="f" * 32), amd).details()
    assert denied.replace(victim, "f" * 32) == unknown
    # Only the holder of a lease's secret hears that the lease is unknown here (e.g. after a restart of the
    # service): a lease id is derived from its secret, so the holder proves it without the service's memory.
    secret = secrets.token_urlsafe(32)
    gone = refused(stub.KeepAlive, pb.KeepAliveRequest(lease_id=lease_id_of(secret)), lease_md(secret))
    assert gone.code() == NOT_FOUND and "unknown lease" in gone.details()
    assert refused(stub.KeepAlive, pb.KeepAliveRequest(lease_id=lease_id_of(secret)), amd).code() == DENIED
    # Every lease's sequences are the admin's to list.
    err = refused(stub.ListSequences, pb.ListSequencesRequest(), vmd)
    assert err.code() == DENIED and "admin role" in err.details()
    # The owner still does everything; after a release only the owner hears NOT_FOUND.
    assert stub.KeepAlive(pb.KeepAliveRequest(lease_id=victim), metadata=vmd).expires_in_seconds == 30
    listed = stub.ListSequences(pb.ListSequencesRequest(lease_id=victim), metadata=vmd).sequences
    assert [x.seq_id for x in listed] == [s, child.seq_id] and {x.lease_id for x in listed} == {""}
    assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=victim), metadata=vmd).freed_sequences == 2
    assert refused(stub.KeepAlive, pb.KeepAliveRequest(lease_id=victim), vmd).code() == NOT_FOUND
    assert refused(stub.KeepAlive, pb.KeepAliveRequest(lease_id=victim), amd).code() == DENIED
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=attacker), metadata=amd)


@pytest.fixture
def stack_stub(stack):
    """A stub of the session stack's memory service (it has workers to compute blocks)."""
    with grpc.insecure_channel(stack.memory.address) as ch:
        yield pb_grpc.MemoryServiceStub(ch)


def test_reset_and_check_invariants_are_admin_only(stack_stub, stack):
    stub, service = stack_stub, stack.memory
    lease, md = new_lease(stub)
    seq = computed(stack, stub, lease, md, list(range(500, 536)), secrets.token_hex(8))  # 2 full blocks of 16
    stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, seq_ids=[seq.seq_id]), metadata=md)
    cached = stub.GetStats(pb.GetStatsRequest()).cached_blocks
    assert cached >= 2
    before = snapshot(stub, service)
    for rpc, request in [
        ("ResetPrefixCache", pb.ResetPrefixCacheRequest()),
        ("CheckInvariants", pb.CheckInvariantsRequest()),
    ]:
        for metadata in [(), md]:
            err = refused(getattr(stub, rpc), request, metadata)
            assert (
                err.code() == DENIED
                and "needs the admin role" in err.details()
                and "anonymous-loopback" in err.details()
            )
        assert refused(getattr(stub, rpc), request, BAD_ADMIN).code() == UNAUTHENTICATED
        assert snapshot(stub, service) == before
    checked = stub.CheckInvariants(pb.CheckInvariantsRequest(), metadata=admin_md(service))
    assert checked.ok and checked.violation == "" and checked.stats == before[0]
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=admin_md(service)).blocks_cleared == cached
    assert stub.GetStats(pb.GetStatsRequest()).cached_blocks == 0
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)


def first_stored(stub, start: int, metadata, match) -> pb.KvEvent:
    """The first BlockStored event from sequence number ``start`` on for which ``match(event.block_stored)``."""
    events = stub.StreamKvEvents(pb.StreamKvEventsRequest(from_sequence_number=start), timeout=10, metadata=metadata)
    try:
        for e in events:
            if e.WhichOneof("event") == "block_stored" and match(e.block_stored):
                return e
    except grpc.RpcError as e:  # a long-lived service no longer keeps event `start`: from the oldest it keeps
        if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
            raise
        return first_stored(stub, int(error_info(e)[1]["oldest_retained"]), metadata, match)
    finally:
        events.cancel()
    raise AssertionError("no such event")


def test_events_carry_token_ids_only_for_the_admin(stack_stub, stack):
    stub = stack_stub
    lease, md = new_lease(stub)
    tokens = list(range(7000, 7032))  # two full blocks of 16
    seq = computed(stack, stub, lease, md, tokens, secrets.token_hex(8))
    admin = first_stored(stub, 1, admin_md(stack.memory), lambda b: list(b.token_ids) == tokens[:16])
    assert admin.block_stored.block_id == seq.block_ids[0]
    for metadata in [(), md]:  # a router, a scheduler, the owner itself: no token ids
        other = first_stored(stub, admin.sequence_number, metadata, lambda b: True)
        assert other.sequence_number == admin.sequence_number
        assert other.block_stored.block_hash == admin.block_stored.block_hash
        assert list(other.block_stored.token_ids) == []
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)


def test_quotas_refuse_and_change_nothing(stub, quota_service):
    lease, md = new_lease(stub)
    (seq,) = stub.AllocateSequences(
        pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=18)]), metadata=md
    ).sequences  # 5 entries of the 8 allowed
    over = [  # (rpc, request, quota, requested, held)
        (
            "AllocateSequences",
            pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=16)]),
            "blocks",
            4,
            5,
        ),
        (
            "AppendSlots",
            pb.AppendSlotsRequest(lease_id=lease, appends=[pb.SlotAppend(seq_id=seq.seq_id, num_tokens=15)]),
            "blocks",
            4,
            5,
        ),
        (
            "ForkSequences",
            pb.ForkSequencesRequest(lease_id=lease, forks=[pb.SequenceFork(parent_seq_id=seq.seq_id)]),
            "blocks",
            5,
            5,
        ),
        (
            "AllocateSequences",
            pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=1)] * 3),
            "sequences",
            3,
            1,
        ),
    ]
    before = snapshot(stub, quota_service)
    for rpc, request, quota, requested, held in over:
        err = refused(getattr(stub, rpc), request, md)
        assert err.code() == EXHAUSTED, err.details()
        limit = 8 if quota == "blocks" else 3
        assert error_info(err) == (
            "QUOTA_EXCEEDED",
            {"quota": quota, "limit": str(limit), "requested": str(requested), "held": str(held)},
        )
        assert f"--max-{quota}-per-lease" in err.details()
        assert snapshot(stub, quota_service) == before, rpc  # allocation_failures included
    # Up to the quota is fine; a shared block counts for each sequence holding it.
    stub.AppendSlots(
        pb.AppendSlotsRequest(lease_id=lease, appends=[pb.SlotAppend(seq_id=seq.seq_id, num_tokens=2)]), metadata=md
    )  # 20 tokens: 5 entries
    stub.AllocateSequences(
        pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=12)]), metadata=md
    )  # 5 + 3 = 8 entries
    # Quotas are per lease: another lease has its own.
    m = MemoryClient(quota_service.address)
    other = m.create_lease().lease_id
    assert [len(t.block_ids) for t in m.allocate(other, [16, 16]).sequences] == [4, 4]
    with pytest.raises(QuotaExceeded) as exc:
        m.allocate(other, [1])
    assert (exc.value.quota, exc.value.limit, exc.value.requested, exc.value.held) == ("blocks", 8, 1, 8)
    assert stub.CheckInvariants(pb.CheckInvariantsRequest(), metadata=admin_md(quota_service)).ok
    m.release_lease(other)
    m.close()
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)


def pages(stub, metadata, page_size: int, lease_id: str | None = None) -> list[list[int]]:
    """Sequence ids of every page of a listing."""
    out, token = [], ""
    while True:
        resp = stub.ListSequences(
            pb.ListSequencesRequest(lease_id=lease_id, page_size=page_size, page_token=token), metadata=metadata
        )
        out.append([s.seq_id for s in resp.sequences])
        token = resp.next_page_token
        if not token:
            return out


def test_listings_page_through_every_sequence_once(memory_stub, memory_service, tmp_path):
    stub, admin = memory_stub, admin_md(memory_service)
    lease, md = new_lease(stub, admin)  # the admin's: 2,500 children pass the default half-pool block quota
    other, omd = new_lease(stub)
    (root,) = stub.AllocateSequences(
        pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=5)]), metadata=md
    ).sequences
    (theirs,) = stub.AllocateSequences(
        pb.AllocateSequencesRequest(lease_id=other, sequences=[pb.SequenceAllocation(num_tokens=1)]), metadata=omd
    ).sequences
    children = [
        c
        for n in (1024, 1024, 451)
        for c in stub.ForkSequences(
            pb.ForkSequencesRequest(lease_id=lease, forks=[pb.SequenceFork(parent_seq_id=root.seq_id)] * n), metadata=md
        ).children
    ]
    # Free every third child, so pages skip freed ids.
    gone = [c.seq_id for c in children[::3]]
    stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, seq_ids=gone), metadata=md)
    mine = sorted({root.seq_id, *(c.seq_id for c in children)} - set(gone))
    every = sorted(s for p in pages(stub, admin, 2_000) for s in p)
    assert len(every) == len(mine) + 1
    for size, metadata, lease_id, expected in [
        (0, admin, None, every),
        (700, admin, None, every),
        (650, md, lease, mine),
        (1, omd, other, [theirs.seq_id]),
    ]:
        got = pages(stub, metadata, size, lease_id)
        assert [s for p in got for s in p] == expected, (size, lease_id)
        assert [len(p) for p in got[:-1]] == [size or 1000] * (len(got) - 1) and 0 < len(got[-1]) <= (size or 1000)
    # Bad paging input is refused, naming the limit.
    err = refused(stub.ListSequences, pb.ListSequencesRequest(page_size=2_001), admin)
    assert err.code() == INVALID and "limit of 2000" in err.details()
    for token in ["garbage!", "c2VxOmFiYw", base64.urlsafe_b64encode(b"seq:-1").decode(), "c2VxOjEw=", "x" * 100]:
        assert refused(stub.ListSequences, pb.ListSequencesRequest(page_token=token), admin).code() == INVALID, token
    # The client and `pagedkv stats` (with the admin token file) see every sequence.
    m = MemoryClient(memory_service.address)
    m.add_lease(lease, dict(md)[LEASE_SECRET])
    assert [s.seq_id for s in m.sequences(lease)] == mine
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "client.ops.cli",
            "stats",
            "--admin-token-file",
            memory_service.info["admin_token_file"],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PAGEDKV_MEMORY": memory_service.address, "PAGEDKV_LOG_LEVEL": "error"},
    )
    assert out.returncode == 0, out.stderr
    assert f"Block tables of {len(every)} sequences" in out.stdout
    rows = [line.split()[0] for line in out.stdout.splitlines()[-len(every) :]]
    assert rows == [str(s) for s in every]
    m.close()
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=other), metadata=omd)


def test_sequence_pages_skip_freed_ids_across_compactions():
    from memory_service.manager.block_manager import BlockManager
    from memory_service.manager.paging import decode_page_token, encode_page_token

    m = BlockManager(8, 4)
    lease = m.leases.create().lease_id
    (root,) = m.allocate(lease, [5])
    ids = [root.seq_id] + [c.seq_id for _ in range(4) for c in m.fork(lease, [root.seq_id] * 1000)]
    for chunk in range(0, 3900, 300):  # free most of them, in several batches (the paging order is compacted)
        m.free(lease, ids[1 + chunk : 1 + chunk + 250])
    live = sorted(m.sequences)
    for lease_id in (None, lease):
        got, start = [], 0
        while start is not None:
            page, start = m.sequence_page(lease_id, start, 333)
            assert start is None or decode_page_token(encode_page_token(start)) == start
            got += [s.seq_id for s in page]
        assert got == live
    m.check_invariants()
    assert len(m.sequences._order) < 2 * len(live) + 1024 + 1


def test_a_scheduler_over_its_block_quota_preempts_instead_of_failing(tmp_path, tiny_model):
    # A lease's quota is met like a full pool: the engine preempts (recompute) and every request
    # still finishes with the output it has alone; no request fails because others share the lease.
    from client import Client, SamplingParams

    prompts = ["Name a color.", "Count to three.", "What is two plus two?", "Say hello.", "Name a fruit."]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)  # 2 blocks of 16 each: 10 > 6
    with local_stack(
        tmp_path,
        ["--num-blocks", "256", "--block-size", "16", "--max-blocks-per-lease", "6", "--grace", "0.1"],
        num_workers=1,
        name="quota-engine",
        model=tiny_model[0],
    ) as s:
        with Client(s.memory.address, s.worker_addresses) as c:
            alone = [c.generate(p, sp, cache_salt=f"alone-{i}")[0].outputs[0].token_ids for i, p in enumerate(prompts)]
            assert c.engine.preemption.preemptions == 0
            together = [r.outputs[0].token_ids for r in c.generate(prompts, sp, cache_salt="together")]
            assert c.engine.preemption.preemptions > 0
        assert together == alone


def test_leases_are_bounded_too(stub, quota_service):
    # Per-lease quotas bound what one lease holds; --max-leases bounds how many leases there are.
    held = stub.GetStats(pb.GetStatsRequest()).num_leases
    opened = [new_lease(stub) for _ in range(12 - held)]
    before = snapshot(stub, quota_service)
    err = refused(stub.CreateLease, pb.CreateLeaseRequest())
    assert err.code() == EXHAUSTED and "--max-leases" in err.details()
    assert error_info(err) == ("QUOTA_EXCEEDED", {"quota": "leases", "limit": "12", "requested": "1", "held": "12"})
    assert snapshot(stub, quota_service) == before
    assert refused(stub.CreateLease, pb.CreateLeaseRequest(owner="x" * 257)).code() == INVALID
    for lease, md in opened:
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)
    lease, md = new_lease(stub, owner="x" * 256)
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)
