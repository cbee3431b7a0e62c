"""The dashboard's feed: one poller for every viewer, snapshots pushed as server-sent events.

One thread (``pagedkv-dashboard``) ticks while at least one viewer is subscribed, and sleeps
otherwise. Each tick reads, on its own channel to the memory service (never the engine's):

    GetStats                          the pool's counters                 1 call
    ListSequences                     every lease's sequences (admin),    1 call per 1,000 sequences
                                      else this front's lease's
    the front's engine stats          its running and waiting requests,   the engine's last published
                                      lease and preemptions               snapshot, no call
    every node's engine stats         the workers and their states        the same, added up, no call

plus the cached block ids that a second thread follows from StreamKvEvents
(:class:`client.serve.dashboard.kv_follower.CachedBlocks`); builds one snapshot
(:mod:`client.serve.dashboard.snapshot`), serializes it once, and hands the same text to every
viewer's queue. A viewer's queue holds one item: a slow viewer skips snapshots, never delays the
feed. Ticks come every ``interval`` seconds (1.0 by default: one snapshot a second), and never take more
than a tenth of the time (after a tick of d seconds the next waits at least 9 d), so the feed's
load on the memory service stays bounded on a busy pool. The engine is never touched: the feed
reads the stats it publishes (client.engine.stats).

Credentials (docs/security.md): the admin calls need the memory service's admin token, which the
memory service writes at start (mode 0600) and ``pagedkv serve`` reads from
``--memory-admin-token-file`` (default: an embedded service's own file, else
``$PAGEDKV_ADMIN_TOKEN_FILE``, else ``$PAGEDKV_HOME/admin-token``), re-read when a call with it is
refused (a restarted service writes a fresh one). Without a readable token the feed lists only
the front's own lease, with the lease secret the engine's stats carry, and every snapshot says so
(``scope: "own lease"``): other leases are hidden, and the map shows only this front's blocks as
used. The KV events need no credential on loopback (and then carry no token ids); under TLS they
are read as the admin.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

from client.engine.stats import EngineStats
from client.errors import PermissionDenied, ServiceError, Unauthenticated
from client.serve.dashboard.kv_follower import CachedBlocks
from client.serve.dashboard.rates import History, Sample
from client.serve.dashboard.snapshot import build
from client.services import MemoryClient, read_admin_token
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.tls import TlsFiles

log = get_logger("dashboard")

#: Default seconds between snapshots.
DEFAULT_INTERVAL = 1.0
#: After a tick of d seconds the next waits at least this many times d (the feed's duty cycle <= 10%).
REST_FACTOR = 9.0


class DashboardFeed:
    """Snapshots of the pool and the front's requests, shared by every viewer.

    Args:
        memory_address: the memory service (``host:port``).
        tls: the scheduler's mutual-TLS files, or None (plaintext, loopback).
        admin_token_file: where the memory service's admin token is; None: no admin rights.
        front: returns the front's engine stats (client.engine.stats: its requests and lease).
        engines: returns every node's engine stats, added up (their workers); None: ``front``.
        token_totals: returns (prompt tokens, output tokens) the front served so far.
        interval: seconds between snapshots while someone watches.
    """

    def __init__(self, *, memory_address: str, tls: TlsFiles | None, admin_token_file: str | Path | None,
                 front: Callable[[], EngineStats], token_totals: Callable[[], tuple[float, float]],
                 interval: float = DEFAULT_INTERVAL, engines: Callable[[], EngineStats] | None = None):
        if interval <= 0:
            raise ValueError(f"the dashboard interval must be > 0 seconds, got {interval}")
        self.interval = interval
        self._front, self._token_totals, self._engines = front, token_totals, engines or front
        self._token_file = Path(admin_token_file) if admin_token_file else None
        self._memory = MemoryClient(memory_address, timeout=10, tls=tls)
        self._tls = tls
        self._token, self._token_note = self._read_token()
        #: The last token the memory service refused (not tried again until the file changes).
        self._refused: str | None = None
        self._cached: CachedBlocks | None = None
        self._history = History()
        self._seq = 0
        #: The last tick's cost in this process: (wall seconds, CPU seconds of the feed's thread).
        self.last_tick: tuple[float, float] = (0.0, 0.0)
        self._lock = threading.Lock()
        self._subs: dict[asyncio.Queue, asyncio.AbstractEventLoop] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ viewers
    def subscribe(self) -> asyncio.Queue:
        """A queue (on the running event loop) that receives each next snapshot as ``(event, id, json)``,
        and None when the feed closes; starts the feed on the first viewer."""
        q: asyncio.Queue = asyncio.Queue(maxsize=1)
        with self._lock:
            if self._stop.is_set():
                q.put_nowait(None)
                return q
            self._subs[q] = asyncio.get_running_loop()
            if self._thread is None:
                self._cached = CachedBlocks(self._open_events, retry=1.0).start()
                self._thread = threading.Thread(target=self._run, name="pagedkv-dashboard", daemon=True)
                self._thread.start()
        self._wake.set()
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._subs.pop(q, None)

    @property
    def viewers(self) -> int:
        with self._lock:
            return len(self._subs)

    def end_streams(self) -> None:
        """End every viewer's stream (each queue gets None) and stop ticking; returns at once."""
        self._stop.set()
        self._wake.set()
        self._publish(None)

    def close(self) -> None:
        """:meth:`end_streams`, then stop the threads and close the channel (waits for a tick in flight)."""
        self.end_streams()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._cached is not None:
            self._cached.close()
        self._memory.close()

    def _publish(self, item) -> None:
        if item is not None and self._stop.is_set():  # a tick that ended after end_streams: its None stays last
            return
        with self._lock:
            subs = list(self._subs.items())
        for q, loop in subs:
            try:
                loop.call_soon_threadsafe(_offer, q, item)
            except RuntimeError:  # its loop is closed: the viewer is gone
                self.unsubscribe(q)

    # ------------------------------------------------------------------ ticks
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.viewers:
                self._wake.clear()
                if not self.viewers:
                    self._wake.wait()
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                item = self.tick()
            except Exception as e:  # noqa: BLE001 - a bug in one tick must not end the feed for every viewer
                log.error("dashboard_tick_error", error=repr(e))
                item = "error", self._seq, json.dumps({"type": "error", "seq": self._seq, "time": round(time.time(), 3),
                                                       "message": f"the snapshot failed: {e!r}"})
            took = time.perf_counter() - t0
            self.last_tick = (took, time.thread_time() - c0)
            self._publish(item)
            self._stop.wait(max(self.interval - took, REST_FACTOR * took))

    def tick(self) -> tuple[str, int, str]:
        """Read and build one snapshot: ``("snapshot", seq, json)``, or ``("error", seq, json)`` when
        the memory service did not answer (the feed goes on)."""
        self._seq += 1
        now = time.time()
        try:
            snap = self._snapshot(now)
        except ServiceError as e:
            log.info("dashboard_tick_failed", error=str(e))
            return "error", self._seq, json.dumps({"type": "error", "seq": self._seq, "time": round(now, 3),
                                                   "message": f"the memory service did not answer: {e}"})
        return "snapshot", self._seq, json.dumps(snap, separators=(",", ":"))

    def _snapshot(self, now: float) -> dict:
        clock = time.monotonic()
        stats = self._memory.stats()
        front, engines = self._front(), self._engines()
        sequences, scope, note = self._list(front.lease_id, front.lease_secret)
        prompt, generated = self._token_totals()
        self._history.add(Sample(now, prompt, generated, stats.prefix_cache_queries, stats.prefix_cache_hits,
                                 stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0,
                                 front.preemptions))
        cached = self._cached.snapshot() if self._cached is not None else (set(), set(), False)
        return build(seq=self._seq, now=now, stats=stats, sequences=sequences, front=front, scope=scope,
                     scope_note=note, cached=cached, history=self._history, engines=engines, clock=clock,
                     feed={"interval_s": self.interval, "last_tick_ms": round(1e3 * self.last_tick[0], 3),
                           "last_tick_cpu_ms": round(1e3 * self.last_tick[1], 3)})

    def _list(self, lease_id: str, lease_secret: str) -> tuple[list, str, str]:
        """(sequences, scope, note): every lease's with the admin token, else the front's own."""
        if self._token is None:  # not there at start, or refused: the file may be (re)written since
            token, note = self._read_token()
            if token is not None and token != self._refused:
                self._token, self._token_note = token, note
        for _ in range(2):
            if self._token is None:
                break
            self._memory.admin_token = self._token
            try:
                return self._memory.sequences(), "all leases", self._token_note
            except (Unauthenticated, PermissionDenied) as e:
                self._refused = self._token
                token, note = self._read_token()
                self._token, self._token_note = (token, note) if token != self._refused else (
                    None, f"the memory service refused the admin token in {self._token_file}: {e.message}; "
                    "this front's lease only")
        self._memory.admin_token = None
        self._memory.add_lease(lease_id, lease_secret)
        return self._memory.sequences(lease_id), "own lease", self._token_note

    def _read_token(self) -> tuple[str | None, str]:
        if self._token_file is None:
            return None, "no admin token file is configured (--memory-admin-token-file): this front's lease only"
        try:
            token = read_admin_token(self._token_file)
        except OSError as e:
            return None, f"cannot read the admin token {self._token_file} ({e.strerror}): this front's lease only"
        if token is None:
            return None, f"no admin token at {self._token_file}: this front's lease only"
        return token, f"every lease, with the admin token in {self._token_file}"

    def _open_events(self, first: int):
        """StreamKvEvents from event ``first``: anonymous on loopback (no token ids sent), as the
        admin under TLS (where the stream needs the router or admin role)."""
        md = (("authorization", f"Bearer {self._token}"),) if self._tls is not None and self._token else ()
        return self._memory.stub.StreamKvEvents(mpb.StreamKvEventsRequest(from_sequence_number=first), metadata=md)


def _offer(q: asyncio.Queue, item) -> None:
    """Put ``item`` in a one-item queue, replacing what the viewer has not taken yet."""
    if q.full():
        q.get_nowait()
    q.put_nowait(item)


__all__ = ["DEFAULT_INTERVAL", "DashboardFeed"]
