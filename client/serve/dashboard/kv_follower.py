"""Which blocks hold prefix-cache content, per tier, followed from the memory service's KV events.

:class:`CachedBlocks` subscribes to ``StreamKvEvents`` from event 1 (the memory service keeps the
last ``--max-kv-events``, 10,000 by default) and keeps two sets of block ids, device and host:
``BlockStored`` adds, ``BlockRemoved`` takes away, ``AllBlocksCleared`` empties both. The sets
are *complete* only when the replay began at event 1; when the service already dropped early
events (or this follower fell behind), it resubscribes from the oldest event kept, and the sets
miss the blocks stored before it and never touched since (:attr:`CachedBlocks.complete` is then
False, and the dashboard says its cached map is partial). A broken stream (the memory service
restarted: its events are numbered from 1 again) clears the sets and starts over from event 1.

One thread per follower, blocked on the stream: nothing is polled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc

from client.errors import from_rpc_error
from client.serve.dashboard.block_states import MEDIUM_DEVICE, MEDIUM_HOST
from pagedkv.runtime.logs import get_logger

log = get_logger("dashboard")


class CachedBlocks:
    """Block ids with cached content, per medium, from a KV event stream.

    Args:
        open_stream: ``open_stream(first)`` opens ``StreamKvEvents`` replaying from event number
            ``first`` (a cancellable gRPC stream call; credentials are the caller's).
        retry: seconds between a broken stream and the next subscription.
    """

    def __init__(self, open_stream: Callable[[int], Iterator], retry: float = 0.5):
        self._open = open_stream
        self._retry = retry
        self._lock = threading.Lock()
        self._device: set[int] = set()
        self._host: set[int] = set()
        #: Whether the sets were built from event 1 on (see the module).
        self.complete = False
        #: Events applied since the start (tests wait on it).
        self.applied = 0
        self._call = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="pagedkv-dashboard-kv", daemon=True)

    def start(self) -> CachedBlocks:
        self._thread.start()
        return self

    def snapshot(self) -> tuple[set[int], set[int], bool]:
        """(device block ids, host block ids, complete) now: copies."""
        with self._lock:
            return set(self._device), set(self._host), self.complete

    def close(self) -> None:
        """Stop following (the stream is cancelled)."""
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def _follow(self) -> None:
        first = 1
        while not self._stop.is_set():
            with self._lock:
                self._device.clear()
                self._host.clear()
                self.complete = first == 1
            try:
                self._call = self._open(first)
                for event in self._call:
                    self._apply(event)
                first = 1
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                err = from_rpc_error(e)
                oldest = err.metadata.get("oldest_retained")
                if err.code == grpc.StatusCode.FAILED_PRECONDITION and oldest:
                    first = int(oldest)  # the early events are gone: follow from the oldest kept, partially
                    log.info("kv_events_partial", first=first, error=err.message)
                    continue
                first = 1
                log.info("kv_stream_broken", code=err.code.name, error=err.message)
            self._stop.wait(self._retry)

    def _apply(self, event) -> None:
        kind = event.WhichOneof("event")
        with self._lock:
            if kind in ("block_stored", "block_removed"):
                e = getattr(event, kind)
                blocks = {MEDIUM_DEVICE: self._device, MEDIUM_HOST: self._host}.get(e.medium)
                if blocks is not None:  # the disk tier's slots are no block of either map
                    (blocks.add if kind == "block_stored" else blocks.discard)(e.block_id)
            elif kind == "all_cleared":
                self._device.clear()
                self._host.clear()
            self.applied += 1


__all__ = ["CachedBlocks"]
