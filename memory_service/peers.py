"""Who a caller is, for the limit of leases per peer (:mod:`memory_service.quotas`).

- Under mutual TLS: the client certificate (its subject's common name and the SHA-256 of the
  certificate), so every certificate the plane's CA signed is a peer of its own.
- On loopback without TLS: the caller's uid, as the worker socket knows its peers
  (:mod:`memory_service.worker_socket`; ``SO_PEERCRED`` there). gRPC's TCP connections carry no
  credentials, so the uid is the owner of the caller's end of the connection in the kernel's
  socket table (``/proc/net/tcp`` and ``tcp6``: the established socket whose local address is
  the caller's address): ``uid 1000``. When no socket is found (another network namespace, no
  ``/proc``), every such caller at that address is one peer, ``host 127.0.0.1``.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import struct
from pathlib import Path
from urllib.parse import unquote

import grpc

from pagedkv.runtime.tls import over_tls

#: The kernel's TCP socket tables (Linux).
TCP_TABLES = {4: Path("/proc/net/tcp"), 6: Path("/proc/net/tcp6")}
#: State of an established connection in those tables.
_ESTABLISHED = "01"


def peer_identity(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str:
    """The caller of this call, as the limit of leases per peer counts it (the module docstring)."""
    if over_tls(context):
        pems = (context.auth_context() or {}).get("x509_pem_cert")
        return certificate_identity(pems[0]) if pems else "a certificate gRPC did not show"
    host, port = parse_peer(context.peer() or "")
    if host is None:
        return "a local caller"  # a Unix socket, or an address gRPC did not give
    uid = socket_uid(host, port)
    return f"uid {uid}" if uid is not None else f"host {host}"


def parse_peer(peer: str) -> tuple[str | None, int]:
    """(host, port) of a gRPC peer string such as ``ipv4:127.0.0.1:5000`` or ``ipv6:%5B::1%5D:5000``;
    (None, 0) for any other kind (``unix:``)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None, 0
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None, 0


def socket_uid(host: str, port: int, tables: dict[int, Path] = TCP_TABLES) -> int | None:
    """The uid owning the established TCP socket whose local end is ``host:port`` (this network
    namespace), or None when the tables are unreadable or hold no such socket."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    wanted = [(6, addr)]
    if addr.version == 4:
        wanted = [(4, addr), (6, ipaddress.IPv6Address(f"::ffff:{addr}"))]
    elif addr.ipv4_mapped is not None:
        wanted.append((4, addr.ipv4_mapped))
    for version, a in wanted:
        local = f"{_kernel_hex(a)}:{port:04X}"
        try:
            lines = tables[version].read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[1] == local and fields[3] == _ESTABLISHED:
                return int(fields[7])
    return None


def _kernel_hex(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """``addr`` as the kernel prints it in /proc/net/tcp*: each 32-bit word in host byte order, in hex."""
    raw = addr.packed
    return "".join(f"{w:08X}" for w in struct.unpack(f"={len(raw) // 4}I", raw))


@functools.lru_cache(maxsize=256)
def certificate_identity(pem: bytes) -> str:
    """``certificate CN=<common name> sha256:<first 16 hex digits of the DER's SHA-256>``."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return f"certificate sha256:{hashlib.sha256(pem).hexdigest()[:16]}"
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    cn = str(names[0].value)[:64] if names else "(none)"
    return f"certificate CN={cn} sha256:{hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()[:16]}"


__all__ = ["certificate_identity", "parse_peer", "peer_identity", "socket_uid"]
