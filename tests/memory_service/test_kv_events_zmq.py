"""The KV event log in vLLM's ZMQ/msgpack format (memory_service/kv_events), against real processes.

References, none of them the publisher's code: a decoder written from vLLM 0.32's published
schema (tests/helpers/vllm_kv_events.py: read with ``msgpack``, not msgspec structs),
the same run's gRPC StreamKvEvents (one event for one, in order), and the block hashes a router
computes from the prompt by the documented hash (docs/design-notes.md) given the salt. The memory
service runs alone: this process holds the plane key, as a worker of the same uid does, and signs
the receipts that put blocks in the prefix cache.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import grpc
import pytest
import zmq
import zmq.auth
from conftest import pagedkv_process
from helpers.credentials import admin_md, new_lease
from helpers.vllm_kv_events import MEDIA, Subscriber, decode_batch, replay, u64

from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.runtime.grants import sign_receipt, token_digest
from pagedkv.runtime.pool_socket import receive_handle

BS, MODEL, SALT = 4, "tiny-events", "tenant-7f3a"
PROMPT_A = list(range(100, 113))  # 13 tokens: 3 full blocks
PROMPT_B = list(range(500, 560))  # 60 tokens: 15 full blocks; with A's freed, the pool of 16 evicts
MEMORY_ARGS = ["memory", "--num-blocks", "16", "--block-size", str(BS), "--max-blocks-per-lease", "none"]


def from_grpc(e: pb.KvEvent) -> tuple:
    which = e.WhichOneof("event")
    if which == "block_stored":
        s = e.block_stored
        return ("stored", (u64(s.block_hash),), u64(s.parent_block_hash) if s.parent_block_hash else None,
                tuple(s.token_ids), BS, MEDIA[s.medium])
    if which == "block_removed":
        return ("removed", (u64(e.block_removed.block_hash),), MEDIA[e.block_removed.medium])
    return ("cleared",)


def router_hashes(tokens: list[int], salt: str) -> list[int]:
    """What a router computes from a prompt, by the documented hash: SHA-256 of b"pagedkv.block.v1", then
    fields kind byte + u64 little-endian length + value: P (parent hash, empty first), T (token ids int32
    LE), M (model id), S (cache salt); each full block chains the previous one's hash."""
    def field(kind: bytes, value: bytes) -> bytes:
        return kind + struct.pack("<Q", len(value)) + value

    out, parent = [], b""
    for i in range(len(tokens) // BS):
        chunk = tokens[i * BS:(i + 1) * BS]
        parent = hashlib.sha256(b"pagedkv.block.v1" + field(b"P", parent) + field(b"T", struct.pack(f"<{BS}i", *chunk))
                                + field(b"M", MODEL.encode()) + field(b"S", salt.encode())).digest()
        out.append(u64(parent))
    return out


# ------------------------------------------------------------------------- driving the service
class Driver:
    """Allocates, computes (a signed receipt), frees and resets on one memory service."""

    def __init__(self, svc):
        self.svc, self.channel = svc, grpc.insecure_channel(svc.address)
        self.stub = pb_grpc.MemoryServiceStub(self.channel)
        handle = receive_handle(self.stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool.worker_socket)
        self.key = handle.plane_key
        handle.close()
        self.lease, self.md = new_lease(self.stub)

    def compute(self, tokens: list[int], salt: str = SALT) -> int:
        resp = self.stub.AllocateSequences(pb.AllocateSequencesRequest(lease_id=self.lease, sequences=[
            pb.SequenceAllocation(num_tokens=len(tokens), token_ids=tokens, cache_salt=salt, model_id=MODEL)]),
            metadata=self.md)
        (seq,), (grant,) = resp.sequences, resp.grants
        receipt = sign_receipt(self.key, grant_pb2.StepReceipt(
            pool_generation=grant.pool_generation, seq_id=seq.seq_id, start=0, end=len(tokens),
            token_digest=token_digest(tokens), block_ids=grant.block_ids, block_epochs=grant.block_epochs))
        self.stub.CommitComputedTokens(pb.CommitComputedTokensRequest(lease_id=self.lease, receipts=[receipt]),
                                       metadata=self.md)
        return seq.seq_id

    def free(self, seq_id: int) -> None:
        self.stub.FreeSequences(pb.FreeSequencesRequest(lease_id=self.lease, seq_ids=[seq_id]), metadata=self.md)

    def reset(self) -> None:
        self.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=admin_md(self.svc))

    def grpc_events(self, n: int) -> list[pb.KvEvent]:
        """The first ``n`` events of the log, replayed from 1 with token ids (the admin)."""
        stream = self.stub.StreamKvEvents(pb.StreamKvEventsRequest(from_sequence_number=1),
                                          metadata=admin_md(self.svc), timeout=30)
        out = []
        for e in stream:
            out.append(e)
            if len(out) == n:
                break
        stream.cancel()
        return out


def connected(driver: Driver, sub: Subscriber) -> None:
    """Wait until ``sub`` receives (a PUB drops what it sends before a subscriber joins): one reset at a time."""
    def seen(s: Subscriber) -> bool:
        if not s.batches:
            driver.reset()
        return bool(s.batches)
    sub.receive_until(seen)


# ------------------------------------------------------------------------------------- the run
@pytest.fixture(scope="module")
def ipc_run(tmp_path_factory):
    """A memory service publishing on ipc:// (token ids go out), and one run that stores, evicts and clears."""
    tmp = tmp_path_factory.mktemp("kv_events_ipc")
    folder = tmp / "sockets"
    folder.mkdir(mode=0o700)
    pub, rep = f"ipc://{folder}/events", f"ipc://{folder}/replay"
    svc = pagedkv_process([*MEMORY_ARGS, "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
                           "--kv-events-topic", "kv"], tmp, "ipc")
    ctx = zmq.Context()
    driver = Driver(svc)
    sub = Subscriber(ctx, pub, b"kv")
    try:
        connected(driver, sub)
        a = driver.compute(PROMPT_A)  # 3 blocks stored
        driver.free(a)  # cached, evictable
        b = driver.compute(PROMPT_B, salt="")  # 15 blocks: evicts A's (removed), then 15 stored
        driver.free(b)
        driver.reset()  # AllBlocksCleared
        sub.receive_until(lambda s: s.batches and decode_batch(s.batches[max(s.batches)])[-1] == ("cleared",))
        yield svc, driver, ctx, sub, rep
    finally:
        sub.sock.close(linger=0)
        driver.channel.close()
        svc.stop()
        ctx.term()
        assert not list(folder.iterdir()), "closing the service removes its sockets"


def test_every_event_matches_the_grpc_stream_one_to_one(ipc_run):
    svc, driver, ctx, sub, rep = ipc_run
    assert svc.info["kv_events_endpoint"] == sub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    assert svc.info["kv_events_token_ids"] is True
    replayed = replay(ctx, rep, 0, b"kv")  # whatever the subscriber missed before it joined
    assert sorted(replayed) == list(range(len(replayed))), "batches are numbered 0, 1, 2, ... without a gap"
    assert all(replayed[seq] == payload for seq, payload in sub.batches.items()), "a replay resends the same bytes"
    events = [e for seq in sorted(replayed) for e in decode_batch(replayed[seq])]
    grpc_events = driver.grpc_events(len(events))
    assert [e.sequence_number for e in grpc_events] == list(range(1, len(events) + 1))
    assert events == [from_grpc(e) for e in grpc_events], "ZMQ event i is the log's event i + 1"

    kinds = [e[0] for e in events]
    first = kinds.index("stored")
    assert set(kinds[:first]) == {"cleared"}, "before the run: the resets that waited for the subscriber"
    a, b = router_hashes(PROMPT_A, SALT), router_hashes(PROMPT_B, "")
    stored_a = events[first:first + 3]
    assert stored_a == [("stored", (h,), p, tuple(PROMPT_A[i * BS:(i + 1) * BS]), BS, "GPU")
                        for i, (h, p) in enumerate(zip(a, [None, *a[:-1]]))], "the router's hashes, chained"
    removed = events[first + 3:kinds.index("stored", first + 3)]
    # B takes the 13 blocks without content first, then evicts A's cached blocks leaves first (LRU).
    assert removed == [("removed", (a[2],), "GPU"), ("removed", (a[1],), "GPU")]
    stored_b = events[first + 3 + len(removed):-1]
    assert [e[1][0] for e in stored_b] == b and [e[2] for e in stored_b] == [None, *b[:-1]]
    assert events[-1] == ("cleared",) and len(events) == first + 3 + 2 + 15 + 1


def test_a_late_subscriber_recovers_the_missed_range_through_replay(ipc_run):
    svc, driver, ctx, sub, rep = ipc_run
    before = replay(ctx, rep, 0, b"kv")
    last = max(before)
    late = Subscriber(ctx, svc.info["kv_events_endpoint"], b"kv")
    try:
        connected(driver, late)  # a reset (or a few) it sees live, after seq `last`
        joined = min(late.batches)
        assert joined > last, "it missed every batch before it joined"
        missed = replay(ctx, rep, 3, b"kv")
        assert sorted(missed) == list(range(3, max(missed) + 1)) and max(missed) >= joined, "from 3 on, no gap"
        assert {s: p for s, p in missed.items() if s <= last} == {s: p for s, p in before.items() if s >= 3}
        assert replay(ctx, rep, max(missed) + 100, b"kv") == {}, "past the head: only the end marker"
        # A request that is not vLLM's (two frames) is ignored; the socket still answers the next one.
        bad = ctx.socket(zmq.DEALER)
        bad.connect(rep)
        bad.send_multipart([b"", b"\x00" * 8, b"extra"])
        assert not bad.poll(300)
        bad.close(linger=0)
        assert sorted(replay(ctx, rep, last, b"kv"))[0] == last
    finally:
        late.sock.close(linger=0)


# ------------------------------------------------------------------------- tcp: who reads tokens
def one_prompt_over_tcp(tmp: Path, name: str, flags: list[str]) -> tuple[dict, list[tuple], Subscriber | None]:
    """A service on tcp://127.0.0.1:0 with ``flags``; prompt A computed; (ready info, events, a plain SUB)."""
    svc = pagedkv_process([*MEMORY_ARGS, "--kv-events-endpoint", "tcp://127.0.0.1:0", *flags], tmp, name)
    ctx = zmq.Context()
    driver = Driver(svc)
    key = None
    if "--kv-events-curve" in flags:
        key = zmq.auth.load_certificate(svc.info["kv_events_curve_public_key_file"])[0]
    sub = Subscriber(ctx, svc.info["kv_events_endpoint"], server_key=key)
    plain = Subscriber(ctx, svc.info["kv_events_endpoint"]) if key is not None else None
    try:
        connected(driver, sub)
        driver.compute(PROMPT_A)
        sub.receive_until(lambda s: sum(e[0] == "stored" for e in s.events()) == 3)
        if plain is not None:  # it joined with the other: what reached that one would have reached it by now
            assert not plain.sock.poll(500), "without the server's key: nothing"
        return svc.info, [e for e in sub.events() if e[0] == "stored"], plain
    finally:
        for s in (sub, plain):
            if s is not None:
                s.sock.close(linger=0)
        driver.channel.close()
        svc.stop()
        ctx.term()


@pytest.mark.parametrize("flags, token_ids", [([], False), (["--kv-events-insecure"], True),
                                              (["--kv-events-curve"], True)], ids=["plain", "insecure", "curve"])
def test_token_ids_leave_on_tcp_only_when_allowed(tmp_path, flags, token_ids):
    info, stored, _ = one_prompt_over_tcp(tmp_path, "tcp", flags)
    assert info["kv_events_token_ids"] is token_ids
    a = router_hashes(PROMPT_A, SALT)
    tokens = [tuple(PROMPT_A[i * BS:(i + 1) * BS]) if token_ids else () for i in range(3)]
    assert stored == [("stored", (h,), p, t, BS, "GPU") for h, p, t in zip(a, [None, *a[:-1]], tokens)]
    if "--kv-events-curve" in flags:
        folder = Path(info["admin_token_file"]).parent
        for f in ("kv-events.key", "kv-events.key_secret"):
            assert (folder / f).stat().st_mode & 0o777 == 0o600
        assert info["kv_events_curve_public_key_file"] == str(folder / "kv-events.key")
