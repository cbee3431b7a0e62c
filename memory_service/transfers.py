"""A node's side of node transfers: its workers' transfer sources, the tickets it signs, the tickets it takes.

DESIGN.md, "Nodes" and "Tiers and transfers"; :mod:`pagedkv.runtime.transfer` has the trust argument.
Moving a prompt's cached blocks from node A to node B (a cross-node prefix pull, or a request
prefilled on A and decoded on B)::

    scheduler --ExportPrefix--> A: pins the blocks as a sequence of the scheduler's lease on A,
                                   signs a ticket (ids, epochs, hashes, layout, model, A's source)
    scheduler --AllocateSequences(remote_prefix=ticket)--> B: checks the ticket, gives the blocks
                                   past B's own cached prefix fresh device blocks and node
                                   transfers (MEDIUM_REMOTE copies naming A's source by digest)
    scheduler --Step(transfer_sources=[A's source])--> B's worker: reads A's blocks over NIXL
                                   before any write of the step, signs a receipt listing them
    scheduler --AppendSlots/CommitComputedTokens(receipt)--> B: the blocks are proven (and enter
                                   B's prefix cache); FreeSequences on A drops the pin

The memory services never touch KV bytes; a failure anywhere leaves B's blocks unproven (freed
with their sequence) and A's pinned until its sequence or lease goes.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

from memory_service.manager.requests import RemotePrefix
from memory_service.manager.sequence import Sequence
from pagedkv.config import FP8
from pagedkv.grant.v1 import grant_pb2
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.runtime.errors import (
    TRANSFER_TICKET_REFUSED,
    TRANSFERS_OFF,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.transfer import layouts_match, sign_source, sign_ticket, source_digest, ticket_signed

log = get_logger("transfers")

#: Most transfer sources one node keeps (one per worker; a worker that publishes again replaces its own).
MAX_SOURCES = 16
#: Seconds a source stays live without being published again (workers publish every
#: :data:`compute_service.main.SOURCE_REFRESH` seconds): a dead worker's source leaves the tickets.
SOURCE_TTL = 30.0
#: Longest agent name and agent metadata a source may carry, characters / bytes (NIXL's metadata of a
#: UCX agent over one registration is a few KiB): every source fits GetPoolDescriptor's reply.
MAX_AGENT_NAME = 256
MAX_AGENT_METADATA = 64 << 10


class NodeTransfers:
    """This node's transfer sources, and its transfer key's tickets.

    Args:
        node_name: this node's name in its deployment.
        descriptor: this node's pool descriptor (layout, generation, model).
        key: the deployment's transfer key (32 bytes), or None: this node takes no part.
        wall_clock: Unix time in seconds (tickets expire in wall time: other nodes compare).
    """

    def __init__(self, node_name: str, descriptor: pb.PoolDescriptor, key: bytes | None,
                 wall_clock: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic):
        self.node_name = node_name
        self.descriptor = descriptor
        self.key = key
        self.wall_clock, self.clock = wall_clock, clock
        #: Published sources by agent name, in publication order (the newest is exported).
        self._sources: dict[str, grant_pb2.TransferSource] = {}
        #: When (``clock``) each source was last published.
        self._published: dict[str, float] = {}

    @property
    def sources(self) -> dict[str, grant_pb2.TransferSource]:
        """The live sources by agent name, in publication order (the newest is exported)."""
        self._drop_stale()
        return self._sources

    def publish(self, request: pb.PublishTransferSourceRequest, plane_key: bytes) -> None:
        """Keep a worker's source for this generation (its agent name replaces an older one, and
        publishing it again keeps it live), or drop it (``request.withdraw``).

        Raises:
            FailedPreconditionError: another pool generation (the worker maps a stale pool).
            PermissionDeniedError: its signature is not made with this generation's ``plane_key``
                (pagedkv.runtime.transfer.sign_source): the caller is not a worker mapping the pool.
            InvalidArgumentError: a source that does not describe this pool, or too large.
        """
        generation, source, withdraw = request.pool_generation, request.source, request.withdraw
        d = self.descriptor
        if generation != d.generation:
            raise FailedPreconditionError(f"PublishTransferSource: pool generation {generation} is not this pool's "
                                          f"({d.generation}); map the current pool and publish again")
        if not hmac.compare_digest(request.signature, sign_source(plane_key, generation, source, withdraw)):
            raise PermissionDeniedError("PublishTransferSource: the signature is not made with this pool generation's "
                                        "plane key; only a worker that maps the pool may publish its transfer source")
        if withdraw:
            if self._sources.pop(source.agent_name, None) is not None:
                self._published.pop(source.agent_name, None)
                log.info("transfer_source_withdrawn", agent=source.agent_name)
            return
        if not 0 < len(source.agent_name) <= MAX_AGENT_NAME or not 0 < len(source.agent_metadata) <= MAX_AGENT_METADATA:
            raise InvalidArgumentError(f"PublishTransferSource: the agent name must have 1 to {MAX_AGENT_NAME} "
                                       f"characters and its metadata 1 to {MAX_AGENT_METADATA} bytes")
        if source.mem_type not in ("", "DRAM", "VRAM"):
            raise InvalidArgumentError(
                f"PublishTransferSource: mem_type must be DRAM or VRAM, got {source.mem_type[:16]!r}"
            )
        if source.num_blocks != d.layout.num_blocks or source.block_bytes != d.block_nbytes or not source.base_address:
            raise InvalidArgumentError(
                f"PublishTransferSource: the source describes {source.num_blocks} blocks of {source.block_bytes} bytes "
                f"at {source.base_address:#x}; this pool has {d.layout.num_blocks} blocks of {d.block_nbytes} bytes"
            )
        self._sources.pop(source.agent_name, None)
        self._drop_stale()
        if len(self._sources) >= MAX_SOURCES:
            self._published.pop(self._sources.pop(next(iter(self._sources))).agent_name, None)
        self._sources[source.agent_name] = source
        self._published[source.agent_name] = self.clock()

    def _drop_stale(self) -> None:
        """Forget the sources not published again within :data:`SOURCE_TTL` (their workers are gone)."""
        now = self.clock()
        for name in [n for n, at in self._published.items() if now - at > SOURCE_TTL]:
            self._sources.pop(name, None)
            del self._published[name]
            log.info("transfer_source_expired", agent=name)

    def require(self, what: str) -> None:
        """Refuse ``what`` unless this node takes part in transfers (a transfer key).

        Raises:
            FailedPreconditionError: reason TRANSFERS_OFF.
        """
        if self.key is None:
            raise FailedPreconditionError(
                f"{what}: this memory service takes no part in node transfers; start every memory service of the "
                "deployment with the same --transfer-key-file",
                reason=TRANSFERS_OFF,
            )

    def require_export(self) -> None:
        """Refuse ExportPrefix unless this node takes part in transfers and its blocks can be taken
        (before anything is pinned for it).

        Raises:
            FailedPreconditionError: reason TRANSFERS_OFF, no key or an fp8 pool.
        """
        self.require("ExportPrefix")
        if self.descriptor.layout.dtype == FP8.name:
            raise FailedPreconditionError(
                "ExportPrefix: this pool holds fp8 KV, which reads right only with the scales it was written with; "
                "tickets do not carry a node's scales, so fp8 pools take no part in node transfers",
                reason=TRANSFERS_OFF,
            )

    def ticket(self, seq: Sequence, ttl: float, epochs) -> pb.TransferTicket:
        """The signed ticket for ``seq``, an export's pinning sequence, valid ``ttl`` seconds (its lease's TTL).

        Raises:
            FailedPreconditionError: reason TRANSFERS_OFF, no key, an fp8 pool or no worker published a source.
        """
        self.require_export()
        self._drop_stale()
        if not self._sources:
            raise FailedPreconditionError(
                "ExportPrefix: no live worker of this node has published a transfer source (workers publish one when "
                "they map the pool with node transfers on, and again every few seconds); start a worker, or retry "
                "shortly",
                reason=TRANSFERS_OFF,
            )
        d = self.descriptor
        t = pb.TransferTicket(
            node_name=self.node_name,
            pool_generation=d.generation,
            layout=d.layout,
            block_ids=seq.block_ids,
            block_epochs=[int(epochs[b]) for b in seq.block_ids],
            block_hashes=seq.block_hashes,
            source=next(reversed(self._sources.values())),
            expires_at=self.wall_clock() + ttl,
            model=d.model,
        )
        return sign_ticket(self.key, t)

    def take(self, t: pb.TransferTicket) -> RemotePrefix:
        """A checked ticket, typed, for an allocation.

        Raises:
            FailedPreconditionError: reason TRANSFERS_OFF (no key here); reason TRANSFER_TICKET_REFUSED:
                another layout, dtype, block size or model, this node's own ticket, or expired.
            PermissionDeniedError: not signed with this deployment's transfer key.
            InvalidArgumentError: a malformed ticket.
        Every refusal of the ticket itself carries reason TRANSFER_TICKET_REFUSED (or TRANSFERS_OFF): a
        scheduler allocates again without it.
        """
        self.require("AllocateSequences with remote_prefix")
        if not ticket_signed(self.key, t):
            raise PermissionDeniedError(
                "AllocateSequences: the remote_prefix ticket is not signed with this "
                "deployment's transfer key; pass ExportPrefix's ticket unchanged (nothing "
                "was allocated)",
                reason=TRANSFER_TICKET_REFUSED,
            )
        d = self.descriptor
        why = None
        if not layouts_match(t.layout, d.layout) or t.source.block_bytes != d.block_nbytes:
            why = (
                f"its pool holds {t.layout.dtype} blocks of {t.layout.block_size} tokens x {t.layout.num_layers} "
                f"layers x {t.layout.num_kv_heads} heads x {t.layout.head_dim}; this one {d.layout.dtype} blocks of "
                f"{d.layout.block_size} x {d.layout.num_layers} x {d.layout.num_kv_heads} x {d.layout.head_dim}"
            )
        elif t.model != d.model:
            why = f"it holds KV of model {t.model!r}, this node of {d.model!r}"
        elif d.layout.dtype == FP8.name:
            why = (
                "fp8 KV reads right only with the scales it was written with, and tickets do not carry a "
                "node's scales: fp8 pools take no part in node transfers"
            )
        elif t.node_name == self.node_name:
            why = "it is this node's own (its blocks are here already)"
        elif t.expires_at < self.wall_clock():
            why = f"it expired {self.wall_clock() - t.expires_at:.1f} s ago; export the prefix again"
        if why is not None:
            raise FailedPreconditionError(
                f"AllocateSequences: the remote_prefix ticket of node {t.node_name!r} cannot "
                f"be taken: {why} (nothing was allocated)",
                reason=TRANSFER_TICKET_REFUSED,
            )
        n = len(t.block_ids)
        if len(t.block_epochs) != n or len(t.block_hashes) != n or any(b >= t.source.num_blocks for b in t.block_ids):
            raise InvalidArgumentError(
                "AllocateSequences: the remote_prefix ticket is malformed (nothing was allocated)",
                reason=TRANSFER_TICKET_REFUSED,
            )
        return RemotePrefix(
            tuple(t.block_ids), tuple(t.block_epochs), tuple(bytes(h) for h in t.block_hashes), source_digest(t.source)
        )


__all__ = ["MAX_SOURCES", "NodeTransfers"]
