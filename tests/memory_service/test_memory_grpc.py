"""The memory service over gRPC, against a real server process on a free port."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.credentials import admin_md, new_lease

from client.errors import error_info
from pagedkv.memory.v1 import memory_service_pb2 as pb


def call_error(fn, request, metadata=()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        fn(request, metadata=metadata)
    return exc.value


def stats_without_failures(stub) -> dict:
    s = stub.GetStats(pb.GetStatsRequest())
    return {f.name: v for f, v in s.ListFields() if f.name != "allocation_failures"}


def test_every_rpc(memory_stub, memory_service):
    stub = memory_stub
    pool = stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool
    assert pool.backend == pb.POOL_BACKEND_CPU
    assert (pool.layout.num_layers, pool.layout.num_kv_heads, pool.layout.head_dim) == (30, 3, 64)
    assert (pool.layout.block_size, pool.layout.num_blocks, pool.layout.dtype) == (4, 64, "float32")
    assert list(pool.shape) == [64, 30, 2, 4, 3, 64]
    assert list(pool.strides) == [30 * 2 * 4 * 3 * 64, 2 * 4 * 3 * 64, 4 * 3 * 64, 3 * 64, 64, 1]
    assert pool.nbytes == 64 * pool.block_nbytes == 64 * 30 * 2 * 4 * 3 * 64 * 4
    assert pool.worker_socket == memory_service.info["worker_socket"] and not pool.shm_path  # the handle: socket only
    assert pool.generation == memory_service.info["generation"]

    lease, md = new_lease(stub, owner="test")
    assert stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease), metadata=md).expires_in_seconds == 30
    base = stub.GetStats(pb.GetStatsRequest())
    first = base.total_blocks - base.available_blocks  # blocks other tests in the module hold (none)
    assert first == 0

    alloc = stub.AllocateSequences(pb.AllocateSequencesRequest(
        lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=6),
                                   pb.SequenceAllocation(num_tokens=3)]), metadata=md)
    a, b = alloc.sequences
    assert list(a.block_ids) == [0, 1] and list(b.block_ids) == [2] and a.num_tokens == 6

    fork = stub.ForkSequences(pb.ForkSequencesRequest(lease_id=lease, forks=[pb.SequenceFork(parent_seq_id=a.seq_id)]),
                              metadata=md)
    (c,) = fork.children
    assert list(c.block_ids) == [0, 1]
    info = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=c.seq_id), metadata=md).sequence
    assert list(info.ref_counts) == [2, 2] and info.parent_seq_id == a.seq_id and info.lease_id == ""  # admin only
    admin = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=c.seq_id), metadata=admin_md(memory_service)).sequence
    assert admin.lease_id == lease

    app = stub.AppendSlots(pb.AppendSlotsRequest(lease_id=lease, appends=[
        pb.SlotAppend(seq_id=c.seq_id, num_tokens=1), pb.SlotAppend(seq_id=b.seq_id, num_tokens=2)]), metadata=md)
    assert [(x.src, x.dst) for x in app.copies] == [(1, 3)]
    # c: its last block (index 1) replaced by the copy; b: one new block at index 1.
    assert [(u.seq_id, u.first_changed, list(u.block_ids), u.num_tokens) for u in app.updates] == [
        (c.seq_id, 1, [3], 7), (b.seq_id, 1, [4], 5)]

    listed = stub.ListSequences(pb.ListSequencesRequest(lease_id=lease), metadata=md).sequences
    assert [s.seq_id for s in listed] == [a.seq_id, b.seq_id, c.seq_id]
    assert [list(s.ref_counts) for s in listed] == [[2, 1], [1, 1], [2, 1]]

    s = stub.GetStats(pb.GetStatsRequest())
    assert (s.used_blocks, s.free_blocks, s.available_blocks, s.num_sequences, s.num_leases) == (5, 59, 59, 3, 1)
    assert s.tokens_stored == 4 + 2 + 4 + 1 + 3  # blocks 0, 1, 2, 3, 4
    assert s.utilization == pytest.approx(14 / 20)

    freed = stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, seq_ids=[a.seq_id],
                                                       reason=pb.FREE_REASON_PREEMPTED),
                               metadata=md)
    assert freed.freed_blocks == 1
    assert stub.GetStats(pb.GetStatsRequest()).preemptions == 1
    assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md).freed_sequences == 2
    s = stub.GetStats(pb.GetStatsRequest())
    assert (s.used_blocks, s.available_blocks, s.num_leases) == (0, 64, 0)


def test_stats_say_how_the_pool_was_sized(memory_stub, memory_service):
    """Started with --num-blocks 64: GetStats' sizing says so (no device terms), and the start-up log
    has the capacity in blocks and tokens."""
    import json

    s = memory_stub.GetStats(pb.GetStatsRequest())
    block_nbytes = 30 * 2 * 4 * 3 * 64 * 4  # 30 layers, K and V, 4 tokens, 3 KV heads of 64, float32
    assert s.HasField("sizing") and (s.total_blocks, s.token_capacity, s.pool_bytes) == (64, 256, 64 * block_nbytes)
    z = s.sizing
    assert (z.source, z.requested_bytes) == (pb.POOL_SIZING_SOURCE_NUM_BLOCKS, 64 * block_nbytes)
    assert (z.device_total_bytes, z.utilization, z.weight_bytes, z.reserve_bytes, z.workers_per_device) == (0,) * 5
    (line,) = [json.loads(x) for x in memory_service.log().splitlines() if '"event": "pool_capacity"' in x]
    assert (line["num_blocks"], line["token_capacity"], line["pool_bytes"], line["sizing"]) == (
        64, 256, 64 * block_nbytes, "num_blocks")
    # pagedkv serve attaching with --gpu-memory-utilization is refused: this pool was sized by --num-blocks.
    from client.serve.backends import Backends, check_pool
    from client.serve.config import parse_args

    check_pool(parse_args([]), Backends(memory_service.address, [], "flags"))
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.9 \(the pool was sized by num_blocks\)"):
        check_pool(parse_args(["--gpu-memory-utilization", "0.9"]), Backends(memory_service.address, [], "flags"))


def test_health_and_reflection(memory_service):
    with grpc.insecure_channel(memory_service.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "pagedkv.memory.v1.MemoryService"):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=name)).status
                == health_pb2.HealthCheckResponse.SERVING
            )


@pytest.fixture
def lease_with_seq(memory_stub, memory_service):
    stub = memory_stub
    lease, md = new_lease(stub, admin_md(memory_service))  # the admin's: shortfalls meet the pool, not the quota
    (seq,) = stub.AllocateSequences(
        pb.AllocateSequencesRequest(
            lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=5), pb.SequenceAllocation(num_tokens=40)]
        ),
        metadata=md,
    ).sequences[:1]
    freed = stub.AllocateSequences(
        pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=1)]), metadata=md
    ).sequences[0]
    stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, seq_ids=[freed.seq_id]), metadata=md)
    yield lease, seq.seq_id, freed.seq_id, md
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)


INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED, DENIED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
)

# (name, rpc, request builder(lease, seq, freed_seq), code, reason)
BAD_INPUT = [
    (
        "zero tokens",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(lease_id=l, sequences=[pb.SequenceAllocation(num_tokens=0)]),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "negative tokens",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(lease_id=l, sequences=[pb.SequenceAllocation(num_tokens=-5)]),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "token ids past the pool",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(
            lease_id=l, sequences=[pb.SequenceAllocation(num_tokens=1, token_ids=range(257))]
        ),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "megabyte lease id",
        "KeepAlive",
        lambda l, s, f: pb.KeepAliveRequest(lease_id="x" * (1 << 20)),
        DENIED,
        "PERMISSION_DENIED",
    ),
    (
        "huge tokens",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(lease_id=l, sequences=[pb.SequenceAllocation(num_tokens=2**62)]),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "empty batch",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(lease_id=l),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "more than available",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(
            lease_id=l, sequences=[pb.SequenceAllocation(num_tokens=200), pb.SequenceAllocation(num_tokens=100)]
        ),
        EXHAUSTED,
        "OUT_OF_BLOCKS",
    ),
    (
        "no lease",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(sequences=[pb.SequenceAllocation(num_tokens=1)]),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "unknown lease",
        "AllocateSequences",
        lambda l, s, f: pb.AllocateSequencesRequest(lease_id="nope", sequences=[pb.SequenceAllocation(num_tokens=1)]),
        DENIED,
        "PERMISSION_DENIED",
    ),
    (
        "zero append",
        "AppendSlots",
        lambda l, s, f: pb.AppendSlotsRequest(lease_id=l, appends=[pb.SlotAppend(seq_id=s, num_tokens=0)]),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "negative append",
        "AppendSlots",
        lambda l, s, f: pb.AppendSlotsRequest(lease_id=l, appends=[pb.SlotAppend(seq_id=s, num_tokens=-1)]),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "append past capacity",
        "AppendSlots",
        lambda l, s, f: pb.AppendSlotsRequest(lease_id=l, appends=[pb.SlotAppend(seq_id=s, num_tokens=256)]),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "append out of blocks",
        "AppendSlots",
        lambda l, s, f: pb.AppendSlotsRequest(lease_id=l, appends=[pb.SlotAppend(seq_id=s, num_tokens=240)]),
        EXHAUSTED,
        "OUT_OF_BLOCKS",
    ),
    (
        "batch naming one unknown",
        "AppendSlots",
        lambda l, s, f: pb.AppendSlotsRequest(
            lease_id=l, appends=[pb.SlotAppend(seq_id=s, num_tokens=1), pb.SlotAppend(seq_id=10**9, num_tokens=1)]
        ),
        NOT_FOUND,
        "NOT_FOUND",
    ),
    (
        "duplicate in batch",
        "AppendSlots",
        lambda l, s, f: pb.AppendSlotsRequest(lease_id=l, appends=[pb.SlotAppend(seq_id=s, num_tokens=1)] * 2),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "fork unknown",
        "ForkSequences",
        lambda l, s, f: pb.ForkSequencesRequest(
            lease_id=l, forks=[pb.SequenceFork(parent_seq_id=s), pb.SequenceFork(parent_seq_id=10**9)]
        ),
        NOT_FOUND,
        "NOT_FOUND",
    ),
    (
        "fork too many children",
        "ForkSequences",
        lambda l, s, f: pb.ForkSequencesRequest(lease_id=l, forks=[pb.SequenceFork(parent_seq_id=s)] * 4097),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    ("fork empty", "ForkSequences", lambda l, s, f: pb.ForkSequencesRequest(lease_id=l), INVALID, "INVALID_ARGUMENT"),
    (
        "double free",
        "FreeSequences",
        lambda l, s, f: pb.FreeSequencesRequest(lease_id=l, seq_ids=[f]),
        NOT_FOUND,
        "NOT_FOUND",
    ),
    (
        "free batch with one unknown",
        "FreeSequences",
        lambda l, s, f: pb.FreeSequencesRequest(lease_id=l, seq_ids=[s, 10**9]),
        NOT_FOUND,
        "NOT_FOUND",
    ),
    ("free empty", "FreeSequences", lambda l, s, f: pb.FreeSequencesRequest(lease_id=l), INVALID, "INVALID_ARGUMENT"),
    (
        "bad free reason",
        "FreeSequences",
        lambda l, s, f: pb.FreeSequencesRequest(lease_id=l, seq_ids=[s], reason=99),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "unknown block table",
        "GetBlockTable",
        lambda l, s, f: pb.GetBlockTableRequest(seq_id=10**9),
        NOT_FOUND,
        "NOT_FOUND",
    ),
    ("freed block table", "GetBlockTable", lambda l, s, f: pb.GetBlockTableRequest(seq_id=f), NOT_FOUND, "NOT_FOUND"),
    ("negative ttl", "CreateLease", lambda l, s, f: pb.CreateLeaseRequest(ttl_seconds=-1), INVALID, "INVALID_ARGUMENT"),
    # An unknown lease id with a secret is refused like another tenant's lease: ids cannot be probed.
    (
        "keep-alive unknown",
        "KeepAlive",
        lambda l, s, f: pb.KeepAliveRequest(lease_id="nope"),
        DENIED,
        "PERMISSION_DENIED",
    ),
    (
        "release unknown",
        "ReleaseLease",
        lambda l, s, f: pb.ReleaseLeaseRequest(lease_id="nope"),
        DENIED,
        "PERMISSION_DENIED",
    ),
    (
        "list unknown lease",
        "ListSequences",
        lambda l, s, f: pb.ListSequencesRequest(lease_id="nope"),
        DENIED,
        "PERMISSION_DENIED",
    ),
    (
        "page too large",
        "ListSequences",
        lambda l, s, f: pb.ListSequencesRequest(lease_id=l, page_size=2_001),
        INVALID,
        "INVALID_ARGUMENT",
    ),
    (
        "bad page token",
        "ListSequences",
        lambda l, s, f: pb.ListSequencesRequest(lease_id=l, page_token="not-a-token"),
        INVALID,
        "INVALID_ARGUMENT",
    ),
]


@pytest.mark.parametrize("name,rpc,build,code,reason", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_gets_its_code_and_changes_nothing(memory_stub, lease_with_seq, name, rpc, build, code, reason):
    lease, seq, freed, md = lease_with_seq
    before = stats_without_failures(memory_stub)
    failures = memory_stub.GetStats(pb.GetStatsRequest()).allocation_failures
    table = memory_stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq), metadata=md).sequence
    err = call_error(getattr(memory_stub, rpc), build(lease, seq, freed), md)
    assert err.code() == code, err.details()
    assert error_info(err)[0] == reason
    assert len(err.details()) > 20  # says what was wrong and what to do
    assert len(err.details()) < 1200  # quoted caller input is cut short
    assert stats_without_failures(memory_stub) == before
    assert memory_stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq), metadata=md).sequence == table
    after = memory_stub.GetStats(pb.GetStatsRequest()).allocation_failures
    assert after == failures + (reason == "OUT_OF_BLOCKS")
    if reason == "OUT_OF_BLOCKS":
        _, meta = error_info(err)
        assert int(meta["required"]) > int(meta["available"])


def test_expired_lease_is_failed_precondition(memory_stub):
    stub = memory_stub
    lease, md = new_lease(stub, ttl_seconds=0.2)
    stub.AllocateSequences(
        pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=9)]), metadata=md
    )
    used = stub.GetStats(pb.GetStatsRequest()).used_blocks
    time.sleep(0.5)
    err = call_error(
        stub.AllocateSequences,
        pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=1)]),
        md,
    )
    assert err.code() == PRECONDITION and "expired" in err.details()
    assert stub.GetStats(pb.GetStatsRequest()).used_blocks == used - 3


def test_oversize_message_is_refused_by_grpc(memory_stub):
    before = stats_without_failures(memory_stub)
    err = call_error(memory_stub.CreateLease, pb.CreateLeaseRequest(owner="x" * (65 << 20)))
    assert err.code() == EXHAUSTED
    assert error_info(err)[0] == ""  # gRPC's own refusal, not OUT_OF_BLOCKS
    assert stats_without_failures(memory_stub) == before


def test_sigterm_releases_the_pool(start_service, tmp_path):
    sock = tmp_path / "w.sock"
    svc = start_service(["memory", "--num-blocks", "8", "--grace", "0.2", "--worker-socket", str(sock)], name="term")
    with grpc.insecure_channel(svc.address) as ch:
        from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc

        path = pb_grpc.MemoryServiceStub(ch).GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool.worker_socket
    assert path == str(sock) and sock.exists()
    assert svc.stop() == 0  # SIGTERM: NOT_SERVING, socket closed, grace, stop, release
    assert not sock.exists()
    assert '"event": "pool_released"' in svc.log()
