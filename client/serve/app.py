"""The HTTP API of ``pagedkv serve``: OpenAI-compatible routes over one shared engine.

Every caller's requests go to the same :class:`~client.api.Client`, whose engine thread runs
one continuous batch (vLLM's ``AsyncLLMEngine`` behind its OpenAI server). Outputs come back
from the engine thread through a per-request ``asyncio.Queue``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (with API keys or ``--metrics-api-key`` given: the metrics
key's or the admin key's), the admin-only ``GET /debug/steps`` (the engine's step
trace: which requests each step carried, and at which step each abort was asked; with several
nodes, the first node's, and every node's under ``nodes``), and the
operator's dashboard feed under ``/dashboard/`` (client.serve.dashboard.routes).

Errors use the OpenAI error body (:class:`~client.serve.protocol.APIError`): 400 bad parameter or
a prompt longer than the context, 401 missing or wrong key, 403 a tenant key on an admin route,
404 unknown model, 429 the waiting queue is full, or a wrong key from an address past the key
throttle (client.serve.dashboard.auth.KeyThrottle, with Retry-After), 503 the memory service or
the workers are down. A client that disconnects aborts its request; the engine frees its blocks at the start of
its next step.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from client.backend import Backend
from client.engine.stats import EngineStats, StepLog
from client.errors import ServiceError, Unavailable
from client.serve import access
from client.serve.backends import Backends
from client.serve.chat_prompt import render, tool_plan
from client.serve.chat_template import ChatTemplate
from client.serve.dashboard.auth import KeyThrottle, Sessions
from client.serve.dashboard.feed import DEFAULT_INTERVAL, DashboardFeed
from client.serve.dashboard.page import add_dashboard_page
from client.serve.dashboard.routes import add_dashboard_routes
from client.serve.generation import generate
from client.serve.metrics import ServeMetrics
from client.serve.pin_routes import add_pin_routes
from client.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request, parse, prompts_of
from client.serve.tenants import Tenants
from client.serve.tokenize_routes import add_tokenize_routes
from client.serve.tools.plan import ToolSettings
from client.tokenizer import encode_prompt
from pagedkv.runtime.logs import get_logger

log = get_logger("serve")

#: Seconds between status lines while requests run or wait.
STATUS_INTERVAL = 10.0


@dataclass
class Server:
    """What the routes share: the client (engine), the backends, tenants and metrics."""

    #: The generation side: one Client, or a Cluster of nodes (client.backend.Backend).
    client: Backend
    backends: Backends
    tenants: Tenants
    model_name: str
    max_queued_requests: int
    #: Requests one tenant may have in flight (queued + running); None: no limit.
    max_requests_per_tenant: int | None = None
    metrics: ServeMetrics = field(init=False)
    #: Keys the per-tenant and per-group cache salts (DESIGN.md, trust model); ``pagedkv serve`` passes
    #: its persisted one (--cache-salt-secret-file, pagedkv.runtime.cache_salt), so tenants keep their cache.
    secret: bytes = field(default_factory=lambda: os.urandom(32))
    #: (time.monotonic() of the last health check, its result); requests reuse it for a second.
    _health: tuple[float, tuple[bool, int, int]] = field(default=(float("-inf"), (False, 0, 0)), init=False,
                                                         repr=False)
    #: Requests in flight (client.serve.generation's runs), failed with 503 at shutdown.
    runs: set = field(default_factory=set, init=False, repr=False)
    #: Engine requests in flight per tenant (one per prompt).
    in_flight: collections.Counter = field(default_factory=collections.Counter, init=False, repr=False)
    #: Seconds between dashboard snapshots while someone watches.
    dashboard_interval: float = DEFAULT_INTERVAL
    #: The engine's scheduling policy (--scheduling-policy): a request's priority other than 0 needs "priority".
    scheduling_policy: str = "fcfs"
    #: ``--metrics-compat``: "vllm" also exports vLLM's metric names (client.serve.metrics_vllm).
    metrics_compat: str = "none"
    #: ``--chat-template`` (client.serve.chat_template); the tool flags (client.serve.tools.plan).
    chat_template: ChatTemplate = field(default_factory=ChatTemplate)
    tool_settings: ToolSettings = field(default_factory=ToolSettings)
    #: Dashboard logins (client.serve.dashboard.auth).
    sessions: Sessions = field(default_factory=Sessions, init=False, repr=False)
    #: Wrong keys (Bearer keys on every route, dashboard logins) per client address (client.serve.dashboard.auth).
    key_throttle: KeyThrottle = field(default_factory=KeyThrottle, init=False, repr=False)
    #: The dashboard's feed, made at the first viewer (client.serve.dashboard.feed).
    _feed: DashboardFeed | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.metrics = ServeMetrics(self.model_name, self.client, compat=self.metrics_compat)

    def front_stats(self) -> EngineStats:
        """The engine stats the dashboard shows: with several nodes (``--node``), the first node's,
        whose pool it maps."""
        return next(iter(self.client.node_stats().values()))

    def shutdown(self) -> None:
        """Fail every request in flight with 503 now (streams get an error event and ``[DONE]``),
        rather than let them be cut when uvicorn's grace period ends, and end the dashboard's
        streams; called on SIGINT/SIGTERM."""
        error = Unavailable(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        for run in list(self.runs):
            run.fail(error)
        if self._feed is not None:
            self._feed.end_streams()

    def dashboard_feed(self) -> DashboardFeed:
        """The dashboard's feed (one for every viewer), made on first use. With several nodes
        (``--node``) it shows the first node's pool and engine (:meth:`front_stats`), and every node's workers."""
        if self._feed is None:
            self._feed = DashboardFeed(memory_address=self.backends.memory, tls=self.backends.tls,
                                       admin_token_file=self.backends.admin_token_file, front=self.front_stats,
                                       token_totals=self.metrics.token_totals, interval=self.dashboard_interval,
                                       engines=self.client.engine_stats)
        return self._feed

    def close_dashboard(self) -> None:
        """Stop the dashboard's feed, if it ever started."""
        if self._feed is not None:
            self._feed.close()

    async def backends_up(self, max_age: float = 1.0) -> bool:
        """Whether the memory service and a worker serve (a check at most ``max_age`` seconds old)."""
        return (await self.backends_health(max_age))[0]

    async def backends_health(self, max_age: float = 1.0) -> tuple[bool, int, int]:
        """:meth:`Backends.health` (up, workers ready, workers in all), at most ``max_age`` seconds old."""
        at, health = self._health
        if time.monotonic() - at > max_age:
            health = await asyncio.to_thread(self.backends.health)
            self._health = (time.monotonic(), health)
        return health

    def authorize(self, request: Request, *, admin: bool = False) -> str:
        """The caller's tenant ("admin" for the admin key; :func:`client.serve.access.authorize`).

        Raises:
            APIError: 401 no or unknown key, 403 not the admin key on an admin route, 429 a wrong key
                from an address past the key throttle.
        """
        return access.authorize(self.tenants, self.key_throttle, request, admin=admin)

    def authorize_metrics(self, request: Request) -> None:
        """Let the caller read ``/metrics`` (:func:`client.serve.access.authorize_metrics`).

        Raises:
            APIError: 401 no or unknown key, 403 a tenant's key, 429 a wrong key past the key throttle.
        """
        access.authorize_metrics(self.tenants, self.key_throttle, request)

    def cache_salt(self, tenant: str, salt: str | None) -> str:
        """The prefix-cache salt of ``tenant``'s request: its namespace's salt joined with the request's
        own ``salt`` (which can only narrow sharing, never widen it).

        The namespace is the tenant's own, HMAC(secret, "tenant:" + tenant), or for a tenant in a
        cache-sharing group (``--cache-sharing-group``) the group's, HMAC(secret, "group:" + name);
        the prefixes keep a tenant named like a group out of the group. 32 hex digits, so the
        namespace always ends at the first ':'. Open servers (tenant "") have no namespace.
        """
        if not tenant:
            return salt or ""
        group = self.tenants.groups.get(tenant)
        mine = self.group_salt(group) if group is not None else self._namespace(f"tenant:{tenant}")
        return f"{mine}:{salt}" if salt else mine

    def group_salt(self, group: str) -> str:
        """The cache-salt namespace of cache-sharing group ``group`` (what its tenants' requests carry)."""
        return self._namespace(f"group:{group}")

    def _namespace(self, label: str) -> str:
        return hmac.new(self.secret, label.encode(), hashlib.sha256).hexdigest()[:32]


def create_app(server: Server) -> FastAPI:
    """The FastAPI application over ``server``."""
    app = FastAPI(title="pagedkv", summary="OpenAI-compatible server over a shared paged KV-cache pool",
                  lifespan=_lifespan(server))

    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        """200 while the memory service and a worker serve and the engine makes progress (a step
        finished within the step timeout while requests run); 503 otherwise. The body says which:
        {"status": "ok" | "degraded" | "down", "workers": {"ready": R, "total": T}}."""
        up, ready, total = await server.backends_health(max_age=0)
        stats = server.client.engine_stats()
        stuck = stats.num_running > 0 and stats.last_step_at and \
            time.monotonic() - stats.last_step_at > server.client.limits.step_timeout
        status = "down" if not up or stuck else "ok" if ready == total else "degraded"
        body = {"status": status, "workers": {"ready": ready, "total": total}}
        return JSONResponse(body, status_code=503 if status == "down" else 200)

    @app.get("/metrics")
    async def metrics(request: Request):
        server.authorize_metrics(request)
        data = await asyncio.to_thread(generate_latest, server.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        limits = server.client.limits
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "pagedkv", "root": limits.model_info.model_source,
                                            "max_model_len": limits.max_context}]}

    @app.get("/debug/steps")
    async def steps(request: Request):
        server.authorize(request, admin=True)
        try:
            since = int(request.query_params.get("since", 0))
        except ValueError:
            raise bad_request("since must be an integer step number", "since") from None
        logs = server.client.step_logs(since)
        body = _step_log(next(iter(logs.values())))  # the first node's; with several, each under "nodes"
        return body | {"nodes": {name: _step_log(steps) for name, steps in logs.items()}} if len(logs) > 1 else body

    async def worker_drain(address: str, request: Request, drain: bool):
        server.authorize(request, admin=True)
        try:
            return await asyncio.to_thread(server.client.drain if drain else server.client.undrain, address)
        except KeyError as e:
            raise APIError(404, str(e.args[0]), param="address", code="worker_not_found") from None

    @app.post("/admin/workers/{address}/drain")
    async def drain(address: str, request: Request):
        """Drain a worker (client.engine.failover): its requests move to the others with no copy and
        no recompute; it gets no more work. Admin key. Reply: {"worker", "state", "moved_sequences"}."""
        return await worker_drain(address, request, True)

    @app.post("/admin/workers/{address}/undrain")
    async def undrain(address: str, request: Request):
        """End a drain. Admin key."""
        return await worker_drain(address, request, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = server.authorize(request)
        req = parse(ChatCompletionRequest, await request.body())
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        tools = tool_plan(server, req)
        ids = await render(server, req.messages, tools=req.tools or None, template_kwargs=req.chat_template_kwargs)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await generate(server, request, tenant, req, [ids], chat=True, logprobs=logprobs,
                               max_tokens=req.max_completion_tokens or req.max_tokens, tools=tools)

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = server.authorize(request)
        req = parse(CompletionRequest, await request.body())
        ids = []
        for p in prompts_of(req.prompt):
            try:
                ids.append(await asyncio.to_thread(encode_prompt, server.client.tokenizer, p))
            except ValueError as e:
                raise bad_request(str(e), "prompt") from None
        return await generate(server, request, tenant, req, ids, chat=False, logprobs=req.logprobs,
                               max_tokens=req.max_tokens)

    add_pin_routes(app, server)
    add_tokenize_routes(app, server)
    add_dashboard_routes(app, server)
    add_dashboard_page(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error body (:class:`~client.serve.protocol.APIError`)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _hung_up(request: Request, e: ClientDisconnect):
        # The caller left mid-body: nobody reads the answer, and it is no server error.
        log.info("client_disconnected", path=request.url.path)
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.error("request_failed", path=request.url.path, error=repr(e))
        return JSONResponse(APIError(500, f"internal error: {e}", type="server_error").body(), status_code=500)


def _step_log(step_log: StepLog) -> dict:
    """``GET /debug/steps``'s body for one engine's step log."""
    return {"step_count": step_log.step_count, "aborts": [{"request_id": r, "step": s} for r, s in step_log.aborts],
            "steps": [{"step": t.step, "request_ids": t.request_ids, "num_tokens": t.num_tokens,
                       "finished": t.finished, "preempted": t.preempted, "swapped": t.swapped} for t in step_log.steps]}


def _lifespan(server: Server):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_status_log(server))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.to_thread(server.close_dashboard)

    return lifespan


async def _status_log(server: Server) -> None:
    """vLLM's periodic line: throughput, running and waiting requests, KV usage, prefix hit rate."""
    last, last_t = server.metrics.token_totals(), time.monotonic()
    last_q = last_h = 0
    while True:
        await asyncio.sleep(STATUS_INTERVAL)
        engine_stats, now = server.client.engine_stats(), time.monotonic()
        totals = server.metrics.token_totals()
        if totals == last and not engine_stats.running and not engine_stats.waiting:
            last_t = now
            continue
        try:
            stats = await asyncio.to_thread(server.client.stats)
            usage = stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0
            dq, dh = stats.prefix_cache_queries - last_q, stats.prefix_cache_hits - last_h
            last_q, last_h = stats.prefix_cache_queries, stats.prefix_cache_hits
        except ServiceError:
            usage, dq, dh = float("nan"), 0, 0
        dt = max(now - last_t, 1e-9)
        log.info("status", prompt_throughput=f"{(totals[0] - last[0]) / dt:.1f} tokens/s",
                 generation_throughput=f"{(totals[1] - last[1]) / dt:.1f} tokens/s", running=engine_stats.num_running,
                 waiting=engine_stats.num_waiting, kv_cache_usage=f"{usage:.1%}",
                 prefix_cache_hit_rate=f"{dh / dq:.1%}" if dq else "n/a")
        last, last_t = totals, now
