"""Who may watch the dashboard: the operator (``--admin-api-key``), by cookie or by header.

A browser's EventSource cannot send an Authorization header, so the page logs in once:
``POST /dashboard/login`` with the admin key (a form field ``key`` or JSON ``{"key": ...}``)
creates a session, a random 256-bit token kept server-side (its SHA-256 only) for
:data:`SESSION_SECONDS`, and sets it as the cookie :data:`COOKIE` (HttpOnly: no script reads it;
SameSite=Strict: no other site's page sends it; Path=/dashboard; Secure when the request came
over https). A wrong key gets 401 and changes nothing: no cookie, no session. Logout ends the
session and clears the cookie. Sessions live in the server's memory, so a restart logs everyone
out; at most :data:`MAX_SESSIONS` live at once (the oldest goes first).

Programs (``pagedkv top``, curl) send ``Authorization: Bearer <admin key>`` instead. Keys are
compared in constant time (HMAC-style, over their SHA-256 digests, so the length leaks nothing),
after trimming surrounding white space, as the Bearer header's key is.

Refused keys are throttled per client address (:class:`KeyThrottle`, one for the whole server:
failed logins here, and wrong ``Authorization: Bearer`` keys on every route that checks keys).
Past :data:`MAX_FAILED_KEYS` in :data:`FAILED_KEY_WINDOW` seconds, each further wrong key is
answered 429 with Retry-After (and counted, so an address that keeps guessing stays throttled)
instead of 401/403, and the log gets at most that many refusals per client and window. A right key
is never delayed or refused: guesses from an address that others share (a proxy, a NAT, loopback)
cannot lock its callers out. The client address is the TCP peer's, or the one a trusted proxy
forwarded (``--forwarded-allow-ips``: client.serve.http_limits).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from urllib.parse import parse_qs

#: The session cookie's name.
COOKIE = "pagedkv_dashboard"
#: Seconds a session lives after login.
SESSION_SECONDS = 12 * 3600
#: Most sessions at once; a new login past it ends the oldest.
MAX_SESSIONS = 64
#: Largest login body read, bytes.
MAX_LOGIN_BYTES = 4096
#: Refused keys (logins and Bearer keys) one client address may send per window, and the window, seconds.
MAX_FAILED_KEYS, FAILED_KEY_WINDOW = 10, 60.0
#: Client addresses the throttle tracks at most (the oldest go first).
MAX_THROTTLED_CLIENTS = 4096


def same_key(given: str | None, expected: str | None) -> bool:
    """Whether ``given`` equals ``expected``, in time independent of where they differ (and of length)."""
    if given is None or expected is None:
        return False
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


def login_key(body: bytes, content_type: str) -> str | None:
    """The key a login sent: JSON ``{"key": "..."}`` or a form field ``key``; None when absent or malformed."""
    if len(body) > MAX_LOGIN_BYTES:
        return None
    kind = content_type.split(";", 1)[0].strip().lower()
    try:
        if kind == "application/json":
            value = json.loads(body or b"null")
            value = value.get("key") if isinstance(value, dict) else None
        elif kind in ("application/x-www-form-urlencoded", ""):
            values = parse_qs(body.decode(), keep_blank_values=True).get("key", [])
            value = values[0] if len(values) == 1 else None
        else:
            return None
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: JSON nested too deeply
        return None
    value = value.strip() if isinstance(value, str) else None
    return value or None


class KeyThrottle:
    """Refused keys per client address over a sliding window (module docstring).

    Args:
        max_failures: refusals a client may get in ``window`` seconds before its wrong keys get 429.
        window: seconds a refusal counts.
        max_clients: addresses tracked at most; past it the one seen least recently is dropped.
        clock: seconds, monotonic.
    """

    def __init__(self, max_failures: int = MAX_FAILED_KEYS, window: float = FAILED_KEY_WINDOW,
                 max_clients: int = MAX_THROTTLED_CLIENTS, clock: Callable[[], float] = time.monotonic):
        self.max_failures, self.window, self.max_clients, self._clock = max_failures, window, max_clients, clock
        self._failures: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def refuse(self, client: str) -> float:
        """Count a wrong key of ``client``; returns 0 when it is to be answered as usual (401/403), else
        the seconds its Retry-After gives (it is past the limit: answer 429)."""
        throttled = self.retry_after(client) > 0
        self.failed(client)
        return max(self.retry_after(client), 1e-3) if throttled else 0.0

    def retry_after(self, client: str) -> float:
        """Seconds until a wrong key of ``client`` is answered as usual again; 0 when it is now."""
        times = self._recent(client)
        if times is None or len(times) < self.max_failures:
            return 0.0
        return max(0.0, times[0] + self.window - self._clock())

    def failed(self, client: str) -> None:
        """Count a refused key (or failed login) of ``client``."""
        times = self._recent(client)
        if times is None:
            times = self._failures[client] = collections.deque(maxlen=self.max_failures)
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)
        self._failures.move_to_end(client)
        times.append(self._clock())

    def _recent(self, client: str) -> collections.deque[float] | None:
        times = self._failures.get(client)
        if times is not None:
            cutoff = self._clock() - self.window
            while times and times[0] <= cutoff:
                times.popleft()
        return times


class Sessions:
    """Live dashboard sessions: SHA-256 of the token -> expiry (``clock()`` seconds)."""

    def __init__(self, ttl: float = SESSION_SECONDS, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl, self.max_sessions, self._clock = ttl, max_sessions, clock
        self._expiry: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._expiry)

    def create(self) -> str:
        """A new session's token (43 URL-safe characters)."""
        self._expire()
        token = secrets.token_urlsafe(32)
        self._expiry[_digest(token)] = self._clock() + self.ttl
        while len(self._expiry) > self.max_sessions:
            self._expiry.popitem(last=False)
        return token

    def valid(self, token: str | None) -> bool:
        """Whether ``token`` is a live session's."""
        if not token:
            return False
        expiry = self._expiry.get(_digest(token))
        return expiry is not None and expiry > self._clock()

    def end(self, token: str | None) -> bool:
        """End ``token``'s session; whether there was one."""
        return bool(token) and self._expiry.pop(_digest(token), None) is not None

    def _expire(self) -> None:
        now = self._clock()
        for digest in [d for d, t in self._expiry.items() if t <= now]:
            del self._expiry[digest]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


__all__ = ["COOKIE", "FAILED_KEY_WINDOW", "MAX_FAILED_KEYS", "MAX_SESSIONS", "SESSION_SECONDS", "KeyThrottle",
           "Sessions", "login_key", "same_key"]
