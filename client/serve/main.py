"""``pagedkv serve``: the OpenAI-compatible server, in the foreground.

Resolves the backends (attach, or start a memory service and a worker as child processes; see
:mod:`client.serve.backends`), connects one :class:`~client.api.Client` (the engine every caller
shares; its lease is created with the memory service's admin token when the token file is readable,
so it may hold the whole pool: ``--memory-admin-token-file``), and serves
:func:`client.serve.app.create_app` with uvicorn until SIGINT or SIGTERM; then the engine's lease is
released and embedded services are stopped. uvicorn runs with the HTTP limits of
:mod:`client.serve.http_limits` (header and body timeouts, the connection limit, and forwarded
headers only from ``--forwarded-allow-ips``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from client.api import Client
from client.cluster.core import Cluster
from client.serve.app import Server, create_app
from client.serve.backends import resolve
from client.serve.chat_template import ChatTemplate
from client.serve.config import parse_args
from client.serve.http_limits import uvicorn_options
from client.serve.tools.plan import ToolSettings
from pagedkv.runtime import test_hooks
from pagedkv.runtime.cache_salt import load_secret, namespace
from pagedkv.runtime.logs import configure_logging, get_logger
from pagedkv.runtime.tls import TlsFiles

log = get_logger("serve")


class _Uvicorn(uvicorn.Server):
    """uvicorn's server that, on SIGINT/SIGTERM, first fails the requests in flight with 503."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.pagedkv = server

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.pagedkv.shutdown()
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any backend starts (a taken port fails fast).

    Raises:
        OSError: the address is taken or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _write_ready(server: uvicorn.Server, path: Path, address: str) -> None:
    """Write the bound address to ``path`` once uvicorn accepts connections."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    port = int(address.rsplit(":", 1)[1])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "port": port, "pid": os.getpid(), "url": f"http://{address}"}))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pagedkv serve``; returns the exit code (0 after SIGINT or SIGTERM)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(args.log_level)
    test_hooks.install_from_env()
    # uvicorn handles SIGINT/SIGTERM while it serves, then re-raises the signal to the handler in
    # place before it; this one lets the process return normally, so the lease is released and
    # embedded services are stopped below.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        sock = _bind(args.host, args.port)
        address = f"{args.host}:{sock.getsockname()[1]}"
        backends = resolve(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"pagedkv serve: error: {e}", file=sys.stderr)
        return 1
    client = None
    try:
        secret = load_secret(args.cache_salt_secret_file)  # kept across restarts: tenants keep their cache
        limits = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_model_len=args.max_model_len, tls=backends.tls, preemption_mode=args.preemption_mode,
                      scheduling_policy=args.scheduling_policy,
                      step_timeout=args.step_timeout, recovery_timeout=args.recovery_timeout,
                      cache_namespace=namespace(secret, "user"),
                      admin_token_file=backends.admin_token_file)  # the lease is the admin's: the whole pool
        if args.nodes:  # several nodes: one engine each, requests routed (client.cluster.core)
            router = None
            if backends.tls is not None and args.router_tls_cert and args.router_tls_key:
                router = TlsFiles(args.router_tls_cert, args.router_tls_key, backends.tls.ca)
            client = Cluster(args.nodes, router_tls=router, **limits)
        else:
            client = Client(backends.memory, backends.workers, **limits)
        name = args.served_model_name or args.model or "smollm2"
        pagedkv = Server(client, backends, args.tenants, name, args.max_queued_requests, args.max_requests_per_tenant,
                         dashboard_interval=args.dashboard_interval, secret=secret,
                         scheduling_policy=args.scheduling_policy, metrics_compat=args.metrics_compat,
                         chat_template=ChatTemplate(args.chat_template),
                         tool_settings=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser))
        server = _Uvicorn(uvicorn.Config(create_app(pagedkv), log_level="warning", timeout_graceful_shutdown=5,
                                         **uvicorn_options(args.http_limits)), pagedkv)
        if args.ready_file:
            threading.Thread(target=_write_ready, args=(server, Path(args.ready_file), address), daemon=True).start()
        log.info("serving", url=f"http://{address}", model=name, memory=backends.memory, workers=backends.workers,
                 backends=backends.source, max_model_len=client.limits.max_context)
        server.run(sockets=[sock])
        return 0
    except Exception as e:  # noqa: BLE001 - report and stop what was started
        print(f"pagedkv serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        sock.close()
        if client is not None:
            client.close()
        backends.close()
