"""Who may call which route of ``pagedkv serve``, by ``Authorization: Bearer KEY``.

- The OpenAI routes: a tenant's key (any caller when no API keys were given), or the admin key.
- The admin routes (``/debug/steps``, ``/admin/...``): the admin key.
- ``/metrics``: the metrics key (``--metrics-api-key``) or the admin key, when API keys or a metrics
  key were given; anyone otherwise. Its counters are pool-wide (prefix-cache hits among them), so a
  tenant reading them would learn about other tenants' requests.
- The dashboard (client.serve.dashboard.routes): the admin key, or a session from logging in with it.

Keys are compared in constant time. A wrong key (not a missing one) is counted per client address
by the server's :class:`~client.serve.dashboard.auth.KeyThrottle`, with failed dashboard logins:
past its limit a wrong key gets 429 with Retry-After instead of 401/403, and a right key is served
as ever.
"""

from __future__ import annotations

import math

from starlette.requests import Request

from client.serve.dashboard.auth import KeyThrottle, same_key
from client.serve.protocol import APIError
from client.serve.tenants import Tenants
from pagedkv.runtime.logs import get_logger

log = get_logger("serve")


def bearer_key(request: Request) -> str | None:
    """The key of the request's one ``Authorization: Bearer KEY`` header, trimmed; None when there is none.

    Raises:
        APIError: 401 for more than one Authorization header.
    """
    headers = request.headers.getlist("authorization")
    if len(headers) > 1:
        raise APIError(401, "send one Authorization header", type="authentication_error", code="invalid_api_key")
    header = headers[0] if headers else ""
    return (header[7:].strip() or None) if header[:7].lower() == "bearer " else None


def client_address(request: Request) -> str:
    """The address the key throttle counts: the TCP peer's, or the one a trusted proxy forwarded."""
    return request.client.host if request.client else ""


def throttled(wait: float) -> APIError:
    """The 429 of a wrong key past the key throttle, ``wait`` seconds (rounded up) before the next
    wrong one is answered as usual again."""
    seconds = max(1, math.ceil(wait))
    return APIError(429, f"too many wrong API keys or failed logins from this address: try again in {seconds} s",
                    type="rate_limit_error", code="too_many_wrong_keys", headers={"Retry-After": str(seconds)})


def refused_key(throttle: KeyThrottle, request: Request, error: APIError) -> APIError:
    """``error`` for a request whose key was wrong, counted by ``throttle``; past its limit the 429 of
    :func:`throttled` instead."""
    client = client_address(request)
    wait = throttle.refuse(client)
    if wait <= 0:
        log.warning("api_key_refused", client=client, path=request.url.path, status=error.status)
        return error
    return throttled(wait)


def authorize(tenants: Tenants, throttle: KeyThrottle, request: Request, *, admin: bool = False) -> str:
    """The caller's tenant: "admin" for the admin key, "" on a server without API keys.

    Raises:
        APIError: 401 no or unknown key; 403 not the admin key on an admin route (``admin``), or no
            admin key configured; 429 a wrong key from an address past the key throttle.
    """
    key = bearer_key(request)
    if admin:
        if tenants.admin_key is None:
            raise APIError(403, "this route needs --admin-api-key, which the server was started without",
                           type="permission_error")
        if same_key(key, tenants.admin_key):
            return "admin"
        if key is None:
            raise APIError(401, "this route needs the admin API key", type="authentication_error")
        raise refused_key(throttle, request, APIError(403, "this route needs the admin API key",
                                                      type="permission_error"))
    tenant = tenants.tenant_of(key)
    if tenant is not None:
        return tenant
    if key is None:
        raise APIError(401, "Missing API key: send 'Authorization: Bearer KEY'.", type="authentication_error",
                       code="invalid_api_key")
    raise refused_key(throttle, request, APIError(401, "Incorrect API key provided.", type="authentication_error",
                                                  code="invalid_api_key"))


def authorize_metrics(tenants: Tenants, throttle: KeyThrottle, request: Request) -> None:
    """Let the caller read ``/metrics``: anyone while :attr:`Tenants.metrics_open`, else the metrics
    key's or the admin key's holder.

    Raises:
        APIError: 401 no or unknown key, 403 a tenant's key, 429 a wrong key from an address past the
            key throttle.
    """
    if tenants.metrics_open:
        return
    key = bearer_key(request)
    if same_key(key, tenants.metrics_key) or same_key(key, tenants.admin_key):
        return
    message = "/metrics needs the metrics API key (--metrics-api-key) or the admin API key"
    if key is None:
        raise APIError(401, message, type="authentication_error")
    error = (APIError(403, message, type="permission_error") if tenants.tenant_of(key) is not None
             else APIError(401, message, type="authentication_error", code="invalid_api_key"))
    raise refused_key(throttle, request, error)


__all__ = ["authorize", "authorize_metrics", "bearer_key", "client_address", "refused_key", "throttled"]
