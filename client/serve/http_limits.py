"""The HTTP server's own limits: how long a request may take to arrive, how many connections may be
open at once, and whose forwarded client addresses count.

``pagedkv serve`` speaks HTTP/1.1 through uvicorn's h11 protocol, always (not httptools, even where
it is installed; no WebSocket), extended here (:class:`LimitedH11Protocol`):

- **Header timeout** (``--http-header-timeout``, default 10 s): the whole request head (request
  line and headers) must arrive within that many seconds of the connection's start, or of the end
  of the previous response on a kept-alive connection. Past it the connection is closed, after a
  408 in the OpenAI error body when part of a head had arrived (silently when nothing had: an idle
  connection, which a client may be about to reuse).
- **Body timeout** (``--http-body-timeout``, default 30 s): from the end of the head to the end
  of the body. Past it the route sees the caller as gone (its ``receive()`` returns
  ``http.disconnect``: nothing was scheduled yet) and the caller gets a 408 and a closed connection.
  The time the route takes to answer is not limited (a long generation is no slow request).
- **Connections** (``--max-connections``, default 1024): a connection past the limit is answered
  503 with Retry-After at once and closed, before it can send anything, so slow or idle
  connections cannot pile up. uvicorn's own ``limit_concurrency`` does not fit: it answers 503
  only once a request head has arrived (a connection that sends none stays open), and counts the
  new connection itself, so its limit-th connection is already refused.
- **Forwarded headers** (``--forwarded-allow-ips``, default none): ``X-Forwarded-For`` and
  ``X-Forwarded-Proto`` are believed only from these proxy addresses or networks (uvicorn's
  ``ProxyHeadersMiddleware``); by default no one's, so the client address that the key throttle
  counts (client.serve.dashboard.auth) is the TCP peer's, whatever headers a caller sends. uvicorn's
  own default (proxy headers on, loopback trusted, or ``$FORWARDED_ALLOW_IPS``) is not used.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv import config
from pagedkv.runtime.logs import get_logger

log = get_logger("serve")

#: Defaults: seconds for the request head, seconds for the body, connections at once.
HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS = 10.0, 30.0, 1024
#: Seconds between two log lines about refused connections.
_REFUSAL_LOG_INTERVAL = 10.0


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The HTTP server's limits (module docstring)."""

    #: Seconds for a whole request head; seconds from the head to the end of its body.
    header_timeout: float = HEADER_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    #: Connections open at once; the next one gets 503.
    max_connections: int = MAX_CONNECTIONS
    #: Proxy addresses or networks whose X-Forwarded-For/-Proto count ("*": any); empty: none.
    forwarded_allow_ips: tuple[str, ...] = ()


def _env(name: str, *default):
    try:
        return config.env(f"PAGEDKV_{name}", *default)
    except ValueError as e:
        raise SystemExit(f"pagedkv serve: error: {e}") from None


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`HttpLimits` (defaults from the environment, read now)."""
    g = p.add_argument_group("HTTP limits")
    g.add_argument("--http-header-timeout", type=float, default=_env("HTTP_HEADER_TIMEOUT"), metavar="SECONDS",
                   help="a request's whole head must arrive within this many seconds of the connection's start "
                   "(or of the previous response's end), else the connection is closed, with a 408 when part "
                   f"of a head came (default {HEADER_TIMEOUT:g})")
    g.add_argument("--http-body-timeout", type=float, default=_env("HTTP_BODY_TIMEOUT"), metavar="SECONDS",
                   help="seconds from the end of a request's head to the end of its body, else 408 and the "
                   f"connection is closed (default {BODY_TIMEOUT:g})")
    g.add_argument("--max-connections", type=int, default=_env("MAX_CONNECTIONS"),
                   help="HTTP connections open at once; one more is answered 503 at once and closed "
                   f"(default {MAX_CONNECTIONS})")
    g.add_argument("--forwarded-allow-ips", default=config.env_text("PAGEDKV_FORWARDED_ALLOW_IPS"),
                   metavar="ADDR,NET,...",
                   help="proxies whose X-Forwarded-For and X-Forwarded-Proto are believed (addresses or networks, "
                   "comma-separated; '*': any peer, only when nothing but the proxy can reach this port). Default: "
                   "none, so the client address (the key throttle's) is the TCP peer's and a cookie is Secure "
                   "only over https to this server itself")


def parse_http_limits(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> HttpLimits:
    """The :class:`HttpLimits` of parsed ``args``; calls ``error`` (argparse's, which exits) on a
    timeout outside 0.1-3600 seconds, fewer than one connection or a malformed proxy address."""
    for flag, value in (("--http-header-timeout", args.http_header_timeout),
                        ("--http-body-timeout", args.http_body_timeout)):
        if not 0.1 <= value <= 3600:
            error(f"{flag} must lie in 0.1-3600 seconds")
    if args.max_connections < 1:
        error("--max-connections must be >= 1")
    proxies = tuple(a.strip() for a in (args.forwarded_allow_ips or "").split(",") if a.strip())
    for proxy in proxies:
        if proxy != "*":
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                error(f"--forwarded-allow-ips: {proxy!r} is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/8)")
    return HttpLimits(args.http_header_timeout, args.http_body_timeout, args.max_connections, proxies)


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` that apply ``limits``: the protocol, no WebSocket,
    and proxy headers only from the proxies named (explicitly, so ``$FORWARDED_ALLOW_IPS`` is not read)."""
    protocol = type("PagedkvH11Protocol", (LimitedH11Protocol,), {"limits": limits})
    proxies = limits.forwarded_allow_ips
    return {"http": protocol, "ws": "none", "proxy_headers": bool(proxies),
            "forwarded_allow_ips": "*" if "*" in proxies else list(proxies)}


def _raw_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode("latin-1") + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body timeouts and the connection limit of
    :attr:`limits` (set on a subclass by :func:`uvicorn_options`)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    #: time.monotonic() of the last log line about refused connections, and those refused since.
    _refusals: ClassVar[list[float]] = [float("-inf"), 0]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        #: Bytes of the awaited head have arrived (a 408 is then owed, not a silent close).
        self._head_started = False
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse_connection()
            return
        self._update_timers()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered already; read and dropped until the close, so the close is no reset
        if self.conn.their_state is h11.IDLE:
            self._head_started = True
        super().data_received(data)
        self._update_timers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._update_timers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _update_timers(self) -> None:
        """Arm the timer of the phase the request is in: its head, or its body; none otherwise."""
        if self.transport.is_closing():
            return
        theirs = self.conn.their_state
        if theirs is h11.IDLE and self.conn.our_state is h11.IDLE:
            if self._head_timer is None:
                self._head_started = bool(self.conn.trailing_data[0])  # a pipelined head already begun
                self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)
            return
        self._cancel_head_timer()
        if theirs is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)
        else:
            self._cancel_body_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_started:
            log.info("http_header_timeout", client=self.client[0] if self.client else "")
            self.transport.write(_raw_response(
                408, "Request Timeout", f"the request head did not arrive within {self.limits.header_timeout:g} s",
                "request_timeout"))
        self._close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if not cycle.response_started:
            log.info("http_body_timeout", client=self.client[0] if self.client else "", path=cycle.scope["path"])
            cycle.disconnected = True  # the route's receive() returns http.disconnect; its answer goes nowhere
            cycle.message_event.set()
            self.transport.write(_raw_response(
                408, "Request Timeout", f"the request body did not arrive within {self.limits.body_timeout:g} s "
                "of its head", "request_timeout"))
            self._close()
        elif cycle.response_complete:
            self._close()  # answered without its whole body (a refused key): nothing more to wait for
        # else a response streams while its request's body is still open: it goes on

    def _refuse_connection(self) -> None:
        self._refused = True
        self.connections.discard(self)  # not counted while it closes
        now, refusals = time.monotonic(), LimitedH11Protocol._refusals
        refusals[1] += 1
        if now - refusals[0] >= _REFUSAL_LOG_INTERVAL:
            log.warning("http_connections_refused", max_connections=self.limits.max_connections,
                        refused=refusals[1])
            refusals[:] = [now, 0]
        self.transport.write(_raw_response(
            503, "Service Unavailable", f"the server has {self.limits.max_connections} connections open, its most: "
            "try again", "too_many_connections", extra="retry-after: 1\r\n"))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # our side is done; the peer's close (or the timer) ends it
            self.loop.call_later(1.0, self.transport.close)
        else:
            self.transport.close()

    def _close(self) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()


__all__ = ["BODY_TIMEOUT", "HEADER_TIMEOUT", "MAX_CONNECTIONS", "HttpLimits", "LimitedH11Protocol",
           "add_http_limit_args", "parse_http_limits", "uvicorn_options"]
