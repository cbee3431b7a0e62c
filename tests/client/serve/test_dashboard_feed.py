"""The dashboard's feed on a real `pagedkv serve` (its own small stack, so the KV events replay from
event 1), its login, and `pagedkv top --once`; plus the pure pieces (block map encoding, sessions).

Every figure is compared with what the memory service answers directly (ListSequences, GetStats
read with the admin token), never with a time.
"""

from __future__ import annotations

import io
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import DASHBOARD_ADMIN_KEY, streamed_request
from rich.console import Console

from client.serve.dashboard.auth import COOKIE, KeyThrottle, Sessions, login_key, same_key
from client.serve.dashboard.block_states import CACHED, FREE, USED, encode, pool_map, runs, unruns
from client.services import MemoryClient, read_admin_token

ADMIN = DASHBOARD_ADMIN_KEY
BLOCK = 16
#: 37 prompt tokens: two full blocks and 5 tokens in a third (not a multiple of the block size).
PROMPT = [504, 3458, 282, 4649, 314] * 7 + [504, 3458]
SHARED = len(PROMPT) // BLOCK


@pytest.fixture(scope="module")
def backends(dashboard_server):
    """A small pool (96 blocks of 16 tokens) and one worker (conftest.dashboard_server)."""
    return dashboard_server[0]


@pytest.fixture(scope="module")
def admin(backends):
    m = MemoryClient(backends.memory.address, admin_token=read_admin_token(backends.memory.info["admin_token_file"]))
    yield m
    m.close()


@pytest.fixture(scope="module")
def url(dashboard_server):
    return dashboard_server[1]


def test_a_caller_hanging_up_mid_body_is_no_server_error(dashboard_server):
    _, url, serve = dashboard_server
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for path in ("/dashboard/login", "/v1/completions"):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 100\r\n\r\n{{\"key".encode())  # 5 of the 100 bytes promised
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while serve.log().count("client_disconnected") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = serve.log()
    assert log.count("client_disconnected") == 2 and "request_failed" not in log and "Traceback" not in log
    assert httpx.get(f"{url}/health").status_code == 200


def snapshot(url: str, **kw) -> dict:
    r = httpx.get(f"{url}/dashboard/snapshot", timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def as_admin() -> dict:
    return {"headers": {"Authorization": f"Bearer {ADMIN}"}}


# ---------------------------------------------------------------- pure pieces
def test_block_map_states_refcounts_and_runs():
    class Info:
        def __init__(self, ids, refs, media=()):
            self.block_ids, self.ref_counts, self.media = ids, refs, media

    seqs = [Info([3, 4, 7], [2, 2, 1]), Info([3, 4, 8], [2, 2, 1]), Info([1, 2], [1, 1], [1, 1])]
    pm = pool_map(10, seqs, cached={3, 5, 9})
    assert pm.state.tolist() == [FREE, FREE, FREE, USED, USED, CACHED, FREE, USED, USED, CACHED]
    assert pm.refcount.tolist() == [0, 0, 0, 2, 2, 0, 0, 1, 1, 0]
    assert pm.counts() == {"free": 4, "used": 4, "cached": 2}
    sent = encode(pm)
    assert sent["encoding"] == "blocks" and sent["state_runs"] == [0, 3, 1, 2, 2, 1, 0, 1, 1, 2, 2, 1]
    assert unruns(sent["state_runs"]) == pm.state.tolist() and unruns(sent["refcount_runs"]) == pm.refcount.tolist()
    host = pool_map(4, seqs, cached={0}, medium=1)
    assert host.state.tolist() == [CACHED, USED, USED, FREE]
    # A table across both tiers (a swap-in under way): each entry goes to its own tier's map.
    mixed = [Info([6, 3], [1, 2], [0, 1])]
    assert pool_map(10, mixed, cached=()).refcount.tolist() == [0] * 6 + [1] + [0] * 3
    assert pool_map(4, mixed, cached=(), medium=1).refcount.tolist() == [0, 0, 0, 2]
    assert runs(np.zeros(0, dtype=np.uint8)) == []


def test_a_big_pool_is_sent_as_cells():
    pm = pool_map(10_000, [], cached=range(5000, 5010))
    pm.state[:300], pm.refcount[:300] = USED, 1
    pm.refcount[0] = 4
    sent = encode(pm)
    assert sent["encoding"] == "cells" and sent["blocks_per_cell"] == 3
    cells = sent["cells"]
    assert len(cells["used"]) == 3334 and sum(cells["used"]) == 300 and sum(cells["cached"]) == 10
    assert sum(cells["free"]) == 10_000 - 310 and cells["max_refcount"][0] == 4 and cells["used"][99:101] == [3, 0]


def test_sessions_and_login_bodies():
    now = [0.0]
    sessions = Sessions(ttl=10, max_sessions=2, clock=lambda: now[0])
    a, b = sessions.create(), sessions.create()
    assert sessions.valid(a) and sessions.valid(b) and not sessions.valid("x") and not sessions.valid(None)
    c = sessions.create()  # the third ends the oldest
    assert not sessions.valid(a) and sessions.valid(c)
    assert sessions.end(c) and not sessions.valid(c) and not sessions.end(c)
    now[0] = 11.0
    assert not sessions.valid(b) and len(sessions) == 0
    assert login_key(b'{"key": "k"}', "application/json") == "k"
    assert login_key(b"key=k%20x", "application/x-www-form-urlencoded") == "k x"
    assert login_key(b"key=a&key=b", "application/x-www-form-urlencoded") is None
    assert login_key(b'["k"]', "application/json") is None and login_key(b"key=k", "text/plain") is None
    assert same_key("k", "k") and not same_key("k", "kk") and not same_key(None, "k")
    assert login_key(b"[" * 3000, "application/json") is None  # nested too deeply: refused, not raised
    assert login_key(b'{"key": "  k "}', "application/json") == "k" and login_key(b"key=+", "") is None


def test_wrong_keys_are_throttled_per_address():
    now = [0.0]
    throttle = KeyThrottle(max_failures=3, window=60, max_clients=2, clock=lambda: now[0])
    for t in (0, 10, 20):
        now[0] = t
        assert throttle.retry_after("a") == 0
        throttle.failed("a")
    assert throttle.retry_after("a") == 40 and throttle.retry_after("b") == 0  # until the first failure is 60 s old
    now[0] = 60.5
    assert throttle.retry_after("a") == 0  # one failure left the window
    throttle.failed("a")
    assert throttle.retry_after("a") == 9.5
    throttle.failed("b")
    throttle.failed("c")  # a third address: the one seen least recently ("a") is dropped
    assert throttle.retry_after("a") == 0
    # refuse(): the first max_failures wrong keys are answered as usual (0), the next get a Retry-After, and
    # each is counted, so an address that keeps guessing stays throttled.
    now[0] = 100.0
    assert [throttle.refuse("d") for _ in range(3)] == [0, 0, 0]
    now[0] = 130.0
    assert throttle.refuse("d") == 30  # counted: the window now starts at its second failure, still at 100
    now[0] = 159.0
    assert throttle.refuse("d") == 1 and throttle.refuse("d") == 31  # the last at 100 left; then 130 is oldest


# ---------------------------------------------------------------- on a real server
def test_the_feed_needs_the_operator(url):
    for kw in ({}, {"headers": {"Authorization": "Bearer wrong"}}, {"headers": {"Cookie": f"{COOKIE}=made-up"}}):
        for path in ("events", "snapshot"):
            r = httpx.get(f"{url}/dashboard/{path}", **kw)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, kw)
    with httpx.Client(base_url=url) as browser:
        for body in ({"json": {"key": "wrong"}}, {"data": {"key": ADMIN + "x"}}, {"json": {}},
                     {"content": b"[" * 2000, "headers": {"Content-Type": "application/json"}}):  # nested too deeply
            r = browser.post("/dashboard/login", **body)
            assert r.status_code == 401 and "set-cookie" not in r.headers and not browser.cookies
        assert browser.get("/dashboard/snapshot").status_code == 401
        r = browser.post("/dashboard/login", json={"key": f" {ADMIN}  "})  # trimmed, as the Bearer header's key
        assert r.status_code == 200 and r.json()["ok"]
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie.replace(
            "Strict", "strict") and "Path=/dashboard" in cookie
        token = browser.cookies[COOKIE]
        assert snapshot(url, headers={"Cookie": f"{COOKIE}={token}"})["type"] == "snapshot"
        with browser.stream("GET", "/dashboard/events") as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            lines = events.iter_lines()
            assert next(lines) == "retry: 2000"
            assert next(lines) == ""
            assert next(lines).startswith("id: ")
            assert next(lines) == "event: snapshot"
            assert next(lines).startswith('data: {"type":"snapshot","version":1,')
            r = browser.post("/dashboard/logout")
            assert r.status_code == 200 and f'{COOKIE}=""' in r.headers["set-cookie"]
            # The open stream ends with its session: at most the snapshots already on their way follow.
            after = 0
            for line in lines:
                after += line.startswith("data: ")
                assert after <= 2, "the event stream outlived its session"
    assert httpx.get(f"{url}/dashboard/snapshot",
                     headers={"Cookie": f"{COOKIE}={token}"}).status_code == 401  # the session ended
    r = httpx.post(f"{url}/dashboard/login", data={"key": ADMIN}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard" and COOKIE in r.headers["set-cookie"]
    r = httpx.head(f"{url}/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and r.content == b""


def _tables(rows) -> dict[int, tuple[list[int], list[int]]]:
    return {s["seq_id"] if isinstance(s, dict) else s.seq_id:
            (list(s["block_ids"] if isinstance(s, dict) else s.block_ids),
             list(s["ref_counts"] if isinstance(s, dict) else s.ref_counts)) for s in rows}


def test_three_samples_share_their_prompt_blocks_then_free_them(url, admin):
    body = {"prompt": [PROMPT], "n": 3, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0, "seed": 3,
            "stream": True}
    with streamed_request(url, body):
        deadline, match = time.monotonic() + 240, None
        while match is None and time.monotonic() < deadline:
            snap = snapshot(url, **as_admin())
            listed = admin.sequences()
            running = snap["requests"]["running"]
            if len(running) != 1 or len(running[0]["sequences"]) != 3:
                continue
            mine = running[0]["sequences"]
            # Each sample computed past the prompt: its first write after the fork happened.
            if any(s["ref_counts"] is None or s["num_computed"] <= len(PROMPT) for s in mine):
                continue
            if _tables(mine) == _tables(listed):  # no step moved a table between the two reads
                match = snap, running[0], listed
        assert match is not None, "no snapshot of the three samples equal to ListSequences"
    snap, request, listed = match
    assert request["n"] == 3 and request["prompt_tokens"] == len(PROMPT) and request["status"] == "running"
    tables = [s["block_ids"] for s in request["sequences"]]
    refs = [s["ref_counts"] for s in request["sequences"]]
    # The prompt's full blocks are one set of blocks with refcount 3; the block holding the prompt's
    # last tokens was copied on write, so each sample has its own from there on.
    assert tables[0][:SHARED] == tables[1][:SHARED] == tables[2][:SHARED]
    assert all(r[:SHARED] == [3] * SHARED for r in refs)
    tails = [t[SHARED:] for t in tables]
    assert all(r[SHARED:] == [1] * len(t) for r, t in zip(refs, tails))
    assert len({b for t in tails for b in t}) == sum(len(t) for t in tails)  # distinct across the samples
    # The block map agrees with the tables: exactly their blocks are used, with their refcounts.
    states, refcounts = unruns(snap["pool"]["state_runs"]), unruns(snap["pool"]["refcount_runs"])
    in_tables = {b: r for t, rs in zip(tables, refs) for b, r in zip(t, rs)}
    assert {b for b, s in enumerate(states) if s == USED} == set(in_tables)
    assert all(refcounts[b] == r for b, r in in_tables.items())
    assert snap["pool"]["total_blocks"] == len(states) == 96 and snap["scope"] == "all leases"

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (admin.stats().used_blocks or snap["requests"]["running"]):
        snap = snapshot(url, **as_admin())
    stats = admin.stats()
    assert stats.used_blocks == 0 and snap["requests"] == {"running": [], "waiting": []}
    assert USED not in unruns(snap["pool"]["state_runs"]) and set(unruns(snap["pool"]["refcount_runs"])) == {0}
    # Idle, the map's counts are GetStats' own (the KV events were followed from event 1).
    assert snap["pool"]["counts"] == {"free": stats.free_blocks, "used": 0, "cached": stats.cached_blocks}
    assert snap["pool"]["exact"] and stats.cached_blocks >= SHARED
    assert snap["stats"]["total_blocks"] == 96 and snap["leases"] == []
    # The feed reports its own cost: the interval it was started with, the previous tick's time.
    assert snap["feed"]["interval_s"] == 0.2 and 0 < snap["feed"]["last_tick_cpu_ms"]
    assert snap["feed"]["last_tick_cpu_ms"] <= snap["feed"]["last_tick_ms"] * 1.05 + 1  # one thread: CPU <= wall


def test_top_once_draws_getstats_numbers(url, admin, backends):
    from client.ops.top import main as top

    deadline = time.monotonic() + 60
    while admin.stats().used_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    before = admin.stats()
    console = Console(record=True, width=160, file=io.StringIO(), color_system=None)
    assert top(["--url", url, "--key", ADMIN, "--once"], console=console) == 0
    assert admin.stats() == before  # idle: nothing moved while the frame was read
    text = console.export_text()
    (row,) = [line for line in text.splitlines() if line.startswith("│") and "%" in line]
    cells = [c.strip() for c in row.strip("│").split("│")]
    hit = f"{before.prefix_cache_hits / before.prefix_cache_queries:.1%}" if before.prefix_cache_queries else "n/a"
    assert cells[:8] == [str(before.total_blocks), str(before.used_blocks), str(before.cached_blocks),
                         str(before.free_blocks), f"{before.used_blocks / before.total_blocks:.1%}", hit,
                         str(before.num_sequences), str(before.num_leases)]
    grid = text.split("KV-cache pool")[1]
    assert grid.count("▒") >= before.cached_blocks and "█" not in grid.split("(one character")[0]
    # The server's one worker, ready and idle: no request, sequence, failure or restart (one engine: no node column).
    (worker,) = [line for line in text.splitlines() if backends.worker_addresses[0] in line]
    cells = [c.strip() for c in worker.strip("│").split("│")]
    assert cells[:2] == [backends.worker_addresses[0], "ready"] and cells[3:] == ["0"] * 5
    assert "Workers: 1 of 1 ready, 0 failovers, last step" in text
    assert top(["--url", url, "--key", "wrong", "--once"], console=console) == 1
    assert "HTTP 401" in console.export_text()


def test_without_the_admin_token_the_feed_lists_its_own_lease(tmp_path):
    import grpc

    from client.errors import Unauthenticated
    from client.serve.dashboard.feed import DashboardFeed

    class Memory:  # what the feed calls on its MemoryClient
        def __init__(self):
            self.admin_token, self.calls, self.good = None, [], "fresh"

        def add_lease(self, lease_id, secret):
            self.calls.append(("secret", lease_id, secret))

        def sequences(self, lease_id=None):
            self.calls.append(("list", lease_id, self.admin_token))
            if lease_id is None and self.admin_token != self.good:
                raise Unauthenticated(grpc.StatusCode.UNAUTHENTICATED, "not the admin token")
            return []

    from client.engine.stats import EngineStats

    front = EngineStats(lease_id="L", lease_secret="S")
    token = tmp_path / "admin-token"
    feed = DashboardFeed(memory_address="127.0.0.1:1", tls=None, admin_token_file=token, front=lambda: front,
                         token_totals=lambda: (0.0, 0.0))
    feed._memory.close()
    feed._memory = memory = Memory()
    _, scope, note = feed._list("L", "S")
    assert scope == "own lease" and "no admin token at" in note and memory.calls == [("secret", "L", "S"),
                                                                                        ("list", "L", None)]
    token.write_text("stale\n")
    memory.calls.clear()
    _, scope, note = feed._list("L", "S")
    assert scope == "own lease" and "refused the admin token" in note
    assert memory.calls == [("list", None, "stale"), ("secret", "L", "S"), ("list", "L", None)]
    memory.calls.clear()
    feed._list("L", "S")  # the refused token is not tried again until the file changes
    assert memory.calls == [("secret", "L", "S"), ("list", "L", None)]
    token.write_text("fresh\n")
    memory.calls.clear()
    _, scope, note = feed._list("L", "S")
    assert scope == "all leases" and str(token) in note and memory.calls == [("list", None, "fresh")]


async def test_one_feed_serves_every_viewer_and_rests_unwatched():
    import asyncio
    import json

    from client.serve.dashboard.feed import DashboardFeed
    from pagedkv.memory.v1 import memory_service_pb2 as mpb

    class Stream:  # a KV event stream with no events, until cancelled
        def __init__(self):
            self.done = threading.Event()

        def __iter__(self):
            self.done.wait()
            return iter(())

        def cancel(self):
            self.done.set()

    class Memory:
        admin_token = None

        def __init__(self):
            self.ticks = 0
            self.stub = type("Stub", (), {"StreamKvEvents": lambda _, req, metadata: Stream()})()

        def stats(self):
            self.ticks += 1
            return mpb.GetStatsResponse(total_blocks=8, free_blocks=8, block_size=16)

        def add_lease(self, lease_id, secret):
            pass

        def sequences(self, lease_id=None):
            return []

        def close(self):
            pass

    from client.engine.stats import EngineStats

    front = EngineStats(lease_id="L", lease_secret="S")
    feed = DashboardFeed(memory_address="127.0.0.1:1", tls=None, admin_token_file=None, front=lambda: front,
                         token_totals=lambda: (0.0, 0.0), interval=0.05)
    feed._memory.close()
    feed._memory = memory = Memory()
    assert memory.ticks == 0  # nobody watches yet: nothing is read
    viewers = [feed.subscribe(), feed.subscribe()]
    first = [await asyncio.wait_for(q.get(), 30) for q in viewers]
    assert first[0] is first[1] and first[0][0] == "snapshot"  # one read, one serialization, for both
    snap = json.loads(first[0][2])
    assert snap["pool"]["state_runs"] == [0, 8] and snap["scope"] == "own lease" and snap["leases"] == []
    for q in viewers:
        feed.unsubscribe(q)
    await asyncio.sleep(0.5)  # a tick in flight when the last viewer left ends
    rested = memory.ticks
    await asyncio.sleep(0.5)
    assert memory.ticks == rested
    again = feed.subscribe()
    assert (await asyncio.wait_for(again.get(), 30))[1] > first[0][1]
    await asyncio.to_thread(feed.close)
    assert await asyncio.wait_for(again.get(), 30) is None  # the end replaces a snapshot not yet taken
    assert await feed.subscribe().get() is None
