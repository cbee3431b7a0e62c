"""``pagedkv serve``: the OpenAI-compatible server, in the foreground.

Resolves the backends (attach, or start a memory service and a worker as child processes; see
:mod:`client.serve.backends`), connects one :class:`~client.api.Client` (the engine every caller
shares), and serves :func:`client.serve.app.create_app` with uvicorn until SIGINT or SIGTERM;
then the engine's lease is released and embedded services are stopped.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import uvicorn

from client.api import Client
from client.serve.app import Server, create_app
from client.serve.backends import resolve
from client.serve.config import parse_args
from pagedkv.logs import get_logger

log = get_logger("serve")


def _write_ready(server: uvicorn.Server, path: Path, host: str) -> None:
    """Write the bound address to ``path`` once uvicorn accepts connections."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    address = f"{host}:{port}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "port": port, "pid": os.getpid(), "url": f"http://{address}"}))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pagedkv serve``; returns the exit code."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        backends = resolve(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pagedkv serve: error: {e}", file=sys.stderr)
        return 1
    client = None
    try:
        client = Client(backends.memory, backends.workers, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
        name = args.served_model_name or args.model or "smollm2"
        app = create_app(Server(client, backends, args.tenants, name, args.max_queued_requests))
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               timeout_graceful_shutdown=5))
        if args.ready_file:
            threading.Thread(target=_write_ready, args=(server, Path(args.ready_file), args.host), daemon=True).start()
        log.info("serving", url=f"http://{args.host}:{args.port}", model=name, memory=backends.memory,
                 workers=backends.workers, backends=backends.source, max_model_len=client.engine.max_context)
        server.run()
        return 0
    except Exception as e:  # noqa: BLE001 - report and stop what was started
        print(f"pagedkv serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.close()
        backends.close()
