"""Prefix pins through `pagedkv serve`'s admin routes, and the "priority" scheduling policy, on real
processes: a small pool (40 blocks of 16 tokens), one worker, and a server with
``--scheduling-policy priority --max-num-seqs 1`` and two tenants.

Pins: a tenant's pinned prompt survives eviction pressure from another tenant (its blocks are
listed unchanged and its next request finds them cached), is listed by the memory service and in
GetStats, and once unpinned keeps its retention priority. Priority: with one request running, a
request of a lower priority value is admitted before the ones already queued.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import local_stack, pagedkv_process
from prometheus_client.parser import text_string_to_metric_families

from client.services import MemoryClient, read_admin_token

KEY_A, KEY_B, ADMIN = "key-tenant-a", "key-tenant-b", "key-admin"
BLOCK, NUM_BLOCKS = 16, 40
#: Tenant a's system prompt as token ids: 100 tokens, so 6 whole blocks before its last token.
SYSTEM = list(range(1000, 1100))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(stack, url, admin MemoryClient of the stack's memory service)."""
    tmp = tmp_path_factory.mktemp("pins")
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    with local_stack(tmp, ["--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK), "--lease-ttl", "30",
                           "--metrics-port", "0"],
                     num_workers=1, name="pins") as s:
        token_file = s.memory.info["admin_token_file"]
        svc = pagedkv_process(["serve", "--memory", s.memory.address, "--workers", s.worker_addresses[0],
                               "--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--memory-admin-token-file",
                               token_file, "--scheduling-policy", "priority", "--max-num-seqs", "1"], tmp, "serve")
        admin = MemoryClient(s.memory.address, admin_token=read_admin_token(token_file))
        try:
            yield s, f"http://{svc.address}", admin
        finally:
            admin.close()
            svc.stop()


def memory_metrics(stack) -> tuple[float, float, float]:
    """The memory service's (prefix pins, pinned blocks, retained blocks) gauges."""
    text = httpx.get(f"http://127.0.0.1:{stack.memory.info['metrics_port']}/metrics").text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return tuple(values[f"pagedkv:{n}"] for n in ("prefix_pins", "prefix_pinned_blocks", "retained_blocks"))


def post(url: str, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def complete(url: str, key: str, prompt: list[int], **extra) -> dict:
    r = post(url, "/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                      **extra}, key)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_pinned_prompt_survives_another_tenants_pressure_and_keeps_its_priority(served):
    stack, url, admin = served
    r = post(url, "/admin/pins", {"prompt": SYSTEM, "tenant": "tenant-a", "ttl_s": 600, "priority": 40})
    assert r.status_code == 200, r.text
    (pin,) = r.json()["pins"]
    assert r.json()["prompt_tokens"] == 100
    assert (pin["num_tokens"], pin["num_blocks"], pin["priority"], pin["label"]) == (96, 6, 40, "tenant:tenant-a")
    assert 590 < pin["expires_in_seconds"] <= 600
    listed = {p.pin_id: p for p in admin.list_pins()}
    block_ids = list(listed[pin["id"]].block_ids)
    assert len(block_ids) == 6 and listed[pin["id"]].priority == 40
    got = httpx.get(f"{url}/admin/pins", headers={"Authorization": f"Bearer {ADMIN}"}).json()["pins"]
    assert [p["id"] for p in got] == [pin["id"]]
    assert admin.stats().pins.num_pins == 1 and admin.stats().pins.pinned_blocks == 6
    assert memory_metrics(stack)[:2] == (1, 6)

    # Tenant b fills the pool several times over: 6 prompts of 10 blocks each, 34 blocks free of pins.
    evictions = admin.stats().prefix_cache_evictions
    for i in range(6):
        complete(url, KEY_B, [5000 + 200 * i + t for t in range(150)])
    assert admin.stats().prefix_cache_evictions - evictions >= 20
    assert list({p.pin_id: p for p in admin.list_pins()}[pin["id"]].block_ids) == block_ids
    # Tenant a's request finds the whole pinned prefix; tenant b's, with the same tokens, nothing of it.
    a = complete(url, KEY_A, [*SYSTEM, 7, 8, 9])
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    b = complete(url, KEY_B, [*SYSTEM, 7, 8, 9])
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    admin_key = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.delete(f"{url}/admin/pins/{pin['id']}", headers=admin_key)
    assert r.status_code == 200 and r.json() == {"id": pin["id"], "num_blocks": 6}, r.text
    assert httpx.delete(f"{url}/admin/pins/{pin['id']}", headers=admin_key).status_code == 404
    stats = admin.stats().pins
    assert (stats.num_pins, stats.pinned_blocks) == (0, 0) and stats.retained_blocks >= 6
    assert memory_metrics(stack) == (0, 0, stats.retained_blocks)
    admin.check_invariants()


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": SYSTEM, "tenant": "tenant-a", "ttl_s": 0}, 400, "ttl_s"),
    ({"prompt": SYSTEM, "tenant": "tenant-a", "ttl_s": 60, "priority": 101}, 400, "priority"),
    ({"prompt": SYSTEM, "tenant": "tenant-a", "ttl_s": "10"}, 400, "ttl_s"),
    ({"prompt": SYSTEM, "tenant": "tenant-a", "ttl_s": True}, 400, "ttl_s"),
    ({"prompt": SYSTEM, "messages": [{"role": "user", "content": "x"}], "tenant": "tenant-a", "ttl_s": 60}, 400,
     "messages"),
    ({"prompt": SYSTEM, "tenant": "tenant-z", "ttl_s": 60}, 404, "tenant"),
    ({"prompt": SYSTEM, "group": "no-such-group", "ttl_s": 60}, 404, "group"),
    ({"prompt": SYSTEM, "ttl_s": 60}, 400, "tenant"),
    ({"prompt": SYSTEM[:16], "tenant": "tenant-a", "ttl_s": 60}, 400, "prompt"),
    ({"prompt": SYSTEM, "tenant": "tenant-a", "ttl_s": 60, "pinned": True}, 400, "pinned"),
])
def test_bad_pin_requests_are_refused_and_pin_nothing(served, body, status, param):
    _, url, admin = served
    before = admin.stats().pins.num_pins
    r = post(url, "/admin/pins", body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert admin.stats().pins.num_pins == before


def test_pin_routes_need_the_admin_key(served):
    _, url, _ = served
    assert post(url, "/admin/pins", {"prompt": SYSTEM, "tenant": "tenant-a", "ttl_s": 60}, KEY_A).status_code == 403
    assert httpx.get(f"{url}/admin/pins", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 403


def gauge(url: str, name: str) -> float:
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"no {name} in /metrics")


def test_a_more_urgent_request_is_admitted_before_queued_ones(served):
    _, url, _ = served
    replies: dict[str, dict] = {}

    def send(name: str, priority: int, max_tokens: int, first_token: int) -> threading.Thread:
        def run():
            replies[name] = complete(url, KEY_B, [first_token, 11, 12, 13], max_tokens=max_tokens, ignore_eos=True,
                                     priority=priority)
        t = threading.Thread(target=run)
        t.start()
        return t

    def until(check, what: str) -> None:
        deadline = time.monotonic() + 120
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    running, queued = "pagedkv:num_requests_running", "pagedkv:num_requests_waiting"
    threads = [send("first", 5, 160, 301)]
    until(lambda: gauge(url, running) == 1, "the first request to run")
    threads.append(send("low-1", 5, 4, 302))  # one at a time: equal priorities keep their arrival order
    until(lambda: gauge(url, queued) == 1, "one queued request")
    threads.append(send("low-2", 5, 4, 303))
    until(lambda: gauge(url, queued) == 2, "two queued requests")
    threads.append(send("urgent", -1, 4, 304))
    for t in threads:
        t.join(timeout=300)
    assert sorted(replies) == ["first", "low-1", "low-2", "urgent"]
    order = _first_scheduled(url, {name: r["id"] for name, r in replies.items()})
    assert order == ["first", "urgent", "low-1", "low-2"], order
    r = post(url, "/v1/completions", {"model": "smollm2", "prompt": [1, 2], "max_tokens": 1, "priority": 2**31},
             KEY_B)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def _steps(url: str) -> list[dict]:
    r = httpx.get(f"{url}/debug/steps", headers={"Authorization": f"Bearer {ADMIN}"})
    return r.json()["steps"]


def _first_scheduled(url: str, ids: dict[str, str]) -> list[str]:
    """The requests named in ``ids`` (name -> request id) in the order of their first step."""
    first: dict[str, int] = {}
    for step in _steps(url):
        for name, rid in ids.items():
            if rid in step["request_ids"]:
                first.setdefault(name, step["step"])
    return sorted(first, key=first.get)
