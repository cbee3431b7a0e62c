"""``pagedkv top``: the dashboard in a terminal, for machines without a browser.

Reads the same feed as the page (``GET /dashboard/events`` of ``pagedkv serve``, server-sent
events) with the operator's key as ``Authorization: Bearer``, and redraws each snapshot with rich
Live (client.ops.top_view). ``--once`` prints one frame and exits (scripts, tests). A broken
connection is retried every second until Ctrl-C; a refused key ends it (exit 1).

Plain ``urllib``: no HTTP client beyond the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from rich.console import Console
from rich.live import Live

from client.ops.top_view import render
from pagedkv.config import env

#: Seconds to wait for the server to answer (and between two snapshots before giving up).
TIMEOUT = 30.0


class Refused(Exception):
    """The server refused the key (401/403) or has no dashboard."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv top", description="the dashboard of a `pagedkv serve` in the terminal")
    p.add_argument("--url", default=env("PAGEDKV_URL"),
                   help="the server (default $PAGEDKV_URL, else http://127.0.0.1:8000)")
    p.add_argument("--key", default=env("PAGEDKV_ADMIN_API_KEY"),
                   help="its --admin-api-key (default $PAGEDKV_ADMIN_API_KEY)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    return p


def events(url: str, key: str, timeout: float = TIMEOUT) -> Iterator[tuple[str, dict]]:
    """The feed's events as ``(event name, JSON data)``, as they come.

    Raises:
        Refused: 401 or 403, with the server's message.
        OSError: the server cannot be reached, or the stream broke (urllib.error.URLError included).
    """
    req = urllib.request.Request(url.rstrip("/") + "/dashboard/events",
                                 headers={"Authorization": f"Bearer {key}", "Accept": "text/event-stream"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - the operator's own server URL
    except urllib.error.HTTPError as e:
        raise Refused(f"HTTP {e.code}: {_message(e)}") from None
    with resp:
        name, data = "message", []
        for raw in resp:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line:
                if data:
                    yield name, json.loads("\n".join(data))
                name, data = "message", []
            elif line.startswith(":"):
                continue
            else:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    name = value
                elif field == "data":
                    data.append(value)


def _message(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return e.reason


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    """Entry point of ``pagedkv top``; ``console`` to draw on (default: the terminal)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    err = console or Console(stderr=True)  # errors: stderr on a terminal, the given console otherwise
    console = console or Console()
    if not args.key:
        err.print("pagedkv top: error: give the server's admin key (--key or $PAGEDKV_ADMIN_API_KEY)")
        return 2
    if args.once:
        try:
            for name, data in events(args.url, args.key):
                if name == "snapshot":
                    console.print(render(data, console.width))
                    return 0
                err.print(f"pagedkv top: {data.get('message', data)}")
                return 1
        except (Refused, OSError) as e:
            err.print(f"pagedkv top: error: {e}")
            return 1
        err.print("pagedkv top: error: the feed ended before a snapshot")
        return 1
    try:
        with Live(console=console, refresh_per_second=4, screen=False) as live:
            while True:
                try:
                    for name, data in events(args.url, args.key):
                        if name == "snapshot":
                            live.update(render(data, console.width))
                        else:
                            live.console.print(f"pagedkv top: {data.get('message', data)}")
                except Refused as e:
                    live.console.print(f"pagedkv top: error: {e}")
                    return 1
                except OSError as e:
                    live.console.print(f"pagedkv top: {e}; reconnecting")
                time.sleep(1.0)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
