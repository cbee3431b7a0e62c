"""The prefix-pin RPCs of the memory service: PinPrefix, UnpinPrefix (a lease's secret) and
ListPins (admin), over :mod:`memory_service.manager.pins`.

A mixin of :class:`memory_service.server.MemoryServicer` (it reads its ``manager`` and
``authz``); errors map to codes as every RPC's do (:func:`pagedkv.runtime.service.map_errors`).
"""

from __future__ import annotations

from memory_service.authz import Authorizer
from memory_service.manager.block_manager import BlockManager
from memory_service.manager.pins import PrefixPin
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.service import map_errors


@map_errors
class PinRpcs:
    """PinPrefix, UnpinPrefix and ListPins (mixed into ``MemoryServicer``)."""

    manager: BlockManager
    authz: Authorizer

    async def PinPrefix(self, request, context):
        self.authz.lease(context, request.lease_id)
        pin = self.manager.pin_prefix(request.lease_id, request.token_ids, CacheKey(request.model_id,
                                      request.cache_salt), request.ttl_seconds, request.priority, request.label)
        return pb.PinPrefixResponse(pin=self._pin_message(pin) if pin is not None else None)

    async def UnpinPrefix(self, request, context):
        self.authz.lease(context, request.lease_id)
        return pb.UnpinPrefixResponse(num_blocks=self.manager.unpin_prefix(request.lease_id, request.pin_id))

    async def ListPins(self, request, context):
        self.authz.require_admin(context, "ListPins")
        return pb.ListPinsResponse(pins=[self._pin_message(p) for p in self.manager.live_pins()])

    def _pin_message(self, pin: PrefixPin) -> pb.PrefixPin:
        seq = self.manager.sequences[pin.seq_id]
        return pb.PrefixPin(pin_id=pin.pin_id, lease_id=pin.lease_id, num_tokens=pin.num_tokens,
                            block_ids=seq.block_ids, priority=pin.priority, label=pin.label, seq_id=pin.seq_id,
                            expires_in_seconds=max(0.0, pin.expires_at - self.manager.leases.clock()))


__all__ = ["PinRpcs"]
