"""Each worker's state in the dashboard's snapshot and in `pagedkv top`, from a real engine over a real
stack (conftest.stack: a memory service and two workers). The feed is the server's own
(client.serve.dashboard.feed) reading a Client's published stats; a worker drained with
Client.drain shows "draining" and the other "ready", and the running requests are counted on the
worker that holds them, as the engine pinned them.
"""

from __future__ import annotations

import io
import json
import time

from rich.console import Console

from client import Client, SamplingParams
from client.ops.top_view import render
from client.serve.dashboard.feed import DashboardFeed

PROMPTS = [[504, 3458, 282, 4649, 314] * 4, [25077, 4047, 22741, 42711] * 5]
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def _snapshot(feed: DashboardFeed, until=lambda snap: True, timeout: float = 60) -> dict:
    """The first snapshot the feed builds for which ``until`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        kind, _, text = feed.tick()
        assert kind == "snapshot", text
        snap = json.loads(text)
        if until(snap) or time.monotonic() > deadline:
            return snap
        time.sleep(0.05)


def _states(snap: dict) -> dict[str, str]:
    return {w["address"]: w["state"] for w in snap["workers"]}


def _top(snap: dict) -> tuple[str, dict[str, list[str]]]:
    """`pagedkv top`'s frame of ``snap``, and its workers table's cells after the address, by address."""
    console = Console(record=True, width=160, file=io.StringIO(), color_system=None)
    console.print(render(snap, console.width))
    text = console.export_text()
    rows = [[c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines()]
    return text, {r[0]: r[1:] for r in rows if r and r[0] in _states(snap)}


def test_a_drained_worker_is_draining_on_the_dashboard_and_in_top(stack):
    drained, other = stack.worker_addresses
    handles = []
    with Client(stack.memory.address, stack.worker_addresses) as client:
        feed = DashboardFeed(memory_address=stack.memory.address, tls=None, admin_token_file=None,
                             front=client.engine_stats, token_totals=lambda: (0.0, 0.0))
        try:
            snap = _snapshot(feed)
            assert [(w["address"], w["node"], w["state"], w["since"], w["requests"], w["failures"], w["restarts"])
                    for w in snap["workers"]] == [(a, "", "ready", None, 0, 0, 0) for a in (drained, other)]
            assert all(w["instance_id"] for w in snap["workers"])
            assert (snap["counters"]["workers_ready"], snap["counters"]["workers_total"]) == (2, 2)

            handles = [client.submit(p, LONG) for p in PROMPTS]
            deadline = time.monotonic() + 120
            while min(len(h.request.seqs[0].generated) for h in handles) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sorted(h.request.worker for h in handles) == [0, 1]  # least loaded: one on each
            before = time.time()
            reply = client.drain(drained)
            assert reply == {"worker": drained, "state": "draining", "moved_sequences": 1}
            snap = _snapshot(feed, lambda s: _states(s)[drained] == "draining")
            stats = client.engine_stats()
            assert _states(snap) == {drained: "draining", other: "ready"} == dict(stats.workers)
            workers = {w["address"]: w for w in snap["workers"]}
            # Both requests run on the other worker now, as the engine pinned them.
            assert {h.request.worker for h in handles} == {1} and not any(h.request.finished for h in handles)
            assert (workers[drained]["requests"], workers[drained]["sequences"]) == (0, 0)
            assert (workers[other]["requests"], workers[other]["sequences"]) == (2, 2)
            assert before - 1 <= workers[drained]["since"] <= snap["time"] and workers[other]["since"] is None
            c = snap["counters"]
            assert (c["workers_ready"], c["workers_total"], c["worker_failovers"]) == (1, 2, 0)
            assert 0 <= c["last_step_age_s"] < 60

            text, rows = _top(snap)
            assert rows[drained][:1] == ["draining"] and rows[other][:1] == ["ready"]
            assert rows[other][2:4] == ["2", "2"] and rows[drained][2:4] == ["0", "0"]
            assert "Workers: 1 of 2 ready, 0 failovers" in text

            assert client.undrain(drained)["state"] == "ready"
            snap = _snapshot(feed, lambda s: _states(s)[drained] == "ready")
            assert _states(snap) == {drained: "ready", other: "ready"}
            # Ready again since the undrain; drawn as such in top.
            assert snap["workers"][0]["since"] >= workers[drained]["since"]
            assert _top(snap)[1][drained][:1] == ["ready"]
        finally:
            for h in handles:
                h.cancel()
            feed.close()
