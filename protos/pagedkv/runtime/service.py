"""What every pagedkv gRPC server shares: error mapping, health, reflection, shutdown.

- :func:`map_errors` is the one exception-to-status mapping of a servicer
  (DESIGN.md, "Errors"): :class:`~pagedkv.runtime.errors.PagedKVError` -> its code with a
  ``google.rpc.ErrorInfo`` detail; ``AssertionError`` (a broken invariant) ->
  INTERNAL with a log line; anything else -> INTERNAL.
- :func:`parse_in_handlers` registers a servicer's methods so that a request
  whose bytes do not parse is INVALID_ARGUMENT (gRPC itself would answer
  UNKNOWN); :func:`run_server` registers every servicer through it.
- :func:`run_server` starts a ``grpc.aio`` server with the standard health
  service and server reflection, on a mutual-TLS port when the spec has TLS
  files and on loopback only when it has none (:mod:`pagedkv.runtime.tls`), logs
  which, writes the bound address to a ready file,
  and on SIGTERM/SIGINT marks NOT_SERVING, runs the caller's shutdown hook,
  then stops with a grace period (grpc examples: graceful shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import os
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from pagedkv.runtime.errors import ERROR_DOMAIN, PagedKVError
from pagedkv.runtime.lifetime import watch_parent
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.tls import TlsFiles, check_bind, from_args, server_credentials
from pagedkv.runtime.tls import mode as tls_mode

log = get_logger("rpc")

#: Largest request or response message, bytes (gRPC refuses bigger ones itself).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


#: Longest error message and ErrorInfo metadata key or value sent back, in bytes of UTF-8; messages
#: may quote caller input (a lease id, a sequence id), which must not grow a reply past what its
#: trailers can carry. Bytes, not characters: the trailers carry the message percent-encoded (up to
#: 3 bytes for each byte outside printable ASCII) and again, base64, in the status details, and a
#: peer refuses trailers over its metadata limit (8 KiB by default), so 1,024 characters of 4-byte
#: UTF-8 (~10 KiB of trailers) reached the caller as RESOURCE_EXHAUSTED "Stream removed".
MAX_DETAIL_BYTES = 1024
MAX_METADATA_BYTES = 256


def _truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8 (whole characters), saying how much was left out."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", "ignore")  # drops a character cut in half
    return f"{kept}… ({len(text) - len(kept)} more characters)"


def status_proto(code: grpc.StatusCode, message: str, reason: str, metadata: dict[str, str]) -> status_pb2.Status:
    """The google.rpc.Status of an error: ``code``, ``message`` (cut to :data:`MAX_DETAIL_BYTES`) and a
    google.rpc.ErrorInfo (``reason``, domain :data:`~pagedkv.runtime.errors.ERROR_DOMAIN`,
    ``metadata`` cut to :data:`MAX_METADATA_BYTES` per key and value) in its details."""
    message = _truncate(message, MAX_DETAIL_BYTES)
    metadata = {_truncate(k, MAX_METADATA_BYTES): _truncate(v, MAX_METADATA_BYTES) for k, v in metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[detail])


def _status_for(code: grpc.StatusCode, message: str, reason: str, metadata: dict[str, str]) -> grpc.Status:
    return rpc_status.to_status(status_proto(code, message, reason, metadata))


def _status_of(name: str, error: BaseException) -> grpc.Status:
    """The status an exception from RPC ``name`` maps to (module docstring)."""
    if isinstance(error, PagedKVError):
        log.info("rpc_error", method=name, code=error.code.name, error=error.message)
        return _status_for(error.code, error.message, error.reason, error.metadata)
    if isinstance(error, AssertionError):
        log.error("invariant_broken", method=name, error=str(error), exc_info=error)
        return _status_for(
            grpc.StatusCode.INTERNAL,
            f"internal invariant broken in {name}: {error}; this is a bug, please report it with the service log",
            "INTERNAL", {})
    log.error("rpc_failed", method=name, error=repr(error), exc_info=error)
    return _status_for(grpc.StatusCode.INTERNAL, f"{name} failed: {error!r}; see the service log", "INTERNAL", {})


def map_errors(cls: type) -> type:
    """Class decorator: wrap every public ``async def`` RPC method (unary or streaming) of a servicer.

    Each call is logged at debug; errors become statuses as the module docstring
    says. The service keeps running after any error.
    """
    passthrough = (asyncio.CancelledError, grpc.aio.AbortError)
    for name, fn in list(vars(cls).items()):
        if name.startswith("_"):
            continue
        if inspect.isasyncgenfunction(fn):

            def make_stream(fn, name: str = name):
                @functools.wraps(fn)
                async def stream(self, request, context):
                    log.debug("rpc_stream", method=name)
                    try:
                        async for item in fn(self, request, context):
                            yield item
                    except passthrough:
                        raise
                    except Exception as e:  # noqa: BLE001 - never crash the server
                        status = _status_of(name, e)
                        await context.abort(status.code, status.details, status.trailing_metadata)

                return stream

            setattr(cls, name, make_stream(fn))
        elif inspect.iscoroutinefunction(fn):

            def make_unary(fn, name: str = name):
                @functools.wraps(fn)
                async def unary(self, request, context):
                    try:
                        response = await fn(self, request, context)
                        log.debug("rpc", method=name)
                        return response
                    except passthrough:
                        raise
                    except Exception as e:  # noqa: BLE001 - never crash the server
                        status = _status_of(name, e)
                    await context.abort(status.code, status.details, status.trailing_metadata)

                return unary

            setattr(cls, name, make_unary(fn))
    return cls


class _ParsingRegistrar:
    """Stands in for a server while a generated ``add_*Servicer_to_server`` registers its methods.

    Each method handler is registered with no request deserializer (the handler gets the raw
    bytes) and a behaviour that parses them first: a parse failure aborts with INVALID_ARGUMENT
    (with a ``google.rpc.ErrorInfo``, as :func:`map_errors` does) before the servicer runs.
    Anything else is passed to the real server.
    """

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def __getattr__(self, name: str):
        return getattr(self._server, name)

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers come again through add_registered_method_handlers, wrapped there

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {name: _parsing_handler(f"{service}/{name}", h) for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self._server.add_registered_method_handlers(service, wrapped)


def _parsing_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` parsing its request inside the behaviour (unary-unary and unary-stream methods)."""
    parse = handler.request_deserializer
    if parse is None or handler.request_streaming:
        return handler

    async def request_of(raw: bytes, context):
        try:
            return parse(raw)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's malformed request
            status = _status_for(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"{method}: the request's {len(raw)} bytes do not parse as its request message "
                                 f"({e}); send a serialized request of the method's type",
                                 "INVALID_ARGUMENT", {})
            log.info("rpc_error", method=method, code="INVALID_ARGUMENT", error="malformed request bytes")
            await context.abort(status.code, status.details, status.trailing_metadata)

    if handler.response_streaming:
        behavior = handler.unary_stream

        async def unary_stream(raw, context):
            async for item in behavior(await request_of(raw, context), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=handler.response_serializer)
    behavior = handler.unary_unary

    async def unary_unary(raw, context):
        return await behavior(await request_of(raw, context), context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=handler.response_serializer)


def parse_in_handlers(server: grpc.aio.Server) -> _ParsingRegistrar:
    """A stand-in for ``server`` to pass to a generated ``add_*Servicer_to_server``: malformed
    request bytes become INVALID_ARGUMENT instead of gRPC's UNKNOWN (:class:`_ParsingRegistrar`)."""
    return _ParsingRegistrar(server)


def write_ready_file(path: str | os.PathLike, info: dict) -> None:
    """Atomically write ``info`` as JSON to ``path`` (rename, so readers never see half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


@dataclass
class ServerSpec:
    """What :func:`run_server` needs to know about one service."""

    #: Fully qualified service names for reflection and health, e.g. "pagedkv.memory.v1.MemoryService".
    service_names: list[str]
    #: Callback registering servicers on the server: ``add(server)``.
    add_servicers: Callable[[grpc.aio.Server], None]
    #: Host to bind, e.g. "127.0.0.1" or "0.0.0.0".
    host: str = "127.0.0.1"
    #: Port to bind; 0 = any free port.
    port: int = 0
    #: Where to write {"address", "host", "port", "pid"} once serving.
    ready_file: str | None = None
    #: Extra fields for the ready file.
    ready_info: dict = field(default_factory=dict)
    #: Seconds in-flight RPCs get to finish on shutdown.
    grace_seconds: float = 5.0
    #: Awaited after NOT_SERVING is set, before the server stops (tell workers, ...).
    on_shutdown: Callable[[], Awaitable[None]] | None = None
    #: Awaited after the server stopped (release the pool, ...).
    on_stopped: Callable[[], Awaitable[None]] | None = None
    #: Background coroutines started with the server and cancelled at shutdown.
    background: Iterable[Callable[[], Awaitable[None]]] = ()
    #: The health servicer to register (created when None); background tasks may flip it.
    health: health.aio.HealthServicer | None = None
    #: Mutual TLS (``--tls-cert/--tls-key/--tls-ca``); None: plaintext, and ``host`` must be loopback.
    tls: TlsFiles | None = None

    @classmethod
    def bound(cls, bind: Bind, service_name: str, add_servicers: Callable[[grpc.aio.Server], None],
              **rest) -> ServerSpec:
        """The spec of one service started from the command line: it binds ``bind`` (the flags
        every ``pagedkv`` service has, :class:`Bind`); ``rest`` sets the other fields."""
        return cls(service_names=[service_name], add_servicers=add_servicers, host=bind.host, port=bind.port,
                   ready_file=bind.ready_file, tls=bind.tls, **rest)


@dataclass(frozen=True, slots=True)
class Bind:
    """Where a service listens, parsed and checked once from the flags every ``pagedkv`` service has
    (:func:`pagedkv.config.flags.add_bind_args`, :func:`~pagedkv.config.flags.add_tls_args`)."""

    #: Host to bind, e.g. "127.0.0.1" or "0.0.0.0".
    host: str
    #: Port to bind; 0: any free port.
    port: int
    #: Where to write the bound address as JSON once serving.
    ready_file: str | None
    #: Mutual TLS (``--tls-cert/--tls-key/--tls-ca``); None: plaintext, on loopback only.
    tls: TlsFiles | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Bind:
        """Call it first thing, so a bad start fails before any slow work.

        Raises:
            ValueError: incomplete TLS flags, an unreadable TLS file, a port outside 0-65535, or a
                non-loopback host without TLS.
        """
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must lie in 0-65535, got {args.port}")
        tls = from_args(args)
        check_bind(args.host, tls)
        return cls(args.host, args.port, args.ready_file, tls)


async def run_server(spec: ServerSpec) -> None:
    """Serve until SIGTERM/SIGINT, then shut down gracefully.

    Raises:
        OSError: the address could not be bound.
        ValueError: no TLS files and a host that is not loopback (:func:`pagedkv.runtime.tls.check_bind`).
    """
    check_bind(spec.host, spec.tls)
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    spec.add_servicers(parse_in_handlers(server))
    health_servicer = spec.health or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*spec.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    if spec.tls is None:
        port = server.add_insecure_port(f"{spec.host}:{spec.port}")
    else:
        port = server.add_secure_port(f"{spec.host}:{spec.port}", server_credentials(spec.tls))
    if port == 0:
        raise OSError(f"could not bind {spec.host}:{spec.port}; is another service using the port?")
    await server.start()
    for name in ["", *spec.service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{spec.host}:{port}"
    log.info("serving", address=address, services=spec.service_names, pid=os.getpid(),
             mode=tls_mode(spec.host, spec.tls))
    if spec.ready_file:
        write_ready_file(spec.ready_file, {"address": address, "host": spec.host, "port": port, "pid": os.getpid(),
                                           "tls": spec.tls is not None, **spec.ready_info})

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(job()) for job in spec.background]
    try:
        await stop.wait()
    finally:
        log.info("shutting_down", address=address)
        await health_servicer.enter_graceful_shutdown()
        if spec.on_shutdown is not None:
            await spec.on_shutdown()
        for t in tasks:
            t.cancel()
        await server.stop(spec.grace_seconds)
        if spec.on_stopped is not None:
            await spec.on_stopped()
        log.info("stopped", address=address)


def serve_main(name: str, serve: Callable[[], Awaitable[None]], errors: tuple[type[BaseException], ...]) -> int:
    """Run a service's ``serve()`` coroutine; a start-up error in ``errors`` prints and returns 2.

    A service started as a child (``PAGEDKV_PARENT_PID``) stops when its parent is gone
    (:func:`pagedkv.runtime.lifetime.watch_parent`)."""
    try:
        watch_parent()
        asyncio.run(serve())
    except errors as e:
        log.error("startup_failed", service=name, error=str(e))
        print(f"pagedkv {name}: error: {e}")
        return 2
    return 0
