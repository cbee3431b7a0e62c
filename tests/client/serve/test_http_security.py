"""`pagedkv serve`'s HTTP front against callers who guess keys, read others' metrics or hold
connections open: a real server process attached to the session's stack, with tenant keys, an
admin key, a metrics key, 1-second header and body timeouts and at most 4 connections.

The key throttle counts per client address, and every test here comes from loopback: a test that
sends wrong keys connects from an address of its own in 127.0.0.0/8, but for the forwarded-header
test, which needs 127.0.0.1 (the proxy address uvicorn would trust by default).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from conftest import pagedkv_process

from client.serve.dashboard.auth import MAX_FAILED_KEYS

KEY_A, ADMIN, METRICS = "key-tenant-a", "key-admin", "key-metrics"
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def server(stack, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-http")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY_A: "tenant-a"}))
    svc = pagedkv_process(["serve", "--memory", stack.memory.address, "--workers", stack.worker_addresses[0],
                           "--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--metrics-api-key", METRICS,
                           "--http-header-timeout", "1", "--http-body-timeout", "1",
                           "--max-connections", str(MAX_CONNECTIONS)], tmp, "serve-http")
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def url(server) -> str:
    return f"http://{server.address}"


def client_from(address: str) -> httpx.Client:
    """An HTTP client whose connections come from ``address`` (a loopback address of its own)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def read_until_closed(sock: socket.socket, timeout: float = 10) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    start, data = time.monotonic(), b""
    sock.settimeout(timeout)
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def test_rotating_forwarded_for_does_not_escape_the_login_throttle(url):
    # No --forwarded-allow-ips: X-Forwarded-For is nobody's word, 127.0.0.1's included.
    with client_from("127.0.0.1") as h:
        for i in range(MAX_FAILED_KEYS):
            r = h.post(f"{url}/dashboard/login", json={"key": "guess"}, headers={"X-Forwarded-For": f"203.0.113.{i}"})
            assert r.status_code == 401
        r = h.post(f"{url}/dashboard/login", json={"key": "guess"}, headers={"X-Forwarded-For": "198.51.100.7"})
        assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 60 and "set-cookie" not in r.headers
        r = h.post(f"{url}/dashboard/login", json={"key": ADMIN}, headers={"X-Forwarded-For": "198.51.100.8"})
        assert r.status_code == 200 and r.json()["ok"]  # the right key is never refused


def test_bearer_guesses_are_throttled_on_every_route_and_the_right_key_is_not(url):
    with client_from("127.0.0.3") as h:
        for _ in range(MAX_FAILED_KEYS):
            assert h.get(f"{url}/v1/models", headers=bearer("guess")).status_code == 401
        guesses = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                   ("GET", "/debug/steps"), ("POST", "/admin/workers/127.0.0.1%3A1/drain"), ("GET", "/metrics"),
                   ("GET", "/dashboard/snapshot")]
        for method, path in guesses:
            r = h.request(method, f"{url}{path}", headers=bearer("guess"), json={"prompt": "hi"})
            assert r.status_code == 429, (path, r.text)
            assert 0 < int(r.headers["retry-after"]) <= 60 and r.json()["error"]["type"] == "rate_limit_error"
        assert h.get(f"{url}/v1/models").status_code == 401  # a missing key is no guess: not throttled
        # Right after, from the same address, every right key is served at once.
        for path, key in (("/v1/models", KEY_A), ("/v1/models", ADMIN), ("/debug/steps", ADMIN),
                          ("/metrics", METRICS)):
            start = time.monotonic()
            r = h.get(f"{url}{path}", headers=bearer(key))
            assert r.status_code == 200 and time.monotonic() - start < 5, (path, r.text)
        r = h.post(f"{url}/v1/completions", headers=bearer(KEY_A), json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
    with client_from("127.0.0.4") as other:  # another address has its own count
        assert other.get(f"{url}/v1/models", headers=bearer("guess")).status_code == 401


def test_metrics_need_the_metrics_or_the_admin_key(url):
    with client_from("127.0.0.5") as h:
        r = h.get(f"{url}/metrics")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert h.get(f"{url}/metrics", headers=bearer(KEY_A)).status_code == 403  # a tenant reads no pool counters
        for key in (METRICS, ADMIN):
            r = h.get(f"{url}/metrics", headers=bearer(key))
            assert r.status_code == 200 and "pagedkv:prefix_cache_hits_total" in r.text
        assert h.get(f"{url}/v1/models", headers=bearer(METRICS)).status_code == 401  # it opens nothing else


def test_a_slow_request_head_is_cut_off_after_the_header_timeout(server, url):
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET /health HT")  # half a request line, then nothing
        data, took = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data and 0.8 < took < 5
    with socket.create_connection((host, int(port))) as s:  # nothing sent at all: closed without a word
        data, took = read_until_closed(s)
    assert data == b"" and 0.8 < took < 5
    with socket.create_connection((host, int(port))) as s:  # a head in pieces, within the timeout, is served
        s.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.3)
        s.sendall(b"Host: x\r\nConnection: close\r\n\r\n")
        data, _ = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200 ")


def test_a_stalled_body_is_cut_off_after_the_body_timeout(server, url):
    before = httpx.get(f"{url}/debug/steps", headers=bearer(ADMIN)).json()["step_count"]
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt".encode())  # 8 of 100 bytes
        data, took = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408 ") and b"request body" in data and 0.8 < took < 5
    assert httpx.get(f"{url}/debug/steps", headers=bearer(ADMIN)).json()["step_count"] == before  # nothing ran
    log = server.log()
    assert "http_body_timeout" in log and "request_failed" not in log and "Traceback" not in log


def test_connections_past_the_limit_are_answered_503_at_once(server, url):
    host, port = server.address.rsplit(":", 1)
    time.sleep(0.3)  # the earlier tests' connections are closed on the server's side too
    held = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection((host, int(port))) as s:
            data, took = read_until_closed(s)
        assert data.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in data.lower() and took < 0.9
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while (r := httpx.get(f"{url}/health")).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200


def test_http_flags_are_checked_at_start(monkeypatch, capsys):
    from client.serve.config import parse_args
    from client.serve.http_limits import HttpLimits, uvicorn_options

    assert parse_args([]).http_limits == HttpLimits(10.0, 30.0, 1024, ())
    options = uvicorn_options(parse_args([]).http_limits)
    assert options["proxy_headers"] is False and options["ws"] == "none"  # no one's X-Forwarded-For by default
    monkeypatch.setenv("PAGEDKV_FORWARDED_ALLOW_IPS", "10.0.0.5, 10.1.0.0/16")
    monkeypatch.setenv("PAGEDKV_HTTP_HEADER_TIMEOUT", "2.5")
    limits = parse_args([]).http_limits
    assert limits.forwarded_allow_ips == ("10.0.0.5", "10.1.0.0/16") and limits.header_timeout == 2.5
    options = uvicorn_options(limits)
    assert options["proxy_headers"] is True and options["forwarded_allow_ips"] == ["10.0.0.5", "10.1.0.0/16"]
    assert uvicorn_options(parse_args(["--forwarded-allow-ips", "*"]).http_limits)["forwarded_allow_ips"] == "*"
    refused = {("--forwarded-allow-ips", "proxy.local"): "not an IP address or network",
               ("--http-header-timeout", "0"): "--http-header-timeout must lie in 0.1-3600 seconds",
               ("--http-body-timeout", "1e9"): "--http-body-timeout must lie in 0.1-3600 seconds",
               ("--max-connections", "0"): "--max-connections must be >= 1",
               ("--api-key", "k", "--metrics-api-key", "k"): "also a tenant's API key"}
    for argv, message in refused.items():
        with pytest.raises(SystemExit) as e:
            parse_args(list(argv))
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert parse_args(["--metrics-api-key", "m"]).tenants.metrics_open is False  # given alone, it still closes /metrics
    assert parse_args(["--admin-api-key", "a"]).tenants.metrics_open is True  # no API keys: open, as vLLM's
