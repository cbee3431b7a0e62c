"""vLLM's small routes that tools probe for: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

Bodies as ``vllm serve`` (vllm/entrypoints/openai/protocol.py, ``TokenizeRequest``,
``DetokenizeRequest``): ``/tokenize`` takes ``{prompt}`` (text or token ids, as /v1/completions)
or ``{messages, add_generation_prompt, tools, chat_template_kwargs}`` (rendered by the chat
template, as /v1/chat/completions renders them)
and answers ``{count, max_model_len, tokens}`` (``token_strs`` too with ``return_token_strs``);
``/detokenize`` takes ``{tokens}`` and answers ``{prompt}``; ``/version`` answers ``{version}``.
Behind the tenant key like the OpenAI routes; the model, when named, must be the served one.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from client.serve.chat_prompt import render
from client.serve.protocol import MAX_BODY_BYTES, bad_request, check_model, parse_body
from client.tokenizer import encode_prompt

#: Most token ids /detokenize takes (a body of this many ids stays under MAX_BODY_BYTES).
MAX_DETOKENIZE_TOKENS = MAX_BODY_BYTES // 8


class TokenizeRequest(BaseModel):
    """POST /tokenize: ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    #: With ``messages``: rendered as /v1/chat/completions renders them (client.serve.chat_prompt).
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] = Field(min_length=1, max_length=MAX_DETOKENIZE_TOKENS)


def version() -> str:
    """pagedkv's version (its distribution's), or "unknown" from a source tree that is not installed."""
    try:
        return metadata.version("pagedkv")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_tokenize_routes(app: FastAPI, server) -> None:
    """The routes over ``server`` (:class:`client.serve.app.Server`)."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        server.authorize(request)
        req = parse_body(TokenizeRequest, await request.body())
        check_model(req.model, server.model_name)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        tokenizer = server.client.tokenizer
        if req.messages is not None:
            ids = await render(server, req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                               template_kwargs=req.chat_template_kwargs)
        elif req.tools is not None or req.chat_template_kwargs is not None:
            raise bad_request("tools and chat_template_kwargs go with messages", "tools")
        else:
            try:
                ids = await asyncio.to_thread(encode_prompt, tokenizer, req.prompt)
            except ValueError as e:
                raise bad_request(str(e), "prompt") from None
        body = {"count": len(ids), "max_model_len": server.client.limits.max_context, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        server.authorize(request)
        req = parse_body(DetokenizeRequest, await request.body())
        check_model(req.model, server.model_name)
        tokenizer = server.client.tokenizer
        bad = next((t for t in req.tokens if not 0 <= t < len(tokenizer)), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {len(tokenizer)})", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}

    @app.get("/version")
    async def get_version(request: Request):
        server.authorize(request)
        return {"version": version()}


__all__ = ["add_tokenize_routes"]
