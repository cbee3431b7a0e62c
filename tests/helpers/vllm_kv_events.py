"""A subscriber of vLLM-format KV events written from vLLM 0.32's published schema
(``vllm/distributed/kv_events.py``), independent of the publisher's code: payloads decoded with
``msgpack`` (not msgspec structs), the PUB frames and the replay protocol spelled out here.

    sub = Subscriber(ctx, endpoint, b"topic")       # keeps every (seq, payload) it receives
    sub.receive_until(lambda s: len(s.batches) >= 3)
    replay(ctx, replay_endpoint, 0, b"topic")      # {seq: payload} of the batches kept, from 0
"""

from __future__ import annotations

import time

import msgpack
import zmq

#: The replay's end marker: seq -1 as 8 bytes big-endian signed.
END_SEQ = b"\xff" * 8

#: Every field of vLLM 0.32's BlockStored and BlockRemoved, in its order (the first 7 of BlockStored
#: have no default, so msgspec always sends them; the others only when not at their default).
STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                 "ownership", "session_id"]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality", "ownership"]
MEDIA = {0: "GPU", 1: "CPU", 3: "DISK"}  # pagedkv.grant.v1.Medium -> the documented medium strings


def decode_batch(payload: bytes) -> list[tuple]:
    """One ``KVEventBatch`` payload as (kind, hashes, parent, token ids, block size, medium) tuples."""
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch  # [ts, events, data_parallel_rank]
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 3600 and rank == 0
    out = []
    for e in events:
        kind = e.pop("type")
        if kind == "BlockStored":
            assert list(e) == [f for f in STORED_FIELDS if f in e], "vLLM's fields, in its order, nothing else"
            assert set(STORED_FIELDS[:7]) <= set(e), "fields without a default are always sent"
            assert (e["lora_id"], e["lora_name"], e["group_idx"]) == (None, None, 0) and "extra_keys" not in e
            out.append(("stored", tuple(e["block_hashes"]), e["parent_block_hash"], tuple(e["token_ids"]),
                        e["block_size"], e["medium"]))
        elif kind == "BlockRemoved":
            assert list(e) == [f for f in REMOVED_FIELDS if f in e] and e["group_idx"] == 0
            out.append(("removed", tuple(e["block_hashes"]), e["medium"]))
        else:
            assert (kind, e) == ("AllBlocksCleared", {})
            out.append(("cleared",))
    return out


def u64(block_hash: bytes) -> int:
    """The documented integer of a chained hash: big-endian, modulo 2^64 (vLLM's int block hashes)."""
    return int.from_bytes(block_hash, "big") % 2**64


class Subscriber:
    """A SUB socket keeping every (seq, payload) it receives."""

    def __init__(self, ctx: zmq.Context, endpoint: str, topic: bytes = b"", server_key: bytes | None = None):
        self.sock = ctx.socket(zmq.SUB)
        if server_key is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
            self.sock.curve_serverkey = server_key
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.topic, self.batches = topic, {}

    def receive_until(self, done, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, f"gave up; received seq {sorted(self.batches)}"
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == self.topic and len(seq) == 8
                self.batches[int.from_bytes(seq, "big")] = payload

    def events(self) -> list[tuple]:
        return [e for seq in sorted(self.batches) for e in decode_batch(self.batches[seq])]


def replay(ctx: zmq.Context, endpoint: str, start: int, topic: bytes) -> dict[int, bytes]:
    """vLLM's replay protocol: send the start seq (8 bytes big-endian) to the ROUTER socket, read
    (topic, seq, payload) frames until the end marker (seq -1)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = {}
        while True:
            assert sock.poll(20_000), "no answer from the replay socket"
            empty, t, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (t, payload) == (b"", b"")
                return got
            assert t == topic
            got[int.from_bytes(seq, "big")] = payload
    finally:
        sock.close(linger=0)


__all__ = ["END_SEQ", "MEDIA", "Subscriber", "decode_batch", "replay", "u64"]
