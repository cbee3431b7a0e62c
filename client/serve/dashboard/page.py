"""The dashboard's page on ``pagedkv serve``: ``GET /dashboard`` and its assets.

    GET /dashboard                       the page (client/serve/dashboard/static/dashboard.html), no login
                                         needed: it holds no data, and asks for the admin key
                                         itself (client.serve.dashboard.routes)
    GET /dashboard/static/dashboard.js   what draws the snapshots of /dashboard/events; it hands each one
                                         to the two scripts below (a "pagedkv:snapshot" event)
    GET /dashboard/static/charts.js      the charts of the last minutes
    GET /dashboard/static/workers.js     the workers and their states (ready, down, draining)
    GET /dashboard/static/dashboard.css

Plain HTML, CSS and JavaScript, read once from the package, no build step and no third-party
script. The page is served with a Content-Security-Policy that allows only this origin's script,
style and connections (no inline script, no framing), so a request id or lease id drawn on it can
never run as code (the script also only ever sets text, never HTML).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from client.serve.protocol import APIError

#: The assets under /dashboard/static/, with their media types.
ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "charts.js": "text/javascript; charset=utf-8",
          "workers.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
#: Headers of the page and its assets.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def asset(name: str) -> bytes:
    """The bytes of ``client/serve/dashboard/static/<name>``."""
    return resources.files("client.serve.dashboard").joinpath("static", name).read_bytes()


def add_dashboard_page(app: FastAPI) -> None:
    """Register the page's routes on ``app``."""

    @app.api_route("/dashboard", methods=["GET", "HEAD"])
    async def page():
        return Response(asset("dashboard.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.api_route("/dashboard/static/{name}", methods=["GET", "HEAD"])
    async def static(name: str):
        if name not in ASSETS:
            raise APIError(404, f"no dashboard asset {name!r}", type="not_found_error")
        return Response(asset(name), media_type=ASSETS[name], headers=PAGE_HEADERS)


__all__ = ["ASSETS", "add_dashboard_page", "asset"]
