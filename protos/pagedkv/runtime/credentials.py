"""The plane's credentials on the wire, defined once for the memory service and its clients.

docs/security.md: a lease's secret travels in metadata :data:`LEASE_SECRET_METADATA` on every call
on the lease; the admin's token as ``authorization: Bearer <token>``, written by the memory service
at start to :func:`default_admin_token_file` unless ``--admin-token-file`` says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.runtime.paths import pagedkv_home

#: Metadata key of a lease's secret (CreateLeaseResponse.lease_secret).
LEASE_SECRET_METADATA = "pagedkv-lease-secret"
#: Metadata key of the admin's bearer token.
AUTHORIZATION_METADATA = "authorization"


def default_admin_token_file() -> Path:
    """``$PAGEDKV_HOME/admin-token``: where a memory service writes its admin token by default."""
    return pagedkv_home() / "admin-token"


__all__ = ["AUTHORIZATION_METADATA", "LEASE_SECRET_METADATA", "default_admin_token_file"]
