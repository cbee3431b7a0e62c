"""Mutual TLS on the internal plane: who may talk to a memory service or a worker.

DESIGN.md, "Trust model": the plane (memory service, workers, schedulers, routers) is for its own
members. Two modes, chosen by three flags that every server and client takes
(:func:`pagedkv.config.flags.add_tls_args`; each also read from ``PAGEDKV_TLS_CERT/KEY/CA``):

- **mutual TLS** (``--tls-cert --tls-key --tls-ca`` all given): a server presents its certificate
  and requires one from every client, signed by the same CA (``require_client_auth``); a client
  without one, or with one from another CA, fails the handshake (UNAVAILABLE). The caller's role
  is the SAN URI ``pagedkv:role:<worker|scheduler|router|admin>`` of its certificate
  (:func:`peer_role`). ``pagedkv certs`` (:mod:`pagedkv.runtime.certs`) makes a CA and one certificate
  per role.
- **plaintext, loopback only** (none given): a server binds only a loopback address
  (127.0.0.0/8, ::1, localhost); :func:`check_bind` refuses any other host at start, since
  nothing would stop another machine from joining the plane.

Giving one or two of the three flags is an error (never a silent fallback to plaintext).
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

#: Roles a certificate may carry (DESIGN.md, "Trust model").
ROLES = ("worker", "scheduler", "router", "admin")
#: Prefix of the SAN URI that names a certificate's role: ``pagedkv:role:worker``.
ROLE_URI_PREFIX = "pagedkv:role:"

_FLAGS = (("cert", "--tls-cert", "PAGEDKV_TLS_CERT"), ("key", "--tls-key", "PAGEDKV_TLS_KEY"),
          ("ca", "--tls-ca", "PAGEDKV_TLS_CA"))


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The three PEM files of one member of the plane.

    Raises (on construction):
        ValueError: a file that does not exist or cannot be read, naming the flag.
    """

    #: This member's certificate (PEM), signed by ``ca``; servers present it, clients too.
    cert: Path
    #: Its private key (PEM; keep it mode 0600).
    key: Path
    #: The CA certificate (PEM) that every peer's certificate must be signed by.
    ca: Path

    def __post_init__(self):
        for name, flag, _ in _FLAGS:
            path = Path(getattr(self, name)).absolute()  # child processes may run elsewhere
            object.__setattr__(self, name, path)
            if not os.access(path, os.R_OK) or not path.is_file():
                raise ValueError(f"{flag} {path}: no such readable file; make the plane's certificates with "
                                 "`pagedkv certs --out DIR` and pass the files for this member")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(cert, key, ca) as PEM bytes."""
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def flags(self) -> list[str]:
        """The command-line flags that give these files to a child process."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def from_args(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the flags give, or None when none is given (plaintext, loopback only).

    Raises:
        ValueError: one or two of the three flags given, or a file that cannot be read.
    """
    given = {name: getattr(args, f"tls_{name}", None) for name, _, _ in _FLAGS}
    if not any(given.values()):
        return None
    missing = [flag for name, flag, _ in _FLAGS if not given[name]]
    if missing:
        raise ValueError(f"mutual TLS needs all of --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)} "
                         "(or the matching PAGEDKV_TLS_* variable)")
    return TlsFiles(given["cert"], given["key"], given["ca"])


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tls: TlsFiles | None) -> None:
    """Refuse a plaintext server on a non-loopback host.

    Raises:
        ValueError: ``tls`` is None and ``host`` is not loopback.
    """
    if tls is None and not is_loopback(host):
        raise ValueError(
            f"refusing to bind {host} without TLS: anyone who can reach it could join the internal plane. "
            "Give --tls-cert, --tls-key and --tls-ca (make them with `pagedkv certs --out DIR --hosts HOST,...`), "
            "or bind a loopback address such as 127.0.0.1")


def mode(host: str, tls: TlsFiles | None) -> str:
    """The one-line description of a server's mode that it logs at start."""
    if tls is None:
        return (f"plaintext, loopback only: {host} is reachable from this machine only; "
                "give --tls-cert/--tls-key/--tls-ca to serve other hosts")
    return f"mutual TLS: every client needs a certificate signed by {tls.ca}"


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """Server credentials that present ``files.cert`` and require a client certificate signed by ``files.ca``."""
    cert, key, ca = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: trust servers signed by ``files.ca``, present ``files.cert``."""
    cert, key, ca = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel(address: str, tls: TlsFiles | None, options=()) -> grpc.Channel:
    """A blocking channel to ``address``: secure with ``tls``, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=list(options))


def aio_channel(address: str, tls: TlsFiles | None, options=()) -> grpc.aio.Channel:
    """An asyncio channel to ``address``: secure with ``tls``, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=list(options))


def peer_role(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str | None:
    """The caller's role from its certificate's SAN URI ``pagedkv:role:<role>``.

    Returns:
        one of :data:`ROLES`; None without TLS (plaintext: authorize by other means), for a
        certificate that names no role, or one that names several (never guess the larger).
    """
    auth = context.auth_context() or {}
    pems = auth.get("x509_pem_cert")
    if pems:
        return _role_of_pem(pems[0])
    # gRPC also lists the certificate's URI SANs as "peer_uri" (only when TLS verified the peer).
    return _role_of_uris(tuple(u.decode(errors="replace") for u in auth.get("peer_uri", ())))


def over_tls(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> bool:
    """True when the call came over TLS (the peer then showed a certificate of the plane's CA)."""
    return (context.auth_context() or {}).get("transport_security_type") == [b"ssl"]


def require_role(context: grpc.ServicerContext | grpc.aio.ServicerContext, allowed: set[str], what: str) -> None:
    """Under TLS, refuse a caller whose certificate's role is not in ``allowed`` (the admin always
    passes); without TLS (loopback only) every local caller passes: roles need certificates.

    Raises:
        pagedkv.runtime.errors.PermissionDeniedError: a certificate with another role, or with none.
    """
    if not over_tls(context):
        return
    role = peer_role(context)
    if role != "admin" and role not in allowed:
        from pagedkv.runtime.errors import PermissionDeniedError

        raise PermissionDeniedError(
            f"{what} needs a certificate with the role {' or '.join(sorted(allowed))} (SAN URI "
            f"{ROLE_URI_PREFIX}<role>); this caller's certificate has {role or 'no role'}"
        )


@functools.lru_cache(maxsize=256)
def _role_of_pem(pem: bytes) -> str | None:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except (ValueError, x509.ExtensionNotFound):
        return None
    return _role_of_uris(tuple(uris))


def _role_of_uris(uris: tuple[str, ...]) -> str | None:
    roles = {u.removeprefix(ROLE_URI_PREFIX) for u in uris if u.startswith(ROLE_URI_PREFIX)}
    if len(roles) != 1:
        return None
    (role,) = roles
    return role if role in ROLES else None
