"""Default limits of the memory service (memory_service/quotas.py), against a real process started
without quota flags: one lease holds at most half the pool, one local uid at most a few leases
(here ``--max-leases-per-peer 3``), and a lease created with the admin token is exempt from both.
Refusals are RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED and change nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import socket

import grpc
import pytest
from conftest import local_stack
from helpers.credentials import admin_md, new_lease

from client.errors import error_info
from client.lease import Lease
from client.services import MemoryClient
from memory_service.main import build_parser
from memory_service.peers import parse_peer, socket_uid
from memory_service.quotas import BlockQuota, parse_block_quota, parse_limit
from memory_service.spec import MemorySpec
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc

NUM_BLOCKS, BLOCK_SIZE, PER_PEER = 64, 4, 3
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """64 blocks of 4 tokens, the default block quota (50%: 32 blocks), 3 leases per peer."""
    with local_stack(tmp_path_factory.mktemp("defaults"),
                     ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--lease-ttl", "30",
                      "--max-leases-per-peer", str(PER_PEER)], num_workers=0, name="defaults") as s:
        yield s.memory


@pytest.fixture
def stub(service):
    with grpc.insecure_channel(service.address) as ch:
        yield pb_grpc.MemoryServiceStub(ch)


def allocate(stub, lease: str, md, blocks: int):
    return stub.AllocateSequences(pb.AllocateSequencesRequest(
        lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=blocks * BLOCK_SIZE)]), metadata=md)


def state(stub, service) -> tuple:
    stats = stub.GetStats(pb.GetStatsRequest())
    return stats, list(stub.ListSequences(pb.ListSequencesRequest(), metadata=admin_md(service)).sequences)


def release(stub, *leases) -> None:
    for lease, md in leases:
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)


def test_one_lease_holds_at_most_half_the_pool_and_the_admin_lease_all(stub, service):
    resp = stub.CreateLease(pb.CreateLeaseRequest())
    assert resp.max_blocks == NUM_BLOCKS // 2
    greedy = (resp.lease_id, (("pagedkv-lease-secret", resp.lease_secret),))
    allocate(stub, *greedy, 30)
    before = state(stub, service)
    with pytest.raises(grpc.RpcError) as exc:
        allocate(stub, *greedy, 3)  # 33 > 32
    assert exc.value.code() == EXHAUSTED and "--max-blocks-per-lease" in exc.value.details()
    assert error_info(exc.value) == ("QUOTA_EXCEEDED", {"quota": "blocks", "limit": "32", "requested": "3",
                                                         "held": "30"})
    assert state(stub, service) == before  # nothing changed, not even allocation_failures
    other = new_lease(stub)
    allocate(stub, *other, 32)  # the other client is not left waiting for the first to let go
    release(stub, greedy, other)

    admin = stub.CreateLease(pb.CreateLeaseRequest(), metadata=admin_md(service))
    assert admin.max_blocks == 0  # no quota
    whole = (admin.lease_id, (("pagedkv-lease-secret", admin.lease_secret),))
    allocate(stub, *whole, NUM_BLOCKS)  # the whole pool, as pagedkv serve's lease may
    release(stub, whole)


def test_one_peer_holds_at_most_its_leases_and_the_admin_is_not_counted(stub, service):
    held = [new_lease(stub) for _ in range(PER_PEER)]
    before = state(stub, service)
    with pytest.raises(grpc.RpcError) as exc:
        stub.CreateLease(pb.CreateLeaseRequest())
    assert exc.value.code() == EXHAUSTED
    assert f"this caller (uid {os.getuid()}) holds {PER_PEER} leases" in exc.value.details()
    assert "--max-leases-per-peer" in exc.value.details()
    assert error_info(exc.value) == ("QUOTA_EXCEEDED", {"quota": "leases", "limit": str(PER_PEER), "requested": "1",
                                                         "held": str(PER_PEER)})
    assert state(stub, service) == before
    with grpc.insecure_channel(service.address) as ch:  # another connection is the same uid
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.MemoryServiceStub(ch).CreateLease(pb.CreateLeaseRequest())
        assert exc.value.code() == EXHAUSTED
    admin = new_lease(stub, admin_md(service))  # exempt, and not counted
    release(stub, held[0])
    again = new_lease(stub)  # a released lease gives its place back
    release(stub, *held[1:], again, admin)


def test_a_bad_admin_token_is_refused_not_taken_for_none(stub):
    with pytest.raises(grpc.RpcError) as exc:
        stub.CreateLease(pb.CreateLeaseRequest(), metadata=(("authorization", "Bearer not-the-token"),))
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_client_creates_its_lease_with_the_token_file_it_is_given(service, tmp_path):
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    for token_file, quota in [(service.info["admin_token_file"], None), (wrong, NUM_BLOCKS // 2),
                              (tmp_path / "missing", NUM_BLOCKS // 2), (None, NUM_BLOCKS // 2)]:
        memory = MemoryClient(service.address, lease_admin_token_file=token_file)
        lease = Lease(memory)
        try:
            assert lease.max_blocks == quota, token_file  # a refused or unreadable token: a plain lease
            assert memory.admin_token is None  # the admin calls stay off
        finally:
            lease.close()
            memory.close()


# ----------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("text, blocks", [("50%", 32), ("100%", 64), ("1%", 1), ("12.5%", 8), ("10", 10),
                                          ("none", None), ("0", None), ("NONE", None)])
def test_block_quota_forms(text, blocks):
    assert parse_block_quota(text).resolve(NUM_BLOCKS) == blocks


@pytest.mark.parametrize("text, message", [("150%", "a percent must be in (0, 100]"), ("0%", "in (0, 100]"),
                                           ("-3", "must be >= 1 (0 for none)"), ("half", "is not a block count"),
                                           ("x%", "is not a percent"), ("nan%", "in (0, 100]")])
def test_bad_block_quotas_are_refused_with_what_is_accepted(text, message, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        parse_block_quota(text)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--max-blocks-per-lease", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--max-blocks-per-lease" in err and message in err and "a percent of the pool's blocks (e.g. 50%)" in err


def test_the_defaults_and_the_overrides(monkeypatch):
    monkeypatch.delenv("PAGEDKV_MAX_BLOCKS_PER_LEASE", raising=False)
    monkeypatch.delenv("PAGEDKV_MAX_LEASES_PER_PEER", raising=False)
    spec = MemorySpec.from_args(build_parser().parse_args(["--num-blocks", "64"]))
    assert spec.max_blocks_per_lease == BlockQuota(percent=50) and spec.max_leases_per_peer == 64
    args = build_parser().parse_args(["--max-blocks-per-lease", "none", "--max-leases-per-peer", "0"])
    assert args.max_blocks_per_lease.resolve(64) is None and args.max_leases_per_peer is None
    monkeypatch.setenv("PAGEDKV_MAX_BLOCKS_PER_LEASE", "25%")
    monkeypatch.setenv("PAGEDKV_MAX_LEASES_PER_PEER", "none")
    args = build_parser().parse_args([])
    assert args.max_blocks_per_lease.resolve(64) == 16 and args.max_leases_per_peer is None
    assert parse_limit("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="is not a count"):
        parse_limit("many")


# ----------------------------------------------------------------------------- the peer
def test_a_loopback_peer_is_the_uid_owning_its_socket():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as c:
        host, port = c.getsockname()
        assert parse_peer(f"ipv4:{host}:{port}") == (host, port)
        assert socket_uid(host, port) == os.getuid()
        assert socket_uid("127.0.0.1", 1) is None  # no such connection
    assert parse_peer("ipv6:%5B::1%5D:5000") == ("::1", 5000) and parse_peer("unix:/tmp/s") == (None, 0)


# ----------------------------------------------------------------------------- the engine under a quota
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_engine_meets_its_lease_quota_without_failing_the_others(tmp_path, tiny_model, mode):
    """A plain lease (no admin token) under a block quota of 6: the longest sequence served is 6 blocks;
    parallel samples whose fork passes the quota are preempted while another request of the lease runs
    (its blocks come back) and all finish as they would alone; alone past the quota, a request fails
    with QUOTA_EXCEEDED and the engine goes on. In swap mode too: a victim of the quota is preempted
    by recompute (its swapped-out blocks would still count against the quota)."""
    from client import Client, SamplingParams
    from client.errors import QuotaExceeded

    long, short = list(range(10, 50)), list(range(60, 80))  # 40 and 20 tokens: 3 and 2 blocks of 16
    one = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    two = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=8, ignore_eos=True)  # 2 x 2 blocks
    with local_stack(tmp_path, ["--num-blocks", "64", "--block-size", "16", "--max-blocks-per-lease", "6",
                                "--host-cache-memory", "1MiB"], num_workers=1, name="quota", model=tiny_model[0]) as s:
        with Client(s.memory.address, s.worker_addresses, preemption_mode=mode) as c:
            assert c.engine.lease.max_blocks == 6 and c.limits.max_context == 6 * 16
            alone = [c.generate([long], one)[0], c.generate([short], two)[0]]
            assert c.engine.preemption.preemptions == 0
            together = c.generate([long, short], [one, two])  # 3 + 2 blocks, then the fork's 2: past 6
            assert c.engine.preemption.preemptions > 0
            assert [[o.token_ids for o in r.outputs] for r in together] == [[o.token_ids for o in r.outputs]
                                                                            for r in alone]
            grow = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # 20 + 30 tokens: 4 blocks each
            pair = [list(range(100, 120)), list(range(200, 220))]
            apart = [c.generate([p], grow)[0].outputs[0].token_ids for p in pair]
            before = c.engine.preemption.preemptions
            assert [r.outputs[0].token_ids for r in c.generate(pair, grow)] == apart  # 8 blocks: past 6 on the way
            assert c.engine.preemption.preemptions > before and c.engine.preemption.swaps == 0
            four = SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=8, ignore_eos=True)
            with pytest.raises(QuotaExceeded):  # its 4 sequences of 3 blocks can never fit 6
                c.generate([long], four)
            assert c.generate([long], one)[0].outputs[0].token_ids == alone[0].outputs[0].token_ids  # it goes on
