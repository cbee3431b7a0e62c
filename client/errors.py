"""Typed Python exceptions for errors the pagedkv services return.

Every service error carries a gRPC code and a ``google.rpc.ErrorInfo`` detail
(DESIGN.md, "Errors"); :func:`from_rpc_error` turns a ``grpc.RpcError`` into
the matching :class:`ServiceError` subclass so callers act on the type, and on
``reason`` where one code has several meanings (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pagedkv.runtime.errors import OUT_OF_BLOCKS, OUT_OF_HOST_BLOCKS, QUOTA_EXCEEDED


class ServiceError(Exception):
    """A pagedkv service refused a call.

    Attributes:
        code: the ``grpc.StatusCode``.
        message: the service's message (what was wrong, what to do).
        reason: ErrorInfo reason ("" when the error came from gRPC itself).
        metadata: ErrorInfo metadata.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "", metadata: dict | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})


class _Shortfall(ServiceError):
    """A RESOURCE_EXHAUSTED that carries ``required`` and ``available`` block counts."""

    @property
    def required(self) -> int:
        return int(self.metadata.get("required", 0))

    @property
    def available(self) -> int:
        return int(self.metadata.get("available", 0))


class OutOfBlocks(_Shortfall):
    """RESOURCE_EXHAUSTED with reason OUT_OF_BLOCKS: ``required`` and ``available`` blocks."""

    @classmethod
    def of(cls, required: int, available: int, message: str) -> OutOfBlocks:
        """The error as the memory service would send it (for a shortfall found on the client)."""
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message, OUT_OF_BLOCKS,
                   {"required": str(required), "available": str(available)})


class OutOfHostBlocks(_Shortfall):
    """RESOURCE_EXHAUSTED with reason OUT_OF_HOST_BLOCKS: a swap-out needs ``required`` host-tier blocks
    and ``available`` can be reserved (nothing changed); the caller preempts by recompute instead."""


class QuotaExceeded(ServiceError):
    """RESOURCE_EXHAUSTED with reason QUOTA_EXCEEDED: the lease would pass a per-lease quota (nothing changed).

    ``quota`` is "blocks" (block-table entries), "sequences" or "leases"; ``limit``, ``requested`` and
    ``held`` are counts.
    """

    @classmethod
    def of(cls, quota: str, limit: int, requested: int, held: int, message: str) -> QuotaExceeded:
        """The error as the memory service would send it (for a quota the client sees will be passed)."""
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message, QUOTA_EXCEEDED,
                   {"quota": quota, "limit": str(limit), "requested": str(requested), "held": str(held)})

    @property
    def quota(self) -> str:
        return self.metadata.get("quota", "")

    @property
    def limit(self) -> int:
        return int(self.metadata.get("limit", 0))

    @property
    def requested(self) -> int:
        return int(self.metadata.get("requested", 0))

    @property
    def held(self) -> int:
        return int(self.metadata.get("held", 0))


class Unauthenticated(ServiceError):
    """UNAUTHENTICATED: no credential where one is needed (a lease's secret), or a bad admin token."""


class PermissionDenied(ServiceError):
    """PERMISSION_DENIED: a credential without the right (another lease's secret, a role that may not).

    Also what the owner of a lease hears once the memory service no longer knows it (a restart):
    create a new lease.
    """


class InvalidArgument(ServiceError):
    """INVALID_ARGUMENT: a malformed request."""


class NotFound(ServiceError):
    """NOT_FOUND: unknown sequence, lease or pool."""


class FailedPrecondition(ServiceError):
    """FAILED_PRECONDITION: generation mismatch, expired lease, pool not ready; for the host tier,
    ``reason`` HOST_TIER_OFF (a swap-out on a service without one) or SWAP_LOST (a swap-in whose host
    copy was never proven: free the sequence and recompute it)."""


class Unavailable(ServiceError):
    """UNAVAILABLE: the service is down or shutting down."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}
#: RESOURCE_EXHAUSTED has several meanings; the ErrorInfo reason picks the type.
_BY_REASON = {OUT_OF_BLOCKS: OutOfBlocks, OUT_OF_HOST_BLOCKS: OutOfHostBlocks, QUOTA_EXCEEDED: QuotaExceeded}


def _status_info(status) -> tuple[str, dict[str, str]]:
    """ErrorInfo ``(reason, metadata)`` of a google.rpc.Status, ``("", {})`` when it has none."""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason, dict(info.metadata)
    return "", {}


def error_info(error: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """ErrorInfo ``(reason, metadata)`` of an RPC error, ``("", {})`` when it has none."""
    status = rpc_status.from_call(error) if hasattr(error, "trailing_metadata") else None
    return _status_info(status) if status is not None else ("", {})


def _typed(code: grpc.StatusCode, message: str, reason: str, metadata: dict[str, str]) -> ServiceError:
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason in _BY_REASON:
        cls = _BY_REASON[reason]
    else:
        cls = _BY_CODE.get(code, ServiceError)
    return cls(code, message, reason, metadata)


def from_rpc_error(error: grpc.RpcError) -> ServiceError:
    """The typed exception for ``error``."""
    return _typed(error.code(), error.details() or "", *error_info(error))


def from_status(status) -> ServiceError:
    """The typed exception for a google.rpc.Status carried in a reply (a StepResult's ``error``)."""
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    return _typed(code, status.message, *_status_info(status))
