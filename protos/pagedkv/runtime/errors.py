"""Errors every pagedkv service raises, each tied to one gRPC status code.

DESIGN.md, "Errors": one meaning per code. Misuse raises one of these with an
actionable message; a capacity shortfall is a typed result inside the block
manager that the server turns into :class:`OutOfBlocksError`; a broken invariant
is an ``AssertionError`` that the server maps to INTERNAL.
"""

from __future__ import annotations

import grpc

#: ErrorInfo domain of every pagedkv error.
ERROR_DOMAIN = "pagedkv.dev"
#: ErrorInfo reason of a block shortfall (clients act on it, not on the code alone).
OUT_OF_BLOCKS = "OUT_OF_BLOCKS"
#: ErrorInfo reason of a call on a lease the memory service does not know (never issued, released,
#: or issued before the service restarted): the caller creates a new lease.
LEASE_NOT_FOUND = "LEASE_NOT_FOUND"
#: ErrorInfo reason of a call on a lease that expired (no keep-alive within its TTL): its sequences are gone.
LEASE_EXPIRED = "LEASE_EXPIRED"
#: ErrorInfo reason (INVALID_ARGUMENT, in a StepResult's error) of a sequence that reaches past the model's
#: sliding window: nothing of it was computed.
PAST_SLIDING_WINDOW = "PAST_SLIDING_WINDOW"
#: ErrorInfo reason of a Step that names a pool generation other than the one the worker maps.
POOL_GENERATION_MISMATCH = "POOL_GENERATION_MISMATCH"
#: ErrorInfo reason of a Step on a worker that maps no pool (the memory service is gone or restarting).
POOL_NOT_MAPPED = "POOL_NOT_MAPPED"
#: ErrorInfo reason (RESOURCE_EXHAUSTED) of a swap-out the host tier cannot hold: preempt by recompute instead.
OUT_OF_HOST_BLOCKS = "OUT_OF_HOST_BLOCKS"
#: ErrorInfo reason (FAILED_PRECONDITION) of a swap-out on a memory service without a host tier.
HOST_TIER_OFF = "HOST_TIER_OFF"
#: ErrorInfo reason (FAILED_PRECONDITION) of a swap-in whose block left the device with no proven host copy:
#: free the sequence and recompute it.
SWAP_LOST = "SWAP_LOST"
#: ErrorInfo reason (FAILED_PRECONDITION) of ExportPrefix, or of an allocation with a transfer ticket, on a
#: memory service that takes no part in node transfers (no --transfer-key-file, or no worker published a source).
TRANSFERS_OFF = "TRANSFERS_OFF"
#: ErrorInfo reason of a transfer ticket this node cannot take: another layout, dtype or model, expired, this
#: node's own (FAILED_PRECONDITION), not signed with the deployment's key (PERMISSION_DENIED), malformed
#: (INVALID_ARGUMENT). The scheduler allocates again without the ticket.
TRANSFER_TICKET_REFUSED = "TRANSFER_TICKET_REFUSED"
#: ErrorInfo reason (ABORTED) of a Step whose node transfer failed (the peer gone, a NIXL error): no KV of the
#: step was written; free its sequences that read from another node and recompute them.
TRANSFER_FAILED = "TRANSFER_FAILED"


class PagedKVError(Exception):
    """Base class: a message for a person, a gRPC code, an optional ErrorInfo reason."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    reason: str = ""

    def __init__(self, message: str, *, metadata: dict[str, str] | None = None, reason: str | None = None):
        super().__init__(message)
        self.message = message
        if reason is not None:  # a more specific reason than the class's
            self.reason = reason
        #: ErrorInfo metadata (string to string).
        self.metadata = dict(metadata or {})


class InvalidArgumentError(PagedKVError, ValueError):
    """Malformed request: negative or huge sizes, empty batch, bad sampling values."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class NotFoundError(PagedKVError, KeyError):
    """Unknown sequence, lease or pool."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class FailedPreconditionError(PagedKVError):
    """Layout/generation mismatch, lease expired, pool not ready."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class OutOfRangeError(PagedKVError):
    """A position past what exists yet: a KV event stream asked to start after the next event to be logged."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "OUT_OF_RANGE"


class UnavailableError(PagedKVError):
    """The service cannot serve now and will not recover in this process (a worker whose device
    failed): send the call elsewhere. Clients treat it as the worker's failure."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class TransferFailedError(PagedKVError):
    """A step's node transfer failed before any of its own writes (metadata ``blocks_done``)."""

    code = grpc.StatusCode.ABORTED
    reason = TRANSFER_FAILED


class _ShortfallError(PagedKVError):
    """RESOURCE_EXHAUSTED for a request that needs ``required`` blocks where ``available`` can be had
    (both in ErrorInfo metadata); nothing changed."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, required: int, available: int):
        super().__init__(message, metadata={"required": str(required), "available": str(available)})
        self.required = required
        self.available = available


class OutOfBlocksError(_ShortfallError):
    """Not enough available blocks for an all-or-nothing request.

    Carries ``required`` and ``available`` block counts in ErrorInfo metadata.
    """

    reason = OUT_OF_BLOCKS

    def __init__(self, required: int, available: int, what: str = "request"):
        super().__init__(f"out of KV blocks: the {what} needs {required} blocks but {available} are "
                         "available; free or preempt sequences, or start the memory service with more "
                         "--num-blocks / --kv-cache-memory", required, available)


class OutOfHostBlocksError(_ShortfallError):
    """A swap-out needs more host-tier blocks than can be reserved now (nothing changed).

    Carries ``required`` and ``available`` host blocks in ErrorInfo metadata.
    """

    reason = OUT_OF_HOST_BLOCKS

    def __init__(self, required: int, available: int):
        super().__init__(f"out of host-tier blocks: the swap-out needs {required} host blocks but {available} can "
                         "be reserved; preempt by recompute (FreeSequences with reason PREEMPTED), or start the "
                         "memory service with more --host-cache-memory", required, available)


#: ErrorInfo reason of a per-lease quota refusal (``--max-blocks-per-lease``, ``--max-sequences-per-lease``).
QUOTA_EXCEEDED = "QUOTA_EXCEEDED"


class UnauthenticatedError(PagedKVError):
    """No credential where one is needed, or a credential that is not valid at all (a bad admin token)."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDeniedError(PagedKVError):
    """A credential without the right: another lease's secret, a role that may not make the call, a step
    outside its grant, a receipt no worker signed."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class QuotaExceededError(PagedKVError):
    """A call that would take a lease (or the service's lease table) past its quota (nothing changed).

    Carries ``quota`` ("blocks", "sequences" or "leases"), ``limit``, ``requested`` (what the
    call adds) and ``held`` (what the lease, or the service, holds now) in ErrorInfo metadata.
    Blocks count as block-table entries: a block shared by two of the lease's sequences counts twice.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = QUOTA_EXCEEDED

    def __init__(self, quota: str, limit: int, requested: int, held: int, what: str = "request", *,
                 holder: str = "the lease", flag: str | None = None):
        flag = flag or f"--max-{quota}-per-lease"
        super().__init__(
            f"{what}: {holder} holds {held} {quota} and asks for {requested} more, past its quota of {limit} "
            f"({flag}); release what is not needed first, or start the memory service with a larger {flag}",
            metadata={"quota": quota, "limit": str(limit), "requested": str(requested), "held": str(held)},
        )
        self.quota, self.limit, self.requested, self.held = quota, limit, requested, held
