"""The vLLM-format KV event publisher in process (memory_service/kv_events), and the flags that start it.

The publisher follows a real PrefixCache's log; what it sends is read with the independent decoder
(tests/helpers/vllm_kv_events.py). Bad ``--kv-events-*`` combinations are refused at start with
a message naming the flag, through the parser and spec that ``pagedkv memory`` uses, and once by
a real process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq
from conftest import pagedkv_process
from helpers.vllm_kv_events import Subscriber, decode_batch, replay, u64

from memory_service.block_pool import BlockPool
from memory_service.kv_events.endpoints import KvEventsSpec
from memory_service.kv_events.publisher import MAX_BATCH_EVENTS, ZmqKvEventPublisher
from memory_service.main import build_parser
from memory_service.prefix_cache import PrefixCache
from memory_service.spec import MemorySpec

BS = 4


@pytest.fixture
def folder(tmp_path) -> Path:
    f = tmp_path / "sockets"
    f.mkdir(mode=0o700)
    return f


@pytest.fixture
def publishing(folder):
    """(cache, publisher keeping at most 4 events for replay, subscriber, ZMQ context), on ipc://."""
    spec = KvEventsSpec(f"ipc://{folder}/pub", f"ipc://{folder}/replay", "t", curve=False, with_token_ids=True)
    publisher = ZmqKvEventPublisher(spec, BS, max_events=4)
    cache = PrefixCache(BlockPool(8, BS))
    publisher.start(cache)
    ctx = zmq.Context()
    sub = Subscriber(ctx, publisher.endpoint, b"t")

    def seen(s: Subscriber) -> bool:
        if not s.batches:
            cache.emit("cleared")
        return bool(s.batches)

    sub.receive_until(seen)
    yield cache, publisher, sub, ctx
    sub.sock.close(linger=0)
    publisher.close()
    ctx.term()
    assert not list(folder.iterdir()) and cache.listeners == [], "closed: sockets gone, the log no longer followed"


def test_media_are_named_and_replay_keeps_at_most_max_events(publishing):
    cache, publisher, sub, ctx = publishing
    h = [bytes([i]) * 32 for i in range(4)]
    logged = [("stored", dict(block_id=1, block_hash=h[1], parent_hash=h[0], token_ids=(1, 2, 3, 4), medium=1)),
              ("stored", dict(block_id=2, block_hash=h[2], token_ids=(5, 6, 7, 8), medium=3)),
              ("removed", dict(block_id=1, block_hash=h[1], medium=1)),
              ("removed", dict(block_id=2, block_hash=h[2], medium=3)),
              ("stored", dict(block_id=0, block_hash=h[3], parent_hash=h[2], token_ids=(9, 9, 9, 9), medium=0)),
              ("cleared", {})]
    for kind, fields in logged:  # one event a batch: each waits until the subscriber has the one before
        n = len(sub.batches)
        cache.emit(kind, **fields)
        sub.receive_until(lambda s, n=n: len(s.batches) > n)
    last = max(sub.batches)
    assert sorted(sub.batches) == list(range(min(sub.batches), last + 1)), "from the first it saw, no gap"
    assert sub.events()[-len(logged):] == [
        ("stored", (u64(h[1]),), u64(h[0]), (1, 2, 3, 4), BS, "CPU"),
        ("stored", (u64(h[2]),), None, (5, 6, 7, 8), BS, "DISK"),
        ("removed", (u64(h[1]),), "CPU"),
        ("removed", (u64(h[2]),), "DISK"),
        ("stored", (u64(h[3]),), u64(h[2]), (9, 9, 9, 9), BS, "GPU"),
        ("cleared",)]
    kept = replay(ctx, publisher.replay_endpoint, 0, b"t")
    assert sorted(kept) == list(range(last - 3, last + 1)), "the newest batches holding 4 events; the loss shows"
    assert kept == {seq: sub.batches[seq] for seq in kept}


def test_what_is_pending_goes_out_in_batches_in_order(publishing):
    cache, publisher, sub, _ = publishing
    first = max(sub.batches) + 1
    hashes = [i.to_bytes(32, "big") for i in range(1, 2501)]
    for i, h in enumerate(hashes):  # logged faster than sent: the thread batches what is pending
        cache.emit("removed", block_id=i % 8, block_hash=h)
    sub.receive_until(lambda s: sum(len(decode_batch(p)) for q, p in s.batches.items() if q >= first) == 2500)
    sizes = [len(decode_batch(sub.batches[q])) for q in sorted(sub.batches) if q >= first]
    assert sorted(sub.batches)[-len(sizes):] == list(range(first, first + len(sizes)))
    assert max(sizes) <= MAX_BATCH_EVENTS and len(sizes) >= 3
    assert [e for q in range(first, first + len(sizes)) for e in decode_batch(sub.batches[q])] == [
        ("removed", (int.from_bytes(h, "big"),), "GPU") for h in hashes]


# --------------------------------------------------------------------------------------- flags
def spec_of(*flags: str) -> KvEventsSpec | None:
    return MemorySpec.from_args(build_parser().parse_args(["--num-blocks", "16", *flags])).kv_events


def test_off_by_default_and_what_each_transport_sends(folder):
    assert spec_of() is None
    ipc = spec_of("--kv-events-endpoint", f"ipc://{folder}/e", "--kv-events-replay-endpoint", f"ipc://{folder}/r")
    assert (ipc.with_token_ids, ipc.curve, ipc.topic) == (True, False, "")
    assert spec_of("--kv-events-endpoint", "tcp://127.0.0.1:5557").with_token_ids is False
    assert spec_of("--kv-events-endpoint", "tcp://*:5557", "--kv-events-insecure").with_token_ids is True
    curve = spec_of("--kv-events-endpoint", "tcp://*:5557", "--kv-events-curve", "--kv-events-topic", "kv")
    assert (curve.with_token_ids, curve.curve, curve.topic) == (True, True, "kv")


@pytest.mark.parametrize("flags, message", [
    (["--kv-events-insecure"], "--kv-events-insecure needs --kv-events-endpoint"),
    (["--kv-events-replay-endpoint", "tcp://*:1", "--kv-events-topic", "x"],
     "--kv-events-replay-endpoint, --kv-events-topic need --kv-events-endpoint"),
    (["--kv-events-endpoint", "inproc://x"], "must be tcp://HOST:PORT or ipc://PATH"),
    (["--kv-events-endpoint", "tcp://*:1", "--kv-events-replay-endpoint", "ipc://{folder}/r"],
     "must use the transport of --kv-events-endpoint"),
    (["--kv-events-endpoint", "tcp://*:1", "--kv-events-replay-endpoint", "tcp://*:1"], "must differ"),
    (["--kv-events-endpoint", "tcp://*:1", "--kv-events-curve", "--kv-events-insecure"], "contradict each other"),
    (["--kv-events-endpoint", "ipc://{folder}/e", "--kv-events-insecure"], "--kv-events-insecure is for tcp://"),
    (["--kv-events-endpoint", "ipc://{folder}/e", "--kv-events-curve"], "--kv-events-curve is for tcp://"),
    (["--kv-events-endpoint", "ipc://@abstract"], "an abstract Unix socket has no permissions"),
    (["--kv-events-endpoint", "ipc://relative/e"], "give an absolute path"),
    (["--kv-events-endpoint", "ipc://{folder}/missing/e"], "does not exist"),
    (["--kv-events-endpoint", "ipc://{open}/e"], "has mode 0o755"),
    (["--kv-events-endpoint", "ipc://{link}/e"], "is not a directory"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_combinations_are_refused(folder, flags, message):
    (folder / "open").mkdir(mode=0o755)
    os.chmod(folder / "open", 0o755)
    (folder / "link").symlink_to(folder)
    names = {"folder": folder, "open": folder / "open", "link": folder / "link"}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        spec_of(*[f.format(**names) for f in flags])


def test_a_folder_of_another_uid_is_refused(folder, monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: os.lstat(folder).st_uid + 1)
    with pytest.raises(ValueError, match="is owned by uid"):
        spec_of("--kv-events-endpoint", f"ipc://{folder}/e")


def test_the_service_refuses_at_start_and_says_why(tmp_path):
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o755)
    with pytest.raises(RuntimeError, match="others could reach the socket") as exc:
        pagedkv_process(["memory", "--num-blocks", "16", "--kv-events-endpoint", f"ipc://{tmp_path}/open/e"],
                        tmp_path, "refused")
    assert "chmod 700" in str(exc.value)
