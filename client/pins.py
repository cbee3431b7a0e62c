"""Prefix pins from the client side: warm a prompt's KV, then keep it resident (PinPrefix).

What ``pagedkv serve``'s admin routes (``/admin/pins``) call. A pin keeps the prompt's leading full
blocks cached on the device for a TTL, then leaves them with a retention priority
(:mod:`memory_service.manager.pins`). The prompt is computed first (one greedy token, discarded)
so that its blocks are cached, then pinned under the same model identity and cache salt as the
requests that will reuse it. The pin is charged to the engine's lease and ends with it (a lease
lost to an outage takes its pins along). With several nodes (a :class:`~client.cluster.core.Cluster`)
the prompt is warmed and pinned on every node.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.errors import NotFound
from client.params import SamplingParams
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.cache_salt import salted


@dataclass(frozen=True, slots=True)
class Pin:
    """A live prefix pin on one node."""

    #: Its id (``pin-<hex>``).
    pin_id: str
    #: The node it is on ("" for a single memory service).
    node: str
    #: Tokens pinned (whole blocks).
    num_tokens: int
    #: Blocks pinned.
    num_blocks: int
    #: Retention priority once unpinned, 0-100.
    priority: int
    #: Seconds until it ends.
    expires_in_seconds: float
    #: Its label (``tenant:<name>`` or ``group:<name>`` from the admin routes).
    label: str

    @classmethod
    def of(cls, node: str, p: mpb.PrefixPin) -> Pin:
        return cls(p.pin_id, node, p.num_tokens, len(p.block_ids), p.priority, round(p.expires_in_seconds, 3),
                   p.label)


def _clients(backend) -> list[tuple[str, object]]:
    """(node name, Client) of a Client ("") or of each node of a Cluster."""
    nodes = getattr(backend, "nodes", None)
    return [(name, n.client) for name, n in nodes.items()] if nodes is not None else [("", backend)]


def pin_prompt(backend, prompt_ids: list[int], *, ttl: float, priority: int = 0, cache_salt: str | None = None,
               label: str = "") -> list[Pin]:
    """Compute ``prompt_ids`` (cached as a request with ``cache_salt`` would be) and pin its leading
    full blocks for ``ttl`` seconds on every node; the pins made (none where nothing stayed cached).

    Raises:
        ValueError: a prompt with no full block before its last token.
        client.errors.ServiceError: the memory service refused the pin (InvalidArgument for a ttl or
            priority out of range, QuotaExceeded past the lease's quota).
    """
    limits = backend.limits
    if len(prompt_ids) - 1 < limits.block_size:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; a pin keeps the whole blocks of "
                         f"{limits.block_size} tokens before its last token: give a longer prompt")
    if getattr(backend, "nodes", None) is not None:  # the cluster's namespace first, as its submit does
        cache_salt = salted(backend.cache_namespace, cache_salt)
    pins = []
    for node, client in _clients(backend):
        client.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                        cache_salt=cache_salt)
        pin = client.memory.pin_prefix(client.lease_id, prompt_ids, ttl=ttl, priority=priority,
                                       model_id=client.engine.model_id,
                                       cache_salt=salted(client.cache_namespace, cache_salt), label=label)
        if pin is not None:
            pins.append(Pin.of(node, pin))
    return pins


def unpin(backend, pin_id: str) -> int:
    """End pin ``pin_id`` of this backend's lease(s); returns the blocks it held.

    Raises:
        KeyError: no such pin of this backend's leases.
    """
    for _, client in _clients(backend):
        try:
            return client.memory.unpin_prefix(client.lease_id, pin_id)
        except NotFound:
            continue
    raise KeyError(f"no pin {pin_id[:80]!r} of this server; GET /admin/pins lists them")


def list_pins(backend) -> list[Pin]:
    """Every live prefix pin of this backend's memory services (every lease's: the admin's view)."""
    return [Pin.of(node, p) for node, client in _clients(backend) for p in client.memory.list_pins()]


__all__ = ["Pin", "list_pins", "pin_prompt", "unpin"]
