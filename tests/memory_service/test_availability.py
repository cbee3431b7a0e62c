"""A memory service that one caller cannot stall (issue 15): keep-alives survive stalls, every
call does bounded work, event streams have no silent gaps, malformed bytes are INVALID_ARGUMENT.

Real processes where the behaviour needs one (SIGSTOP, gRPC parsing, streams); the lease table
and the block manager in process with a hand-driven clock for the exact accounting. No timing
asserts: the stall test pauses the service for longer than the TTL and checks what survived.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from helpers.credentials import admin_md, new_lease

from client.errors import error_info
from client.lease import Lease
from client.services import MemoryClient
from memory_service.leases import LeaseTable
from memory_service.manager import block_manager as bm
from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation
from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.runtime.errors import FailedPreconditionError, NotFoundError
from pagedkv.runtime.grants import sign_receipt, token_digest
from pagedkv.runtime.limits import MAX_BATCH, MAX_FORK_CHILDREN, MAX_TOKEN_IDS_PER_CALL
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.pool_socket import receive_handle

log = get_logger("test")


def stats(stub) -> dict:
    s = stub.GetStats(pb.GetStatsRequest())
    return {f.name: v for f, v in s.ListFields() if f.name != "allocation_failures"}


def wait_until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


# ----------------------------------------------------------------- keep-alives and stalls
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stall_is_credited_to_every_lease_but_is_not_immortality():
    clock = FakeClock()
    dropped = []
    table = LeaseTable(1.0, lambda lease: dropped.append(lease.lease_id) or 0, clock)
    table.watch_stalls(0.25)
    kept, idle = table.create().lease_id, table.create().lease_id
    clock.now += 0.2
    table.expire()  # a sweep on time: nothing credited
    assert table.stall_credit == 0 and table[kept].expires_at == 101.0
    clock.now += 3.0  # the service paused 3 s: no sweep, no call
    assert table.keep_alive(kept) == 1.0  # the first call after the stall renews; nothing expired
    assert table.stall_credit == pytest.approx(2.75) and dropped == []
    assert table[idle].expires_at == pytest.approx(101.0 + 2.75)
    clock.now += 0.2  # within the hold after a stall: still nothing expires
    assert table.expire() == [] and len(table) == 2
    expired = []
    for _ in range(2):  # sweeps on time again (103.65, 103.9): the idle lease's credit (to 103.75) runs out
        clock.now += 0.25
        expired += table.expire()
    assert expired == dropped == [idle] and list(table) == [kept] and table.stall_credit == pytest.approx(2.75)
    with pytest.raises(FailedPreconditionError, match="expired"):
        table.lookup(idle)


def test_a_sweep_a_little_late_is_not_a_stall():
    """Sweeps that wake a few milliseconds late (as asyncio.sleep does) credit nothing, so an idle
    lease expires at its TTL (each one crediting its lateness held expiry off for ever)."""
    clock = FakeClock()
    dropped = []
    table = LeaseTable(1.0, lambda lease: dropped.append(lease.lease_id) or 0, clock)
    table.watch_stalls(0.25)
    idle = table.create().lease_id
    expired = []
    for _ in range(5):
        clock.now += 0.25 + 0.002
        expired += table.expire()
    assert expired == dropped == [idle] and table.stall_credit == 0


def test_without_the_sweep_nothing_is_credited():
    clock = FakeClock()
    table = LeaseTable(1.0, lambda lease: 0, clock)
    a = table.create().lease_id
    clock.now += 3.0
    assert table.expire() == [a] and table.stall_credit == 0


def test_a_lease_kept_alive_survives_a_pause_longer_than_its_ttl(start_service):
    svc = start_service(["memory", "--num-blocks", "64", "--block-size", "4", "--lease-ttl", "1",
                         "--grace", "0"], name="paused")
    memory = MemoryClient(svc.address, timeout=60)
    kept = Lease(memory, ttl=1.0)  # renews every third of its TTL from a thread
    idle = memory.create_lease(1.0).lease_id
    try:
        a, b = memory.allocate(kept.lease_id, [6, 3]).sequences
        (c,) = memory.allocate(idle, [5]).sequences
        assert (list(a.block_ids), list(b.block_ids), list(c.block_ids)) == ([0, 1], [2], [3, 4])
        os.kill(svc.pid, signal.SIGSTOP)
        time.sleep(3.0)  # three TTLs with no keep-alive served
        os.kill(svc.pid, signal.SIGCONT)
        assert memory.keep_alive(kept.lease_id) == 1.0
        listed = memory.sequences(kept.lease_id)
        assert [(s.seq_id, s.num_tokens, list(s.block_ids)) for s in listed] == [
            (a.seq_id, 6, [0, 1]), (b.seq_id, 3, [2])]
        # The idle lease got the same credit, then expires like any other.
        wait_until(lambda: memory.stats().num_leases == 1, "the idle lease to expire")
        s = memory.stats()
        assert (s.num_leases, s.num_sequences, s.used_blocks, s.free_blocks, s.tokens_stored) == (1, 2, 3, 61, 9)
        with pytest.raises(Exception, match="expired"):
            memory.keep_alive(idle)
        assert "stall_credited" in svc.log()
    finally:
        kept.close()
        memory.close()


# ----------------------------------------------------------------------- bounded work
def test_a_keep_alive_is_answered_while_a_huge_fork_is_refused(memory_stub):
    stub = memory_stub
    lease, md = new_lease(stub, owner="forker")
    (parent,) = stub.AllocateSequences(pb.AllocateSequencesRequest(
        lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=5)]), metadata=md).sequences
    before = stats(stub)
    fork = stub.ForkSequences.future(pb.ForkSequencesRequest(
        lease_id=lease, forks=[pb.SequenceFork(parent_seq_id=parent.seq_id)] * 40_000), metadata=md)
    assert stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease), metadata=md).expires_in_seconds == 30
    with pytest.raises(grpc.RpcError) as exc:
        fork.result()
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than the {MAX_FORK_CHILDREN}" in exc.value.details()
    assert "pagedkv.runtime.limits.MAX_FORK_CHILDREN" in exc.value.details()
    assert stats(stub) == before
    info = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=parent.seq_id), metadata=md).sequence
    assert list(info.ref_counts) == [1, 1]
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)


def test_per_call_limits_are_refused_before_anything_changes(memory_stub):
    stub = memory_stub
    lease, md = new_lease(stub, owner="limits")
    (seq,) = stub.AllocateSequences(pb.AllocateSequencesRequest(
        lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=1, token_ids=[1])]), metadata=md).sequences
    before = stats(stub)
    too_many = [
        (stub.AllocateSequences, pb.AllocateSequencesRequest(
            lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=1)] * (MAX_BATCH + 1)), "MAX_BATCH"),
        (stub.FreeSequences, pb.FreeSequencesRequest(lease_id=lease, seq_ids=range(MAX_BATCH + 1)), "MAX_BATCH"),
        (stub.AllocateSequences, pb.AllocateSequencesRequest(lease_id=lease, sequences=[pb.SequenceAllocation(
            num_tokens=1, token_ids=[1] * (MAX_TOKEN_IDS_PER_CALL + 1))]), "MAX_TOKEN_IDS_PER_CALL"),
        (stub.AppendSlots, pb.AppendSlotsRequest(lease_id=lease, appends=[pb.SlotAppend(
            seq_id=seq.seq_id, num_tokens=MAX_TOKEN_IDS_PER_CALL + 1, token_ids=[1] * (MAX_TOKEN_IDS_PER_CALL + 1))]),
         "MAX_TOKEN_IDS_PER_CALL"),
    ]
    for call, request, limit in too_many:
        with pytest.raises(grpc.RpcError) as exc:
            call(request, metadata=md)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, limit
        assert f"pagedkv.runtime.limits.{limit}" in exc.value.details()
        assert stats(stub) == before
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)


def test_a_big_lease_is_released_in_chunks_with_exact_accounting(monkeypatch):
    monkeypatch.setattr(bm, "RELEASE_CHUNK_BLOCKS", 5)
    chunked, whole = BlockManager(40, 4), BlockManager(40, 4)
    woken = []
    chunked.on_releasing = lambda: woken.append(1)
    for m in (chunked, whole):
        m.leases.create(owner="other")
    lease = chunked.leases.create().lease_id
    ref = whole.leases.create().lease_id
    for m, lid in ((chunked, lease), (whole, ref)):
        a, b = m.allocate(lid, [Allocation(13), Allocation(9)])
        m.fork(lid, [a.seq_id])
    assert chunked.leases.release(lease) == 3
    # At once no sequence is reachable, but only 5 of the 4 + 3 + 4 references came back: a's 4
    # (its blocks still shared with the fork) and b's last block, the one block freed so far.
    assert len(chunked.sequences) == 0 and woken == [1] and chunked.releasing_refs == 6
    with pytest.raises(NotFoundError):
        chunked.get_sequence(a.seq_id)
    s = chunked.stats()
    assert (s.used_blocks, s.free_blocks, s.num_sequences) == (6, 34, 0)
    chunked.check_invariants()
    assert chunked.drain_released(5) == 1 and chunked.drain_released(5) == 0
    whole.leases.release(ref)
    whole.drain_released()  # the reference: every reference returned in one go
    assert chunked.stats() == whole.stats()
    chunked.check_invariants()
    # The free queue's order is the one a single free leaves: later allocations get the same blocks.
    lid, rid = chunked.leases.create().lease_id, whole.leases.create().lease_id
    assert [s.block_ids for s in chunked.allocate(lid, [30, 7])] == [s.block_ids for s in whole.allocate(rid, [30, 7])]


def test_an_allocation_never_fails_while_released_blocks_are_returning(monkeypatch):
    monkeypatch.setattr(bm, "RELEASE_CHUNK_BLOCKS", 2)
    m = BlockManager(10, 4)
    lease = m.leases.create().lease_id
    m.allocate(lease, [40])  # the whole pool
    m.leases.release(lease)
    assert m.releasing_refs == 8 and m.stats().free_blocks == 2
    other = m.leases.create().lease_id
    (seq,) = m.allocate(other, [40])  # needs all 10: the rest are returned first, then granted
    assert len(seq.block_ids) == 10 and m.releasing_refs == 0
    m.check_invariants()


# ------------------------------------------------------------------------ event stream
def test_a_cursor_that_falls_behind_is_told_which_event_it_lost():
    m = BlockManager(12, 4, max_events=3)
    cursor = m.prefix_cache.subscribe()
    for _ in range(5):
        m.reset_prefix_cache()  # events 1..5; the log keeps 3, 4, 5
    with pytest.raises(FailedPreconditionError, match="KV event 1 is lost") as exc:
        cursor.poll()
    assert exc.value.metadata == {"first_lost": "1", "oldest_retained": "3"}
    with pytest.raises(FailedPreconditionError, match="KV event 2 is lost"):
        m.prefix_cache.subscribe(2)
    assert [e.sequence_number for e in m.prefix_cache.subscribe(3).poll(2)] == [3, 4]


def produce_events(stub, total: int, rate: float) -> tuple[int, float]:
    """Prefix-cache events at about ``rate`` events/s until at least ``total``, as a scheduler and
    its worker make them: each cycle allocates a 32-block prompt never seen before, hands in a
    worker's receipt for it (32 "stored" events in one call: this process holds the plane key, as a
    worker of the same uid does) and frees it, so later allocations evict its blocks ("removed"
    events). Returns (events made, seconds taken)."""
    pool = stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool
    handle = receive_handle(pool.worker_socket)
    handle.close()
    lease, md = new_lease(stub)
    tokens_per_seq = 32 * pool.layout.block_size
    stats = lambda: stub.GetStats(pb.GetStatsRequest())  # noqa: E731
    evictions0 = stats().prefix_cache_evictions
    made, cycle, t0 = 0, 0, time.monotonic()
    while made < total:
        tokens = list(range(cycle * tokens_per_seq, (cycle + 1) * tokens_per_seq))
        resp = stub.AllocateSequences(pb.AllocateSequencesRequest(lease_id=lease, sequences=[
            pb.SequenceAllocation(num_tokens=len(tokens), token_ids=tokens)]), metadata=md)
        (seq,), (grant,) = resp.sequences, resp.grants
        receipt = sign_receipt(handle.plane_key, grant_pb2.StepReceipt(
            pool_generation=pool.generation, seq_id=seq.seq_id, start=0, end=len(tokens),
            token_digest=token_digest(tokens), block_ids=grant.block_ids, block_epochs=grant.block_epochs))
        assert stub.CommitComputedTokens(pb.CommitComputedTokensRequest(lease_id=lease, receipts=[receipt]),
                                         metadata=md).blocks_registered == 32
        stub.FreeSequences(pb.FreeSequencesRequest(lease_id=lease, seq_ids=[seq.seq_id]), metadata=md)
        cycle += 1
        made = 32 * cycle + stats().prefix_cache_evictions - evictions0
        ahead = made / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    seconds = time.monotonic() - t0
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)
    return made, seconds


def test_an_event_stream_under_load_has_no_gap_and_a_lost_replay_is_named(start_service):
    svc = start_service(["memory", "--num-blocks", "64", "--block-size", "4", "--max-kv-events", "1000",
                         "--grace", "0"], name="events")  # a 32-block prompt: its blocks are evicted two prompts on
    with grpc.insecure_channel(svc.address) as channel:
        stub = pb_grpc.MemoryServiceStub(channel)
        stream = stub.StreamKvEvents(pb.StreamKvEventsRequest())
        seen: list[int] = []

        def read() -> None:
            try:
                for e in stream:
                    seen.append(e.sequence_number)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    seen.append(-1)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while not seen:  # a "cleared" event at a time until the stream shows it follows
            stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=admin_md(svc))
            time.sleep(0.05)
        start = len(seen)
        made, seconds = produce_events(stub, 10_000, rate=5_000)  # 10 times the events the service keeps
        log.info("kv_event_load", events=made, seconds=round(seconds, 2), rate=round(made / seconds))
        # 90 s: a loaded 2-core host delivers them slowly; the test is about gaps, not speed.
        wait_until(lambda: len(seen) >= start + made, f"{made} events on the stream", timeout=90.0)
        stream.cancel()
        reader.join()
        assert seen == list(range(seen[0], seen[0] + len(seen)))  # every event, in order, no gap, no error
        last = seen[-1]

        lost = stub.StreamKvEvents(pb.StreamKvEventsRequest(from_sequence_number=1))
        with pytest.raises(grpc.RpcError) as exc:
            next(lost)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        oldest = last - 1000 + 1
        assert "KV event 1 is lost" in exc.value.details() and f"the oldest kept is {oldest}" in exc.value.details()
        assert error_info(exc.value) == ("FAILED_PRECONDITION", {"first_lost": "1", "oldest_retained": str(oldest)})


@pytest.mark.parametrize("first", [2**64 - 1, "next + 1"])
def test_an_event_cursor_past_the_head_is_out_of_range_at_once(memory_service, memory_stub, first):
    """A subscriber asking for an event beyond the next one to be logged would wait for ever (or get a
    later event than it asked for): OUT_OF_RANGE before anything is sent, naming the next event."""
    memory_stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=admin_md(memory_service))  # one event at least
    last = 0
    with pytest.raises(grpc.RpcError) as exc:  # the replay up to the last event logged, then the stream waits
        for e in memory_stub.StreamKvEvents(pb.StreamKvEventsRequest(from_sequence_number=1), timeout=1):
            last = e.sequence_number
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and last >= 1
    first = last + 2 if first == "next + 1" else first
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:
        next(memory_stub.StreamKvEvents(pb.StreamKvEventsRequest(from_sequence_number=first), timeout=10))
    assert exc.value.code() == grpc.StatusCode.OUT_OF_RANGE and time.monotonic() - t0 < 5
    assert f"from_sequence_number {first} is past the next KV event to be logged, {last + 1}" in exc.value.details()
    assert error_info(exc.value) == ("OUT_OF_RANGE", {"next": str(last + 1)})
    waiting = memory_stub.StreamKvEvents(pb.StreamKvEventsRequest(from_sequence_number=last + 1), timeout=0.5)
    with pytest.raises(grpc.RpcError) as exc:
        next(waiting)  # the next event is a fine place to start: the stream waits for it
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


# ---------------------------------------------------------------------- malformed bytes
MALFORMED = b"\x0a\xff\xff\xff"  # field 1, length-delimited, with a length that runs past the end


@pytest.mark.parametrize("method", ["KeepAlive", "AllocateSequences", "StreamKvEvents"])
def test_malformed_bytes_are_invalid_argument_on_the_memory_service(memory_service, method):
    with grpc.insecure_channel(memory_service.address) as channel:
        path = f"/pagedkv.memory.v1.MemoryService/{method}"
        call = (channel.unary_stream if method == "StreamKvEvents" else channel.unary_unary)(path)
        with pytest.raises(grpc.RpcError) as exc:
            result = call(MALFORMED, timeout=30)
            if method == "StreamKvEvents":
                next(result)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "do not parse" in exc.value.details() and method in exc.value.details()
        assert error_info(exc.value) == ("INVALID_ARGUMENT", {})


def test_malformed_bytes_are_invalid_argument_on_the_worker(stack):
    with grpc.insecure_channel(stack.workers[0].address) as channel:
        step = channel.unary_unary("/pagedkv.compute.v1.ComputeService/Step")
        with pytest.raises(grpc.RpcError) as exc:
            step(MALFORMED, timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "do not parse" in exc.value.details()
