"""One HTTP generation request over the shared engine: its prompts become engine requests, their
outputs come back on an ``asyncio.Queue``, and leave as one reply or as SSE chunks.

A client that disconnects aborts its request: a stream's generator is cancelled by Starlette
(ASGI 2.3 disconnect listener) and aborts in its ``finally``; a non-streamed request races its
result against ``http.disconnect``. The engine frees the blocks at its next step.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from client.api import RequestOutput
from client.errors import OutOfBlocks, ServiceError
from client.params import SamplingParams
from client.serve import beam
from client.serve.outputs import Choices
from client.serve.protocol import APIError, ChatCompletionRequest, bad_request, check_model, logit_bias
from client.serve.structured_request import structured_outputs_of
from client.serve.tools.plan import ToolPlan, constrain
from client.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from client.serve.app import Server


def _sampling(server: Server, req, prompt_ids: list[list[int]], logprobs: int | None,
              max_tokens: int | None, structured: StructuredOutputsParams | None = None) -> list[SamplingParams]:
    """Sampling parameters per prompt; an unset ``max_tokens`` is the rest of the context (vLLM); an
    unset ``temperature``, ``top_p``, ``top_k`` or ``repetition_penalty`` is the model's default
    (the engine applies it at admission); unset penalties, min_p and min_tokens are 0. With
    ``use_beam_search``, ``n`` beams (client.serve.beam.fields).

    Raises:
        APIError: 400 for a prompt that leaves no room in the context, or a bad value (``logit_bias``
            naming a token outside the vocabulary, a ``min_tokens`` over ``max_tokens``...).
    """
    limit = server.client.limits.max_context
    bias = logit_bias(req.logit_bias, server.client.limits.model_info.vocab_size)
    out = []
    for ids in prompt_ids:
        if len(ids) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{len(ids)} input tokens. Please reduce the length of the input.",
                              "messages" if isinstance(req, ChatCompletionRequest) else "prompt")
        mt = max_tokens if max_tokens is not None else limit - len(ids)
        _check_fits(server, req, len(ids), mt)
        if len(ids) + mt > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + mt} tokens ({len(ids)} in the input, {mt} in the completion). Please reduce "
                "the length of the input or of the completion.",
                "max_tokens",
            )
        fields = dict(
            max_tokens=mt,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=None if req.top_k is None else max(0, req.top_k),
            seed=req.seed,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            min_p=req.min_p or 0.0,
            logit_bias=bias,
            min_tokens=req.min_tokens or 0,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            n=req.n,
            logprobs=logprobs,
            length_penalty=req.length_penalty,
            structured_outputs=structured,
        )
        if req.use_beam_search:
            fields.update(beam.fields(req))
        try:
            out.append(SamplingParams(**fields))
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
    return out


async def _compile_grammars(server: Server, params: list[SamplingParams], param: str) -> None:
    """Compile each distinct output constraint of ``params`` (the engine's cache keeps it for
    admission) in a worker thread: the event loop never waits on a grammar.

    Raises:
        APIError: 400 naming ``param`` for a constraint that does not compile (bad syntax, an
            unsatisfiable schema, over the size limits).
    """
    specs = {p.structured_outputs.key(): p.structured_outputs for p in params if p.structured_outputs is not None}
    for spec in specs.values():
        try:
            await asyncio.to_thread(server.client.engine.grammars.compile, spec)
        except ValueError as e:
            raise bad_request(str(e), param) from None


def _check_fits(server: Server, req, prompt_len: int, max_tokens: int) -> None:
    """Refuse at once what the pool can never hold, even with the prompt's full blocks shared by
    the ``n`` samples: the first token of every sample, or (with ``ignore_eos``) all ``max_tokens``.

    Raises:
        APIError: 400 naming ``n`` or ``max_tokens``.
    """
    bs, total = server.client.limits.block_size, server.client.limits.num_blocks
    shared = prompt_len // bs  # full prompt blocks, shared after the fork

    def need(length: int) -> int:
        return shared + req.n * (-(-length // bs) - shared)

    if need(prompt_len + 1) > total:
        raise bad_request(
            f"{req.n} samples of a {prompt_len}-token prompt need at least {need(prompt_len + 1)} KV "
            f"blocks; the pool has {total}",
            "n",
        )
    if req.ignore_eos and need(prompt_len + max_tokens) > total:
        raise bad_request(
            f"{req.n} x {max_tokens} tokens after a {prompt_len}-token prompt (ignore_eos) need "
            f"{need(prompt_len + max_tokens)} KV blocks; the pool has {total}",
            "max_tokens",
        )


def _service_error(e: Exception) -> APIError:
    """The HTTP error for a request the engine failed."""
    if isinstance(e, OutOfBlocks):
        return APIError(400, f"the request does not fit the KV-cache pool: {e.message}", param="max_tokens")
    if isinstance(e, ServiceError):
        return APIError(503, f"the backends failed the request: {e}", type="server_error", code="unavailable")
    return APIError(500, f"the engine failed the request: {e}", type="server_error")


async def generate(
    server: Server,
    request: Request,
    tenant: str,
    req,
    prompt_ids: list[list[int]],
    *,
    chat: bool,
    logprobs: int | None,
    max_tokens: int | None,
    tools: ToolPlan | None = None,
):
    """Run one parsed request (``prompt_ids``: one token-id list per prompt) for ``tenant``.

    Returns the whole reply (JSON), an SSE ``StreamingResponse`` when ``req.stream``, or 499 when
    the client left first (its engine requests are aborted). ``tools``: a chat request's tool
    plan (its outputs constrained and read as calls).

    Raises:
        APIError: 404 unknown model; 400 a prompt or sampling value that cannot run; 429 the
            waiting queue is full; 503 the backends are down or failed the request.
    """
    check_model(req.model, server.model_name)
    if req.use_beam_search:
        beam.check(req, chat, tools)
    structured = structured_outputs_of(req.response_format, req.structured_outputs)
    params = _sampling(server, req, prompt_ids, logprobs, max_tokens, structured)
    param = "structured_outputs" if req.structured_outputs else "response_format"
    if tools is not None and tools.schema is not None:  # tool_choice "required" or named (client.serve.tools)
        params, param = constrain(tools, params), "tools"
    await _compile_grammars(server, params, param)
    weight = _admit(server, tenant, prompt_ids, params)
    if not await server.backends_up():
        raise APIError(503, "the memory service or every worker is down", type="server_error", code="unavailable")
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = Choices(
        rid,
        server.model_name,
        chat,
        req.n,
        server.client.tokenizer,
        logprobs,
        req.return_tokens_as_token_ids,
        req.return_token_ids,
        tools=tools,
        final_only=req.use_beam_search,
    )
    if req.priority and server.scheduling_policy != "priority":  # vLLM's refusal, before anything is queued
        raise bad_request(f"priority={req.priority}: priority scheduling is not enabled; start pagedkv serve with "
                          "--scheduling-policy priority, or send priority 0", "priority")
    run = _Run(server, rid, len(prompt_ids), tenant, weight)
    salt = server.cache_salt(tenant, req.cache_salt)
    try:
        for i, (ids, sp) in enumerate(zip(prompt_ids, params)):
            server.client.submit(ids, sp, cache_salt=salt, request_id=run.ids[i], listener=run.listener(i),
                                 priority=req.priority or 0)
    except ValueError as e:
        run.close()
        raise bad_request(str(e), "messages" if chat else "prompt") from None
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        # The background task closes the run even when the client left before the body began.
        return StreamingResponse(
            _stream(run, choices, include_usage), media_type="text/event-stream", background=BackgroundTask(run.close)
        )
    waiter = asyncio.create_task(run.wait())
    gone = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiter.done():
            waiter.cancel()
        run.close()
    if not waiter.done() or waiter.cancelled():
        return Response(status_code=499)
    outputs, error = waiter.result()
    if error is not None:
        raise _service_error(error)
    return JSONResponse(choices.reply(outputs))


def _admit(server: Server, tenant: str, prompt_ids: list[list[int]], params: list) -> int:
    """Check a request against the waiting queue's and its tenant's limits; return its weight in
    sequences (n samples or beams per prompt).

    Raises:
        APIError: 400 more prompts than the queue holds; 429 the queue or the tenant's share is full.
    """
    waiting = server.client.engine_stats().num_waiting
    if len(prompt_ids) > server.max_queued_requests:
        raise bad_request(
            f"{len(prompt_ids)} prompts in one request; the server queues at most "
            f"{server.max_queued_requests} (--max-queued-requests)",
            "prompt",
        )
    if waiting + len(prompt_ids) > server.max_queued_requests:
        raise APIError(
            429,
            f"the waiting queue is full ({waiting} requests wait; --max-queued-requests {server.max_queued_requests})",
            type="rate_limit_error",
            code="queue_full",
        )
    limit = server.max_requests_per_tenant
    weight = sum(max(p.n, p.num_beams) for p in params)  # sequences: n samples or beams count each
    if limit is not None and tenant and server.in_flight[tenant] + weight > limit:
        raise APIError(
            429,
            f"tenant {tenant!r} has {server.in_flight[tenant]} sequences in flight and this request "
            f"adds {weight} (n samples or beams per prompt); --max-requests-per-tenant {limit}",
            type="rate_limit_error",
            code="tenant_limit",
        )
    return weight


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Run:
    """One HTTP request's engine requests (one per prompt) and the queue their outputs arrive on."""

    def __init__(self, server: Server, rid: str, num_prompts: int, tenant: str, weight: int):
        self.server, self.tenant, self.closed, self.weight = server, tenant, False, weight
        self.ids = [rid] if num_prompts == 1 else [f"{rid}-{i}" for i in range(num_prompts)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.last: list[RequestOutput | None] = [None] * num_prompts
        self.done = [False] * num_prompts
        server.runs.add(self)
        server.in_flight[tenant] += weight

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

    def fail(self, error: Exception) -> None:
        """End the run with ``error`` as if the engine had failed it (any thread, or a signal handler)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (0, None, error))

    def close(self) -> None:
        """Abort what has not finished and forget the run (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        self.abort()
        self.server.runs.discard(self)
        self.server.in_flight[self.tenant] -= self.weight
        if self.server.in_flight[self.tenant] <= 0:
            del self.server.in_flight[self.tenant]

    def abort(self) -> None:
        """Abort every prompt that has not finished (the engine frees their blocks at its next step)."""
        for rid, done in zip(self.ids, self.done):
            if not done:
                self.server.client.abort(rid)


async def _stream(run: _Run, choices: Choices, include_usage: bool):
    """SSE: a ``data:`` chunk per change, then the usage chunk when asked, then ``data: [DONE]``."""
    try:
        while not all(run.done):
            newest, error = await run.next()
            for i, out in sorted(newest.items()):
                for chunk in choices.chunks(i, out):
                    yield f"data: {_json(chunk)}\n\n"
            if error is not None:
                run.abort()
                yield f"data: {_json(_service_error(error).body())}\n\n"
                break
        else:
            if include_usage:
                yield f"data: {_json(choices.usage_chunk(run.last))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        run.close()


def _json(body: dict) -> str:
    """Compact JSON for one SSE event."""
    return json.dumps(body, separators=(",", ":"))
