"""A second reader of the prefix cache's KV event log: vLLM's ZMQ publisher (``ZmqEventPublisher``,
``vllm/distributed/kv_events.py`` v0.32.0), for routers built for vLLM.

The log stays the one source of truth (:mod:`memory_service.prefix_cache`): the publisher is one
of its ``listeners``, so it gets every event in the log's order, at the moment it is logged, and
can never fall behind the log's window (no gap to name, unlike a gRPC cursor). On the event loop
it only puts the event on a queue (O(1), never blocks an allocation); its own thread takes what
is pending (at most :data:`MAX_BATCH_EVENTS` at a time), encodes one msgpack ``KVEventBatch``
(:mod:`memory_service.kv_events.wire`) and sends it on the PUB socket as vLLM does:

    frames: (topic, seq as 8-byte big-endian unsigned, payload)      seq = 0, 1, 2, ... per batch

so the i-th event of the flattened batches is event i + 1 of the log (the publisher starts with
the service and sends what the log already holds first). A PUB socket drops messages for a
subscriber that is slow or late (high-water mark :data:`SEND_HWM`); the subscriber sees the gap
in ``seq`` and asks the replay ROUTER socket, as vLLM's subscribers do:

    request:  (b"", start seq as 8 bytes big-endian)                  (from a DEALER socket)
    replies:  (b"", topic, seq, payload) for each kept batch with seq >= start, oldest first,
              then (b"", b"", -1 as 8-byte big-endian signed, b"")    the end of the replay

The replay keeps the newest batches holding at most ``max_events`` events (``--max-kv-events``,
the gRPC stream's window, so the same gap rule holds: a subscriber further behind sees its first
replayed ``seq`` past the one it asked for, never a silent hole). Both sockets are used by the
publisher's thread only; closing the publisher sends what is pending, then closes them.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from pathlib import Path

import zmq

from memory_service.kv_events.endpoints import CurveKeys, KvEventsSpec, load_curve_keys
from memory_service.kv_events.wire import BatchEncoder
from memory_service.prefix_cache import KvEvent, PrefixCache
from pagedkv.runtime.logs import get_logger

log = get_logger("kv_events")

#: Events in one batch at most (one ZMQ message stays bounded).
MAX_BATCH_EVENTS = 1024
#: Messages queued per subscriber before the PUB socket drops (vLLM's default high-water mark).
SEND_HWM = 100_000
#: Seconds between two looks at the replay socket while no event comes (vLLM: 0.1).
REPLAY_POLL_S = 0.1
#: The replay's end marker: -1 as 8 bytes big-endian signed (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Seconds closing waits for the thread to send what is pending.
CLOSE_TIMEOUT_S = 2.0

_STOP = object()


class ZmqKvEventPublisher:
    """Publishes a prefix cache's KV events on ZMQ in vLLM's wire format (module docstring).

    Args:
        spec: endpoints, topic, CURVE, whether token ids are sent (:class:`KvEventsSpec`).
        block_size: tokens per block (each ``BlockStored``'s ``block_size``).
        max_events: events the replay keeps at most (whole batches).
        curve: the CURVE key pair when ``spec.curve``.

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (in use, a bad address).
    """

    def __init__(self, spec: KvEventsSpec, block_size: int, max_events: int, curve: CurveKeys | None = None):
        assert spec.curve == (curve is not None), "CURVE needs its key pair"
        self.spec, self.max_events, self._curve = spec, max_events, curve
        self._encoder = BatchEncoder(block_size, spec.with_token_ids)
        self._topic = spec.topic.encode()
        self._ctx = zmq.Context()
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        #: (seq, payload, events) of the batches kept for replay, oldest first; their events in all.
        self._kept: deque[tuple[int, bytes, int]] = deque()
        self._kept_events = 0
        self._next_seq = 0
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._bind(zmq.PUB, spec.endpoint, curve)
            self._pub.set_hwm(SEND_HWM)
            #: The endpoints bound (a tcp port 0 resolved).
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if spec.replay_endpoint is not None:
                self._replay = self._bind(zmq.ROUTER, spec.replay_endpoint, curve)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._cache: PrefixCache | None = None

    def _bind(self, kind: int, endpoint: str, curve: CurveKeys | None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            sock.curve_server = True
            sock.curve_secretkey = curve.secret
            sock.curve_publickey = curve.public
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close()
            raise
        return sock

    def start(self, cache: PrefixCache) -> None:
        """Follow ``cache``'s log: the events it still holds, then each one logged (the sockets now
        belong to the thread). Called on the log's thread, so no event falls between the two."""
        assert self._cache is None, "a publisher follows one log"
        self._cache = cache
        for e in cache.events:
            self.offer(e)
        cache.listeners.append(self.offer)
        self._thread.start()
        log.info("kv_events_publishing", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                 topic=self.spec.topic, curve=self.spec.curve, token_ids=self.spec.with_token_ids)

    def offer(self, event: KvEvent) -> None:
        """The log's listener: queue ``event`` for the thread (on the event loop; never blocks)."""
        self._pending.put(event)

    def close(self) -> None:
        """Stop following the log, send what is pending, close the sockets. Idempotent."""
        if self._cache is not None and self.offer in self._cache.listeners:
            self._cache.listeners.remove(self.offer)
        if self._thread.is_alive():
            self._pending.put(_STOP)
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("kv_events_close_timeout", seconds=CLOSE_TIMEOUT_S)
                return  # the thread still owns the sockets; the process is ending
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (getattr(self, "_pub", None), self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        for bound in (getattr(self, "endpoint", None), getattr(self, "replay_endpoint", None)):
            if bound and bound.startswith("ipc://"):  # libzmq leaves the socket's file behind
                Path(bound[len("ipc://"):]).unlink(missing_ok=True)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        stopping = False
        while not stopping:
            if self._replay is not None:
                self._serve_replays()
            try:
                first = self._pending.get(timeout=REPLAY_POLL_S if self._replay is not None else None)
            except queue.Empty:
                continue
            batch: list[KvEvent] = []
            item = first
            while True:
                if item is _STOP:
                    stopping = True
                else:
                    batch.append(item)
                if stopping or len(batch) >= MAX_BATCH_EVENTS:
                    break
                try:
                    item = self._pending.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._publish(batch)
        while True:  # what was logged before the stop, if the stop overtook it
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                self._publish([item])

    def _publish(self, events: list[KvEvent]) -> None:
        try:
            payload = self._encoder.encode(events)
            seq = self._next_seq
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception as e:  # noqa: BLE001 - the thread must outlive one bad batch; the log says which
            log.error("kv_events_publish_failed", first=events[0].sequence_number, events=len(events), error=repr(e))
            return
        self._next_seq += 1
        self._kept.append((seq, payload, len(events)))
        self._kept_events += len(events)
        while len(self._kept) > 1 and self._kept_events > self.max_events:
            self._kept_events -= self._kept.popleft()[2]

    def _serve_replays(self) -> None:
        """Answer every replay request waiting on the ROUTER socket (vLLM's ``_service_replay``)."""
        while self._replay.poll(0):
            try:
                frames = self._replay.recv_multipart()
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    log.warning("kv_events_bad_replay_request", frames=len(frames))
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload, _ in list(self._kept):
                    if seq >= first:
                        self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as e:
                log.warning("kv_events_replay_failed", error=repr(e))

    def ready_info(self) -> dict:
        """What the memory service's ready file says of the publisher."""
        info = {"kv_events_endpoint": self.endpoint, "kv_events_replay_endpoint": self.replay_endpoint,
                "kv_events_token_ids": self.spec.with_token_ids}
        if self._curve is not None:
            info["kv_events_curve_public_key_file"] = str(self._curve.public_file)
        return info


def open_publisher(spec: KvEventsSpec, cache: PrefixCache, block_size: int, max_events: int,
                   key_folder: str) -> ZmqKvEventPublisher:
    """Bind ``spec``'s sockets (CURVE keys from ``key_folder``, the admin token file's) and follow ``cache``.

    Raises:
        OSError: an endpoint cannot be bound, or the key files cannot be made or read.
        ValueError: key files others may read, or not one pair.
    """
    curve = load_curve_keys(key_folder) if spec.curve else None
    try:
        publisher = ZmqKvEventPublisher(spec, block_size, max_events, curve)
    except zmq.ZMQError as e:
        raise OSError(f"--kv-events-endpoint {spec.endpoint} / --kv-events-replay-endpoint {spec.replay_endpoint}: "
                      f"cannot bind: {e}") from None
    publisher.start(cache)
    return publisher


__all__ = ["END_SEQ", "MAX_BATCH_EVENTS", "ZmqKvEventPublisher", "open_publisher"]
