"""``pagedkv serve``'s prefix-pin routes (admin key): keep a system prompt resident for a tenant.

- ``POST /admin/pins`` ``{messages | prompt, tenant | group, ttl_s, priority}``: computes the prompt
  under that tenant's (or cache-sharing group's) cache salt, as its requests would be, and pins
  its leading full blocks for ``ttl_s`` seconds (:func:`client.pins.pin_prompt`); once the pin ends
  they keep retention ``priority`` (0-100: eviction takes lower priorities first). Reply:
  ``{"pins": [...], "prompt_tokens": N}``.
- ``GET /admin/pins``: every live pin of the memory service(s).
- ``DELETE /admin/pins/{id}``: ends a pin of this server (404 for another's or an unknown one).

The pins are charged to the engine's lease (the admin's, which the operator sizes); tenants
cannot pin. Apart from ExportPrefix's transfer pins, which no route shows.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from client import pins
from client.errors import InvalidArgument, QuotaExceeded, ServiceError
from client.serve.chat_prompt import render
from client.serve.protocol import APIError, bad_request, parse_body
from client.tokenizer import encode_prompt


class PinRequest(BaseModel):
    """POST /admin/pins."""

    model_config = ConfigDict(extra="forbid", strict=True)  # as the completion routes: "10" is no number

    #: The prompt as chat messages (rendered by the chat template, as /v1/chat/completions does) ...
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    #: ... or as text or token ids (as /v1/completions takes one).
    prompt: str | list[int] | None = None
    #: Whose cache the prompt is pinned in: a tenant (its group's when it is in one), or a group.
    tenant: str | None = None
    group: str | None = None
    #: Seconds the pin lasts (required).
    ttl_s: float = Field(gt=0, le=86_400)
    #: Retention priority once the pin ends, 0-100.
    priority: int = Field(default=0, ge=0, le=100)


def add_pin_routes(app: FastAPI, server) -> None:
    """The pin routes over ``server`` (:class:`client.serve.app.Server`)."""

    @app.post("/admin/pins")
    async def pin(request: Request):
        server.authorize(request, admin=True)
        req = parse_body(PinRequest, await request.body())
        if (req.messages is None) == (req.prompt is None):
            raise bad_request("give the prompt as exactly one of messages or prompt", "messages")
        salt, label = _salt(server, req)
        if req.messages is not None:  # rendered as a chat request renders them (client.serve.chat_prompt)
            ids = await render(server, req.messages)
        else:
            try:
                ids = await asyncio.to_thread(encode_prompt, server.client.tokenizer, req.prompt)
            except ValueError as e:
                raise bad_request(str(e), "prompt") from None
        try:
            made = await asyncio.to_thread(pins.pin_prompt, server.client, ids, ttl=req.ttl_s,
                                           priority=req.priority, cache_salt=salt, label=label)
        except ValueError as e:
            raise bad_request(str(e), "messages" if req.messages is not None else "prompt") from None
        except InvalidArgument as e:
            raise bad_request(e.message) from None
        except QuotaExceeded as e:
            raise APIError(429, e.message, type="rate_limit_error", code="quota_exceeded") from None
        except ServiceError as e:
            raise APIError(503, f"the memory service did not pin the prompt: {e}", type="server_error") from None
        if not made:
            raise APIError(503, "the prompt's blocks were evicted before they could be pinned (the pool is under "
                           "pressure); try again", type="server_error")
        return {"pins": [_body(p) for p in made], "prompt_tokens": len(ids)}

    @app.get("/admin/pins")
    async def list_pins(request: Request):
        server.authorize(request, admin=True)
        try:
            return {"pins": [_body(p) for p in await asyncio.to_thread(pins.list_pins, server.client)]}
        except ServiceError as e:
            raise APIError(503, f"the memory service did not list its pins: {e}", type="server_error") from None

    @app.delete("/admin/pins/{pin_id}")
    async def unpin(pin_id: str, request: Request):
        server.authorize(request, admin=True)
        try:
            blocks = await asyncio.to_thread(pins.unpin, server.client, pin_id)
        except KeyError as e:
            raise APIError(404, str(e.args[0]), type="not_found_error", param="pin_id", code="pin_not_found") from None
        except ServiceError as e:
            raise APIError(503, f"the memory service did not end the pin: {e}", type="server_error") from None
        return {"id": pin_id, "num_blocks": blocks}


def _salt(server, req: PinRequest) -> tuple[str, str]:
    """The cache salt and label of the pin's owner (the same salt the owner's requests carry)."""
    if req.tenant is not None and req.group is not None:
        raise bad_request("give a tenant or a group, not both", "group")
    tenants = server.tenants
    if req.group is not None:
        if req.group not in set(tenants.groups.values()):
            raise APIError(404, f"no cache-sharing group {req.group!r} (--cache-sharing-group)", type="not_found_error",
                           param="group")
        return server.group_salt(req.group), f"group:{req.group}"
    tenant = req.tenant or ""
    if tenant and tenant not in set(tenants.keys.values()):
        raise APIError(404, f"no tenant {tenant!r} (--api-key, --api-keys-file)", type="not_found_error",
                       param="tenant")
    if not tenant and not tenants.open:
        raise bad_request("this server has tenants: name the tenant or group whose cache the pin is for", "tenant")
    return server.cache_salt(tenant, None), f"tenant:{tenant}" if tenant else ""


def _body(p: pins.Pin) -> dict:
    body = dataclasses.asdict(p)
    body["id"] = body.pop("pin_id")
    return body


__all__ = ["PinRequest", "add_pin_routes"]
