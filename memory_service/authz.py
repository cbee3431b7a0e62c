"""Who calls the memory service, and what they may do (DESIGN.md, "Trust model").

A call's :class:`Caller` comes from its credentials, strongest first:

- ``authorization: Bearer <token>`` equal to the admin token the service wrote at
  start (``--admin-token-file``, mode 0600) -> ``admin`` (``via="admin-token"``); any
  other bearer token is refused with UNAUTHENTICATED;
- a TLS client certificate whose SAN URI names a role (``pagedkv:role:<role>``, read by
  :func:`pagedkv.runtime.tls.peer_role`) -> that role (``via="tls-certificate"``);
- nothing -> ``anonymous-loopback`` (``via="loopback"``): without TLS the service binds
  loopback only, so such a caller is a process on this host.

Rights, checked in each handler's first line (:class:`Authorizer`)::

    call                                        needs
    CreateLease, GetStats, GetPoolDescriptor    any member of the plane
    KeepAlive, ReleaseLease, Allocate, Append,  the lease's secret (pagedkv-lease-secret),
      Fork, Free, Commit, ListSequences(lease)    whatever the role; the admin too
    GetBlockTable                               the secret of the sequence's lease, or admin
    ListSequences without lease_id              admin
    ResetPrefixCache, CheckInvariants           admin
    SequenceInfo.lease_id, events' token ids    shown to admin only (empty for others)

The admin reads everything but changes a lease only with its secret (least authority:
the operator's token cannot be used to free a tenant's sequences). A refusal of a
role is PERMISSION_DENIED naming the role needed; a missing lease secret or a bad
admin token is UNAUTHENTICATED.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from memory_service.leases import Lease, LeaseTable
from memory_service.manager.sequence import Sequence
from pagedkv.runtime.credentials import AUTHORIZATION_METADATA, LEASE_SECRET_METADATA
from pagedkv.runtime.errors import PermissionDeniedError, UnauthenticatedError
from pagedkv.runtime.paths import pagedkv_home
from pagedkv.runtime.tls import over_tls, peer_role, require_role

ADMIN = "admin"
WORKER = "worker"
SCHEDULER = "scheduler"
ROUTER = "router"
ANONYMOUS_LOOPBACK = "anonymous-loopback"
#: A certificate of the plane's CA that names no role (or several): a member with no rights beyond reading.
NO_ROLE = "no-role"
#: Every role a caller can have.
ROLES = (ADMIN, WORKER, SCHEDULER, ROUTER, ANONYMOUS_LOOPBACK, NO_ROLE)
#: Metadata key of the admin credential: ``authorization: Bearer <token>``.


@dataclass(frozen=True, slots=True)
class Caller:
    """The caller of one RPC."""

    #: One of :data:`ROLES`.
    role: str
    #: How the role was established: "admin-token", "tls-certificate" or "loopback".
    via: str

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


def metadata_value(context: grpc.ServicerContext, key: str) -> str | None:
    """The first value of metadata ``key`` (lower case) on the call, or None."""
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("utf-8", "replace")
    return None


def create_admin_token(path: str | os.PathLike) -> str:
    """A fresh random admin token (43 URL-safe characters), written to ``path``.

    The file is mode 0600 and replaced atomically (written beside it, then renamed),
    so a reader sees the old token or the new one, never half. Its folder is made
    mode 0700 when missing, and also when it is ``$PAGEDKV_HOME`` (pagedkv's own);
    a folder the operator chose otherwise keeps its mode.

    Raises:
        OSError: the folder cannot be created or written.
    """
    path = Path(path).absolute()
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    elif path.parent == pagedkv_home().absolute():
        path.parent.chmod(0o700)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


class Authorizer:
    """The memory service's access checks (module docstring: the table).

    Args:
        leases: the table whose secrets authorize lease calls.
        admin_token: the loopback admin credential; None = admin only by TLS certificate.
        admin_token_file: where the token is (named in refusals).
    """

    def __init__(self, leases: LeaseTable, admin_token: str | None = None, admin_token_file: str | None = None):
        self.leases = leases
        self._admin_hash = hashlib.sha256(admin_token.encode()).digest() if admin_token else None
        self.admin_token_file = admin_token_file

    def caller(self, context: grpc.ServicerContext) -> Caller:
        """Who makes this call.

        Raises:
            UnauthenticatedError: an ``authorization`` header that is not ``Bearer <the admin token>``.
        """
        auth = metadata_value(context, AUTHORIZATION_METADATA)
        if auth is not None:
            scheme, _, token = auth.partition(" ")
            ok = (scheme.lower() == "bearer" and self._admin_hash is not None
                  and hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._admin_hash))
            if not ok:
                raise UnauthenticatedError(
                    f"the {AUTHORIZATION_METADATA!r} header is not 'Bearer <admin token>' with this service's admin "
                    f"token; read it from {self._where()} (it changes at every start) or send no such header")
            return Caller(ADMIN, "admin-token")
        if over_tls(context):  # a certificate of the plane's CA; its role, or none
            return Caller(peer_role(context) or NO_ROLE, "tls-certificate")
        return Caller(ANONYMOUS_LOOPBACK, "loopback")

    def require_admin(self, context: grpc.ServicerContext, what: str) -> Caller:
        """The caller, if it is the admin.

        Raises:
            UnauthenticatedError: a bad admin token.
            PermissionDeniedError: any other role.
        """
        caller = self.caller(context)
        if not caller.is_admin:
            raise PermissionDeniedError(
                f"{what} needs the admin role, and this caller is {caller.role} (by {caller.via}); send "
                f"'authorization: Bearer <token>' with the token in {self._where()}, or use an admin certificate")
        return caller

    def require_router(self, context: grpc.ServicerContext, what: str) -> None:
        """Refuse a caller that may not ask which prefixes are cached: under TLS one whose certificate
        is not the router's (or the admin's); on loopback one without the admin token (a front's
        router reads it, ``--memory-admin-token-file``), since every local process reaches the service.

        Raises:
            UnauthenticatedError: a bad admin token.
            PermissionDeniedError: any other caller.
        """
        if over_tls(context):
            require_role(context, {ROUTER}, what)
        else:
            self.require_admin(context, what)

    def lease(self, context: grpc.ServicerContext, lease_id: str) -> Lease:
        """The live lease ``lease_id``, if the call carries its secret (errors: :meth:`LeaseTable.authorize`)."""
        return self.leases.authorize(lease_id, metadata_value(context, LEASE_SECRET_METADATA))

    def read_sequence(self, context: grpc.ServicerContext, seq_id: int,
                      get: Callable[[int], Sequence]) -> tuple[Caller, Sequence]:
        """The caller and sequence ``seq_id`` (from ``get``), if the caller may read its block table:
        the admin, or with the secret of its lease. The credential is checked before the lookup.

        Raises:
            UnauthenticatedError: no lease secret and not the admin (or a bad admin token).
            NotFoundError: (from ``get``) no live sequence ``seq_id``; sequence ids are not secret.
            PermissionDeniedError: the secret of another lease.
        """
        caller = self.caller(context)
        if caller.is_admin:
            return caller, get(seq_id)
        secret = metadata_value(context, LEASE_SECRET_METADATA)
        if not secret:
            raise UnauthenticatedError(
                f"reading sequence {seq_id}'s block table needs the secret of its lease in metadata "
                f"{LEASE_SECRET_METADATA!r}, or the admin role")
        seq = get(seq_id)
        if not self.leases.matches(self.leases[seq.lease_id], secret):
            raise PermissionDeniedError(
                f"sequence {seq_id} is not a sequence of the lease whose secret was sent; reading another "
                "lease's block table needs the admin role")
        return caller, seq

    def _where(self) -> str:
        return self.admin_token_file or "the admin token file (--admin-token-file)"


__all__ = ["ADMIN", "ANONYMOUS_LOOPBACK", "Authorizer", "Caller", "NO_ROLE", "ROLES", "ROUTER", "SCHEDULER", "WORKER",
           "create_admin_token", "metadata_value", "peer_role"]
