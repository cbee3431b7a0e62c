"""The HTTP API of ``pagedkv serve``: OpenAI-compatible routes over one shared engine.

Every caller's requests go to the same :class:`~client.api.Client`, whose engine thread runs
one continuous batch (vLLM's ``AsyncLLMEngine`` behind its OpenAI server). Outputs come back
from the engine thread through a per-request ``asyncio.Queue``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, and the admin-only ``GET /debug/steps`` (the engine's step
trace: which requests each step carried).

Errors use the OpenAI error body (:class:`~client.serve.protocol.APIError`): 400 bad parameter or
a prompt longer than the context, 401 missing or wrong key, 403 a tenant key on an admin route,
404 unknown model, 429 the waiting queue is full, 503 the memory service or the workers are
down. A client that disconnects aborts its request; the engine frees its blocks at the start of
its next step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from client.api import Client, RequestOutput
from client.errors import OutOfBlocks, ServiceError
from client.params import SamplingParams
from client.serve.backends import Backends
from client.serve.config import Tenants
from client.serve.metrics import ServeMetrics
from client.serve.outputs import Choices
from client.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    chat_messages,
    parse,
    prompts_of,
)
from client.tokenizer import encode_prompt
from pagedkv.logs import get_logger

log = get_logger("serve")

#: Seconds between status lines while requests run or wait.
STATUS_INTERVAL = 10.0


@dataclass
class Server:
    """What the routes share: the client (engine), the backends, tenants and metrics."""

    client: Client
    backends: Backends
    tenants: Tenants
    model_name: str
    max_queued_requests: int
    metrics: ServeMetrics = field(init=False)
    #: Keys the per-tenant cache salts (DESIGN.md, trust model): new for each server start.
    secret: bytes = field(default_factory=lambda: os.urandom(32))

    def __post_init__(self):
        self.metrics = ServeMetrics(self.model_name, self.client.engine, self.client.memory)

    @property
    def engine(self):
        return self.client.engine

    def authorize(self, request: Request, *, admin: bool = False) -> str:
        """The caller's tenant. Raises APIError 401 (no or unknown key) or 403 (not the admin key)."""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else None
        if admin:
            if self.tenants.admin_key is None:
                raise APIError(403, "this route needs --admin-api-key, which the server was started without",
                               type="permission_error")
            if key != self.tenants.admin_key:
                raise APIError(401 if key is None else 403, "this route needs the admin API key",
                               type="authentication_error" if key is None else "permission_error")
            return "admin"
        tenant = self.tenants.tenant_of(key)
        if tenant is None:
            raise APIError(401, "Incorrect API key provided." if key else "Missing API key: send 'Authorization: "
                           "Bearer KEY'.", type="authentication_error", code="invalid_api_key")
        return tenant

    def cache_salt(self, tenant: str, salt: str | None) -> str:
        """The tenant's salt, HMAC(secret, tenant), joined with the request's own (it can only narrow sharing)."""
        mine = hmac.new(self.secret, tenant.encode(), hashlib.sha256).hexdigest()[:32] if tenant else ""
        return ":".join(s for s in (mine, salt or "") if s)


def create_app(server: Server) -> FastAPI:
    """The FastAPI application over ``server``."""
    app = FastAPI(title="pagedkv", summary="OpenAI-compatible server over a shared paged KV-cache pool",
                  lifespan=_lifespan(server))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.error("request_failed", path=request.url.path, error=repr(e))
        return JSONResponse(APIError(500, f"internal error: {e}", type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if await asyncio.to_thread(server.backends.healthy):
            return Response(status_code=200)
        raise APIError(503, "the memory service or every worker is down", type="server_error", code="unavailable")

    @app.get("/metrics")
    async def metrics():
        data = await asyncio.to_thread(generate_latest, server.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        info = server.engine.model_info
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "pagedkv", "root": info.model_source,
                                            "max_model_len": server.engine.max_context}]}

    @app.get("/debug/steps")
    async def steps(request: Request, since: int = 0):
        server.authorize(request, admin=True)
        traces = [t for t in list(server.engine.traces) if t.step >= since]
        return {"step_count": server.engine.step_count,
                "steps": [{"step": t.step, "request_ids": t.request_ids, "num_tokens": t.num_tokens,
                           "finished": t.finished, "preempted": t.preempted} for t in traces]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = server.authorize(request)
        req = parse(ChatCompletionRequest, await request.body())
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        try:
            ids = encode_prompt(server.client.tokenizer, chat_messages(req.messages))
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await _generate(server, request, tenant, req, [ids], chat=True, logprobs=logprobs,
                               max_tokens=req.max_completion_tokens or req.max_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = server.authorize(request)
        req = parse(CompletionRequest, await request.body())
        ids = []
        for p in prompts_of(req.prompt):
            try:
                ids.append(encode_prompt(server.client.tokenizer, p))
            except ValueError as e:
                raise bad_request(str(e), "prompt") from None
        return await _generate(server, request, tenant, req, ids, chat=False, logprobs=req.logprobs,
                               max_tokens=req.max_tokens)

    return app


def _lifespan(server: Server):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(_status_log(server))
        try:
            yield
        finally:
            task.cancel()

    return lifespan


async def _status_log(server: Server) -> None:
    """vLLM's periodic line: throughput, running and waiting requests, KV usage, prefix hit rate."""
    last, last_t = list(server.metrics.totals), time.monotonic()
    last_q = last_h = 0
    while True:
        await asyncio.sleep(STATUS_INTERVAL)
        sched, now = server.engine.scheduler, time.monotonic()
        totals = list(server.metrics.totals)
        if totals == last and not sched.running and not sched.waiting:
            last_t = now
            continue
        try:
            stats = await asyncio.to_thread(server.client.memory.stats)
            usage = stats.used_blocks / stats.total_blocks if stats.total_blocks else 0.0
            dq, dh = stats.prefix_cache_queries - last_q, stats.prefix_cache_hits - last_h
            last_q, last_h = stats.prefix_cache_queries, stats.prefix_cache_hits
        except ServiceError:
            usage, dq, dh = float("nan"), 0, 0
        dt = max(now - last_t, 1e-9)
        log.info("status", prompt_throughput=f"{(totals[0] - last[0]) / dt:.1f} tokens/s",
                 generation_throughput=f"{(totals[1] - last[1]) / dt:.1f} tokens/s", running=len(sched.running),
                 waiting=len(sched.waiting), kv_cache_usage=f"{usage:.1%}",
                 prefix_cache_hit_rate=f"{dh / dq:.1%}" if dq else "n/a")
        last, last_t = totals, now


def _sampling(server: Server, req, prompt_ids: list[list[int]], logprobs: int | None,
              max_tokens: int | None) -> list[SamplingParams]:
    """Sampling parameters per prompt; an unset ``max_tokens`` is the rest of the context (vLLM).

    Raises:
        APIError: 400 for a prompt that leaves no room in the context, or a bad value.
    """
    limit = server.engine.max_context
    out = []
    for ids in prompt_ids:
        if len(ids) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{len(ids)} input tokens. Please reduce the length of the input.",
                              "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        mt = max_tokens if max_tokens is not None else limit - len(ids)
        if len(ids) + mt > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(ids) + mt} tokens ({len(ids)} in the input, {mt} in the completion). Please reduce "
                              "the length of the input or of the completion.", "max_tokens")
        try:
            out.append(SamplingParams(
                max_tokens=mt, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=max(0, req.top_k or 0), seed=req.seed,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, n=req.n, logprobs=logprobs))
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
    return out


def _service_error(e: Exception) -> APIError:
    """The HTTP error for a request the engine failed."""
    if isinstance(e, OutOfBlocks):
        return APIError(400, f"the request does not fit the KV-cache pool: {e.message}", param="max_tokens")
    if isinstance(e, ServiceError):
        return APIError(503, f"the backends failed the request: {e}", type="server_error", code="unavailable")
    return APIError(500, f"the engine failed the request: {e}", type="server_error")


async def _generate(server: Server, request: Request, tenant: str, req, prompt_ids: list[list[int]], *, chat: bool,
                    logprobs: int | None, max_tokens: int | None):
    if req.model is not None and req.model != server.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
    params = _sampling(server, req, prompt_ids, logprobs, max_tokens)
    sched = server.engine.scheduler
    if len(sched.waiting) + len(prompt_ids) > server.max_queued_requests:
        raise APIError(429, f"the waiting queue is full ({len(sched.waiting)} requests wait; "
                       f"--max-queued-requests {server.max_queued_requests})", type="rate_limit_error",
                       code="queue_full")
    if not await asyncio.to_thread(server.backends.healthy):
        raise APIError(503, "the memory service or every worker is down", type="server_error", code="unavailable")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = Choices(rid, server.model_name, chat, req.n, server.client.tokenizer, logprobs,
                      req.return_tokens_as_token_ids, req.return_token_ids)
    run = _Run(server, rid, len(prompt_ids))
    salt = server.cache_salt(tenant, req.cache_salt)
    try:
        for i, (ids, sp) in enumerate(zip(prompt_ids, params)):
            server.client.submit(ids, sp, cache_salt=salt, request_id=run.ids[i], listener=run.listener(i))
    except ValueError as e:
        run.abort()
        raise bad_request(str(e), "messages" if chat else "prompt") from None
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_stream(run, choices, include_usage), media_type="text/event-stream")
    waiter = asyncio.create_task(run.wait())
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiter.done():
            waiter.cancel()
            run.abort()
    if not waiter.done() or waiter.cancelled():
        return Response(status_code=499)
    outputs, error = waiter.result()
    if error is not None:
        raise _service_error(error)
    return JSONResponse(choices.reply(outputs))


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Run:
    """One HTTP request's engine requests (one per prompt) and the queue their outputs arrive on."""

    def __init__(self, server: Server, rid: str, num_prompts: int):
        self.server = server
        self.ids = [rid] if num_prompts == 1 else [f"{rid}-{i}" for i in range(num_prompts)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.last: list[RequestOutput | None] = [None] * num_prompts
        self.done = [False] * num_prompts

    def listener(self, i: int):
        rid = self.ids[i]

        def publish(out: RequestOutput | None, error: Exception | None) -> None:  # engine thread
            self.server.metrics.observe(rid, out, error)
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, out, error))
            except RuntimeError:  # the event loop is closed (shutdown)
                pass

        return publish

    async def next(self) -> tuple[dict[int, RequestOutput], Exception | None]:
        """The newest output of each prompt that changed (waits for at least one), or an error."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        newest: dict[int, RequestOutput] = {}
        for i, out, error in items:
            if error is not None:
                self.done[i] = True
                return newest, error
            if out is not None:
                newest[i] = self.last[i] = out
                self.done[i] = self.done[i] or out.finished
        return newest, None

    async def wait(self) -> tuple[list[RequestOutput], Exception | None]:
        while not all(self.done):
            _, error = await self.next()
            if error is not None:
                self.abort()
                return [], error
        return self.last, None

    def abort(self) -> None:
        """Abort every prompt that has not finished (the engine frees their blocks at its next step)."""
        for rid, done in zip(self.ids, self.done):
            if not done:
                self.server.client.engine.abort(rid)


async def _stream(run: _Run, choices: Choices, include_usage: bool):
    """SSE: a ``data:`` chunk per change, then the usage chunk when asked, then ``data: [DONE]``."""
    try:
        while not all(run.done):
            newest, error = await run.next()
            for i, out in sorted(newest.items()):
                for chunk in choices.chunks(i, out):
                    yield f"data: {json.dumps(chunk)}\n\n"
            if error is not None:
                run.abort()
                yield f"data: {json.dumps(_service_error(error).body())}\n\n"
                break
        else:
            if include_usage:
                yield f"data: {json.dumps(choices.usage_chunk(run.last))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        run.abort()
