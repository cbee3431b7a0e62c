"""The dashboard's data routes on ``pagedkv serve`` (the page and its assets: client.serve.dashboard.page).

    POST /dashboard/login      the admin key (form field ``key`` or JSON ``{"key": ...}``) -> the
                               session cookie (client.serve.dashboard.auth); JSON gets 200
                               ``{"ok": true, "expires_in": s}``, a form a 303 to /dashboard; a wrong
                               key 401, or 429 (with Retry-After) from an address past the key
                               throttle (client.serve.dashboard.auth.KeyThrottle); the right key always
                               logs in
    POST /dashboard/logout     ends the session, clears the cookie (200 whatever the cookie)
    GET  /dashboard/events     server-sent events: ``event: snapshot`` (or ``event: error`` when the
                               memory service did not answer), ``id:`` the snapshot number, ``data:``
                               one JSON snapshot (client.serve.dashboard.snapshot); one feed shared
                               by every viewer (client.serve.dashboard.feed). A stream opened with a
                               session ends when the session does (logout, expiry, eviction)
    GET  /dashboard/snapshot   the next snapshot as one JSON document (the page's first paint, scripts)

Each but login and logout needs the session cookie or ``Authorization: Bearer <admin key>``:
401 otherwise (403 when the server has no ``--admin-api-key``: then there is no dashboard; 429
for a wrong Bearer key from an address past the key throttle).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from client.serve.access import bearer_key, client_address, refused_key, throttled
from client.serve.dashboard.auth import COOKIE, MAX_LOGIN_BYTES, SESSION_SECONDS, login_key, same_key
from client.serve.protocol import APIError
from pagedkv.runtime.logs import get_logger

if TYPE_CHECKING:
    from client.serve.app import Server

log = get_logger("dashboard")

#: Seconds /dashboard/snapshot waits for the next snapshot.
SNAPSHOT_WAIT = 30.0


def _refused(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def _admin_key(server: Server) -> str:
    if server.tenants.admin_key is None:
        raise APIError(403, "the dashboard needs --admin-api-key, which the server was started without",
                       type="permission_error")
    return server.tenants.admin_key


def _require_viewer(server: Server, request: Request) -> str | None:
    """Refuse (401/403, 429 past the key throttle) a caller who is not the operator; returns the
    session token it came with, or None when it sent the admin key itself."""
    key = _admin_key(server)
    token = request.cookies.get(COOKIE)
    if server.sessions.valid(token):
        return token
    bearer = bearer_key(request)
    if bearer is None:
        raise _refused("log in first: POST /dashboard/login with the admin API key, or send "
                       "'Authorization: Bearer <admin API key>'")
    if not same_key(bearer, key):
        raise refused_key(server.key_throttle, request, _refused("the dashboard needs the admin API key"))
    return None


def _cookie_flags(request: Request) -> dict:
    return {"path": "/dashboard", "httponly": True, "samesite": "strict", "secure": request.url.scheme == "https"}


def add_dashboard_routes(app: FastAPI, server: Server) -> None:
    """Register the module's routes on ``app``."""

    @app.post("/dashboard/login")
    async def login(request: Request):
        key = _admin_key(server)
        client = client_address(request)
        content_type = request.headers.get("content-type", "")
        body = b""
        async for chunk in request.stream():  # a hang-up mid-body: client.serve.app's ClientDisconnect handler
            body += chunk
            if len(body) > MAX_LOGIN_BYTES:
                break
        if not same_key(login_key(body, content_type), key):  # the right key logs in, throttled address or not
            wait = server.key_throttle.refuse(client)
            if wait > 0:
                raise throttled(wait)
            log.warning("dashboard_login_refused", client=client)
            raise _refused("wrong or missing admin API key")
        token = server.sessions.create()
        log.info("dashboard_login", client=client)
        if content_type.split(";", 1)[0].strip().lower() == "application/json":
            response = JSONResponse({"ok": True, "expires_in": SESSION_SECONDS})
        else:
            response = RedirectResponse("/dashboard", status_code=303)
        response.set_cookie(COOKIE, token, max_age=SESSION_SECONDS, **_cookie_flags(request))
        return response

    @app.post("/dashboard/logout")
    async def logout(request: Request):
        server.sessions.end(request.cookies.get(COOKIE))
        response = JSONResponse({"ok": True})
        response.delete_cookie(COOKIE, **_cookie_flags(request))
        return response

    @app.get("/dashboard/events")
    async def events(request: Request):
        session = _require_viewer(server, request)
        feed = server.dashboard_feed()
        q = feed.subscribe()

        async def stream():
            try:
                yield "retry: 2000\n\n"
                while True:
                    item = await q.get()
                    if item is None:  # the server stops
                        return
                    if session is not None and not server.sessions.valid(session):
                        return  # logged out, expired or evicted: the browser's reconnect gets 401
                    kind, seq, data = item
                    yield f"id: {seq}\nevent: {kind}\ndata: {data}\n\n"
            finally:
                feed.unsubscribe(q)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @app.get("/dashboard/snapshot")
    async def snapshot(request: Request):
        _require_viewer(server, request)
        feed = server.dashboard_feed()
        q = feed.subscribe()
        try:
            item = await asyncio.wait_for(q.get(), SNAPSHOT_WAIT)
        except TimeoutError:
            item = None
        finally:
            feed.unsubscribe(q)
        if item is None:
            raise APIError(503, "no snapshot: the server is stopping", type="server_error", code="unavailable")
        kind, _, data = item
        return Response(data, media_type="application/json", status_code=200 if kind == "snapshot" else 503,
                        headers={"Cache-Control": "no-store"})


__all__ = ["add_dashboard_routes"]
