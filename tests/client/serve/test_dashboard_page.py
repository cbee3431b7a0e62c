"""The dashboard page (GET /dashboard) in headless Chromium, driven by selenium, against a real
`pagedkv serve` on CPU (conftest.dashboard_server: SmolLM2, 96 blocks of 16 tokens).

What the page draws is compared with what the memory service answers directly (ListSequences and
GetStats read with its admin token): block ids, refcounts, states and counts, never a time.
A screenshot taken while three samples run is saved under ``$PAGEDKV_TEST_ARTIFACTS`` (default
``test-artifacts/``).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import httpx
import pytest
from conftest import DASHBOARD_ADMIN_KEY, ROOT, START_TIMEOUT, pagedkv_process, streamed_request
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from client.ops.stack import LocalStack
from client.serve.dashboard.auth import COOKIE, MAX_FAILED_KEYS
from client.serve.dashboard.block_states import MAX_CELLS
from client.services import MemoryClient, read_admin_token

BLOCK = 16
#: 37 prompt tokens: two full blocks and 5 tokens in a third (not a multiple of the block size).
PROMPT = [504, 3458, 282, 4649, 314] * 7 + [504, 3458]
SHARED = len(PROMPT) // BLOCK
sys.path.insert(0, str(ROOT / "scripts"))
import headless_chromium  # noqa: E402 - scripts/ is not a package
from headless_chromium import chromium  # noqa: E402

ARTIFACTS = Path(os.environ.get("PAGEDKV_TEST_ARTIFACTS") or ROOT / "test-artifacts")

#: What the page draws, read in one script: the grid's cells and every request row's block table.
READ_PAGE = """
const grid = document.getElementById('grid');
const cells = [...grid.children].map(c => [c.dataset.state, +c.dataset.refcount, c.classList.contains('sel'),
                                           c.textContent]);
const rows = [...document.querySelectorAll('#requests tbody tr[data-request]')].map(r => ({
  request: r.dataset.request, seq: r.dataset.seq === '' ? null : +r.dataset.seq, status: r.dataset.status,
  blocks: [...r.querySelectorAll('.blk')].map(b => +b.dataset.block),
  refs: [...r.querySelectorAll('.blk')].map(b => b.dataset.refcount === '' ? null : +b.dataset.refcount)}));
const counters = Object.fromEntries([...document.querySelectorAll('#counters .card')].map(
  c => [c.dataset.counter, c.querySelector('.value').textContent]));
return {seq: +document.body.dataset.seq, encoding: grid.dataset.encoding, cells, rows, counters,
        board: !document.getElementById('board').hidden, login: !document.getElementById('login').hidden,
        login_error: document.getElementById('login-error').textContent, cookie: document.cookie};
"""


@pytest.fixture(scope="module")
def browser():
    d = chromium()  # no skip: a missing Chromium fails here, naming scripts/install_browser.sh
    yield d
    d.quit()


@pytest.fixture(scope="module")
def admin(dashboard_server):
    stack = dashboard_server[0]
    m = MemoryClient(stack.memory.address, admin_token=read_admin_token(stack.memory.info["admin_token_file"]))
    yield m
    m.close()


def read(browser) -> dict:
    return browser.execute_script(READ_PAGE)


def wait_for(browser, check, timeout: float = 60, message: str = ""):
    """The first truthy ``check(read(browser))``, polled; fails with ``message`` after ``timeout`` s."""
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(lambda d: check(read(d)), message)


def script_errors(browser) -> list[str]:
    """The page's script errors (network 401s of the first paint are expected and not listed)."""
    return [e["message"] for e in browser.get_log("browser") if e["source"] == "javascript"]


def log_in(browser, url: str, key: str = DASHBOARD_ADMIN_KEY) -> None:
    """Log in through the page's form; the caller waits for what should follow."""
    headless_chromium.log_in(browser, url, key, wait=False)


def on_board(browser, url: str) -> dict:
    """The page of ``url`` logged in and drawing (logs in when it is not); returns what it draws."""
    if not browser.current_url.startswith(f"{url}/dashboard") or not read(browser)["board"]:
        log_in(browser, url)
    return wait_for(browser, lambda p: p["board"] and p["seq"] > 0 and p, message="the board")


def test_the_page_asks_for_the_key_and_keeps_its_cookie_from_scripts(browser, dashboard_server):
    url = dashboard_server[1]
    browser.delete_all_cookies()
    log_in(browser, url, "not-the-key")
    page = wait_for(browser, lambda p: p["login_error"] and p, message="the refusal")
    assert "wrong or missing admin API key" in page["login_error"] and not page["board"]
    assert browser.get_cookies() == []
    log_in(browser, url)
    page = wait_for(browser, lambda p: p["board"] and p["seq"] > 0 and p, message="the board after login")
    (cookie,) = browser.get_cookies()
    assert cookie["name"] == COOKIE and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/dashboard" and page["cookie"] == ""  # no script can read the session
    headers = httpx.get(f"{url}/dashboard").headers
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-content-type-options"] == "nosniff"
    assert script_errors(browser) == []


def test_three_samples_share_prompt_blocks_on_the_page(browser, dashboard_server, admin):
    stack, url, _ = dashboard_server
    on_board(browser, url)
    total = admin.stats().total_blocks
    assert len(wait_for(browser, lambda p: p["board"] and p["cells"])) == total == 96  # one cell per block

    body = {"prompt": [PROMPT], "n": 3, "max_tokens": 400, "ignore_eos": True, "temperature": 1.0, "seed": 5,
            "stream": True}
    with streamed_request(url, body):
        def drawn_as_listed(page):
            """The page's three rows once every sample wrote past the fork, when they equal
            ListSequences read right after (no step moved a table in between)."""
            rows = [r for r in page["rows"] if r["status"] == "running" and r["seq"] is not None]
            if len(rows) != 3 or any(len(r["blocks"]) <= SHARED for r in rows):
                return None
            tails = [r["blocks"][SHARED] for r in rows]
            if len(set(tails)) != 3:  # the block of the prompt's last tokens not yet copied on write by all
                return None
            listed = {s.seq_id: (list(s.block_ids), list(s.ref_counts)) for s in admin.sequences()}
            if {r["seq"]: (r["blocks"], r["refs"]) for r in rows} != listed:
                return None
            return page, rows

        page, rows = wait_for(browser, drawn_as_listed, timeout=240,
                              message="three rows on the page equal to ListSequences")
        assert len({r["request"] for r in rows}) == 1
        # Shared prompt blocks: the same ids in each row, drawn with refcount 3.
        assert rows[0]["blocks"][:SHARED] == rows[1]["blocks"][:SHARED] == rows[2]["blocks"][:SHARED]
        assert all(r["refs"][:SHARED] == [3] * SHARED for r in rows)
        # Copy-on-write tails: distinct across the rows, refcount 1.
        tails = [b for r in rows for b in r["blocks"][SHARED:]]
        assert len(set(tails)) == len(tails)
        assert all(r["refs"][SHARED:] == [1] * (len(r["refs"]) - SHARED) for r in rows)
        # The grid: exactly the tables' blocks used, the shared ones marked with their refcount.
        in_tables = {b: rc for r in rows for b, rc in zip(r["blocks"], r["refs"])}
        cells = page["cells"]
        assert {b for b, c in enumerate(cells) if c[0] == "used"} == set(in_tables)
        assert all(cells[b][1] == rc and cells[b][3] == (str(rc) if rc > 1 else "") for b, rc in in_tables.items())

        # Selecting the request outlines its blocks on the grid.
        browser.find_element(By.CSS_SELECTOR, f"#requests tr[data-seq='{rows[0]['seq']}']").click()
        page = wait_for(
            browser, lambda p: any(c[2] for c in p["cells"]) and p, message="the selected request's blocks outlined"
        )
        selected = {b for b, c in enumerate(page["cells"]) if c[2]}
        # Its tables only grow while it runs: every block seen above, and only used blocks.
        assert set(in_tables) <= selected <= {b for b, c in enumerate(page["cells"]) if c[0] == "used"}
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))

    # Finished: no block drawn as used, the counters are GetStats' own.
    def idle(page):
        stats = admin.stats()
        if stats.used_blocks or any(c[0] == "used" for c in page["cells"]) or page["rows"]:
            return None
        cards = read(browser)["counters"]
        return stats if cards["used_blocks"] == "0" and cards["cached_blocks"] == str(stats.cached_blocks) else None

    stats = wait_for(browser, idle, timeout=120, message="the page idle after the request")
    page = read(browser)
    assert len(page["cells"]) == stats.total_blocks == 96
    assert sum(c[0] == "cached" for c in page["cells"]) == stats.cached_blocks >= SHARED
    assert sum(c[0] == "free" for c in page["cells"]) == stats.free_blocks
    assert page["counters"]["total_blocks"] == "96" and page["counters"]["free_blocks"] == str(stats.free_blocks)
    assert (
        page["counters"]["kv_cache_dtype"]
        == f"{stats.kv_cache_dtype} · {stats.token_capacity:,} tokens"
        == "float32 · 1,536 tokens"
    )
    assert script_errors(browser) == []


def test_another_lease_is_drawn_as_lease_rows(browser, dashboard_server, admin):
    stack, url, _ = dashboard_server
    on_board(browser, url)
    other = MemoryClient(stack.memory.address)
    lease = other.create_lease(ttl=60).lease_id
    try:
        listed = {s.seq_id: list(s.block_ids) for s in other.allocate(lease, [40, 20]).sequences}
        assert sorted(len(b) for b in listed.values()) == [2, 3]  # 40 and 20 tokens in blocks of 16

        def lease_rows(page):
            rows = [r for r in page["rows"] if r["request"] == f"lease:{lease}"]
            return (page, rows) if len(rows) == 2 else None

        page, rows = wait_for(browser, lease_rows, message="the other lease's two rows")
        assert {r["seq"]: r["blocks"] for r in rows} == listed
        assert all(r["status"] == "lease" and r["refs"] == [1] * len(r["blocks"]) for r in rows)
        assert all(page["cells"][b][:2] == ["used", 1] for blocks in listed.values() for b in blocks)
    finally:
        other.release_lease(lease)
        other.close()
    page = wait_for(
        browser,
        lambda p: not any(r["request"].startswith("lease:") for r in p["rows"]) and p,
        message="the lease's rows gone after its release",
    )
    assert all(page["cells"][b][0] != "used" for blocks in listed.values() for b in blocks)


#: What the workers panel draws: a row per worker with its state badge, and the panel's note.
READ_WORKERS = """
const box = document.getElementById('workers');
return {shown: !box.hidden, nodes: !box.classList.contains('no-nodes'),
        note: document.getElementById('workers-note').textContent,
        rows: [...box.querySelectorAll('tbody tr')].map(r => ({worker: r.dataset.worker, state: r.dataset.state,
          badge: r.querySelector('.badge').textContent, cells: [...r.children].map(c => c.textContent)}))};
"""


def test_the_workers_panel_draws_a_drained_worker_as_draining(browser, dashboard_server):
    stack, url, _ = dashboard_server
    on_board(browser, url)
    (worker,) = stack.worker_addresses
    admin = {"Authorization": f"Bearer {DASHBOARD_ADMIN_KEY}"}

    def workers(check, message):
        return WebDriverWait(browser, 60, poll_frequency=0.1).until(
            lambda d: (w := d.execute_script(READ_WORKERS))["rows"] and check(w) and w, message)

    page = workers(lambda w: True, "the workers panel")
    assert page["shown"] and not page["nodes"]  # one engine: no node column
    assert [(r["worker"], r["state"], r["badge"]) for r in page["rows"]] == [(worker, "ready", "ready")]
    r = httpx.post(f"{url}/admin/workers/{worker}/drain", headers=admin, timeout=60)
    try:
        assert r.status_code == 200 and r.json()["state"] == "draining"
        page = workers(lambda w: w["rows"][0]["state"] == "draining", "the worker drawn as draining")
        (row,) = page["rows"]
        assert row["badge"] == "draining" and row["cells"][3].startswith("for ")
        assert page["note"].startswith("0 of 1 ready")
    finally:
        r = httpx.post(f"{url}/admin/workers/{worker}/undrain", headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "ready"
    page = workers(lambda w: w["rows"][0]["state"] == "ready", "the worker drawn as ready again")
    assert page["rows"][0]["badge"] == "ready" and page["note"].startswith("1 of 1 ready")
    assert script_errors(browser) == []


@pytest.fixture(scope="module")
def big_pool(tmp_path_factory, tiny_model):
    """`pagedkv serve` over a tiny random Llama with 10,000 blocks of 4 tokens (above MAX_CELLS)."""
    run = tmp_path_factory.mktemp("dashboard-big")
    with LocalStack(
        [
            "--num-blocks",
            "10000",
            "--block-size",
            "4",
            "--lease-ttl",
            "30",
            "--admin-token-file",
            str(run / "big.admin-token"),
        ],
        model=str(tiny_model[0]),
        run_dir=run,
        name="big",
        cwd=ROOT,
        timeout=START_TIMEOUT,
    ) as s:
        svc = pagedkv_process(
            [
                "serve",
                "--memory",
                s.memory.address,
                "--workers",
                s.worker_addresses[0],
                "--admin-api-key",
                DASHBOARD_ADMIN_KEY,
                "--memory-admin-token-file",
                s.memory.info["admin_token_file"],
                "--dashboard-interval",
                "0.2",
            ],
            run,
            "serve",
            timeout=START_TIMEOUT,
        )
        admin = MemoryClient(s.memory.address, admin_token=read_admin_token(s.memory.info["admin_token_file"]))
        try:
            yield f"http://{svc.address}", admin
        finally:
            admin.close()
            svc.stop()


def test_a_pool_above_the_threshold_draws_as_a_heat_map(browser, big_pool):
    url, admin = big_pool
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": [[1, 25077, 4047, 22741, 42711, 40640] * 5],
            "n": 2,
            "max_tokens": 40,
            "ignore_eos": True,
            "temperature": 1.0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    stats = admin.stats()
    assert stats.total_blocks == 10_000 > MAX_CELLS and stats.used_blocks == 0 and stats.cached_blocks > 0
    browser.delete_all_cookies()
    log_in(browser, url)
    page = wait_for(browser, lambda p: p["board"] and p["encoding"] and p, message="the heat map")
    per = math.ceil(stats.total_blocks / MAX_CELLS)
    assert page["encoding"] == "cells" and len(page["cells"]) == math.ceil(stats.total_blocks / per) == 3334
    script = """
        const cells = [...document.getElementById('grid').children];
        const sum = k => cells.reduce((a, c) => a + +c.dataset[k], 0);
        return {used: sum('used'), cached: sum('cached'), free: sum('free'),
                first: cells.map(c => +c.dataset.first), colored: cells.filter(c => c.style.background).length};"""
    # The feed learns cached blocks from the memory service's event stream, which may still be a tick
    # behind the request's end: the map settles on GetStats' counts within a few snapshots.
    counts = WebDriverWait(browser, 30, poll_frequency=0.2).until(
        lambda d: (c := d.execute_script(script))["cached"] == stats.cached_blocks and c,
        "the heat map's cached blocks settling on GetStats' count",
    )
    assert counts["used"] == 0 and counts["cached"] == stats.cached_blocks
    assert counts["free"] == stats.free_blocks and counts["first"] == list(range(0, stats.total_blocks, per))
    assert counts["colored"] == len(page["cells"])
    assert script_errors(browser) == []


def test_failed_logins_are_throttled_and_the_right_key_still_works(big_pool):
    url, _ = big_pool  # its own server: the throttle counts per address, and every test comes from loopback
    for _ in range(MAX_FAILED_KEYS):
        assert httpx.post(f"{url}/dashboard/login", json={"key": "guess"}).status_code == 401
    r = httpx.post(f"{url}/dashboard/login", json={"key": "guess"})
    assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 60 and "set-cookie" not in r.headers
    assert r.json()["error"]["type"] == "rate_limit_error"
    # One throttle for logins and Bearer keys: a wrong Bearer key from the address is past the limit too.
    r = httpx.get(f"{url}/dashboard/snapshot", headers={"Authorization": "Bearer guess"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    # The right key is never refused, by form or by header.
    r = httpx.post(f"{url}/dashboard/login", json={"key": DASHBOARD_ADMIN_KEY})
    assert r.status_code == 200 and COOKIE in r.headers["set-cookie"]
    r = httpx.get(f"{url}/dashboard/snapshot", headers={"Authorization": f"Bearer {DASHBOARD_ADMIN_KEY}"}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "snapshot"
