"""``pagedkv certs``: a CA and one certificate per member of the internal plane.

Files written to ``--out DIR`` (keys mode 0600, certificates 0644)::

    ca.pem, ca-key.pem              the plane's CA (keep ca-key.pem off the servers where you can)
    memory.pem, memory-key.pem      the memory service (no role: it calls no one)
    worker.pem, worker-key.pem      workers                      pagedkv:role:worker
    scheduler.pem, ...-key.pem      `pagedkv serve`, Client      pagedkv:role:scheduler
    router.pem, ...-key.pem         routers (event subscribers)  pagedkv:role:router
    admin.pem, admin-key.pem        operators (grpcurl)          pagedkv:role:admin

Every certificate is good for server and client auth and names ``localhost``, ``127.0.0.1``,
``::1`` and every ``--hosts`` entry (a DNS name, or an IP address SAN for an address), so clients
can verify a server by the address they dial, and any member's files can also serve the
services it starts itself (``pagedkv up``, ``pagedkv serve`` with embedded services). The role
URI is what the servers authorize on (:func:`pagedkv.runtime.tls.peer_role`). Keys are ECDSA P-256;
certificates last ``--days`` (default 825).

Idempotent: files that exist are kept (a missing certificate is signed by the existing CA);
``--force`` makes everything anew, the CA included.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from pagedkv.runtime.tls import ROLE_URI_PREFIX

#: Hosts every server certificate names, besides ``--hosts``.
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
#: Default lifetime of every certificate, days (the CA's too).
DEFAULT_DAYS = 825


@dataclass(frozen=True, slots=True)
class Member:
    """One certificate to make: its file stem, role (None: no role URI) and whether it serves."""

    name: str
    role: str | None
    server: bool


#: The certificates ``pagedkv certs`` makes, in order.
MEMBERS = (
    Member("memory", None, True),
    Member("worker", "worker", True),
    Member("scheduler", "scheduler", True),
    Member("router", "router", True),
    Member("admin", "admin", True),
)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def make_ca(days: int = DEFAULT_DAYS, name: str = "pagedkv plane CA") -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, private key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _cert_pem(cert), _key_pem(key)


def issue_cert(ca_cert_pem: bytes, ca_key_pem: bytes, *, common_name: str, role: str | None = None,
               hosts: tuple[str, ...] | list[str] = (), server: bool = False,
               days: int = DEFAULT_DAYS) -> tuple[bytes, bytes]:
    """A certificate signed by the CA: (certificate PEM, private key PEM).

    Args:
        role: the role URI ``pagedkv:role:<role>`` to carry as a SAN (None: none).
        hosts: DNS names and IP addresses to carry as SANs (what clients dial).
        server: also good for server auth (always good for client auth).

    Raises:
        ValueError: no SAN at all (neither a role nor a host).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    sans: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    if role is not None:
        sans.append(x509.UniformResourceIdentifier(ROLE_URI_PREFIX + role))
    if not sans:
        raise ValueError(f"certificate {common_name!r} would name no host and no role")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = _key()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH, *([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])]
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _cert_pem(cert), _key_pem(key)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode`` from the start (a key is never readable by others)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    tmp.replace(path)


def make_certs(out: Path, hosts: list[str] | tuple[str, ...] = (), days: int = DEFAULT_DAYS,
               force: bool = False) -> dict[str, list[str]]:
    """Write the CA and every :data:`MEMBERS` certificate to ``out``; returns {"written": [...], "kept": [...]}
    (file names).

    Raises:
        ValueError: ``days`` < 1, or certificates to make while ca.pem exists without ca-key.pem.
    """
    if days < 1:
        raise ValueError(f"--days must be >= 1, got {days}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    ca_cert_path, ca_key_path = out / "ca.pem", out / "ca-key.pem"
    todo = [m for m in MEMBERS
            if force or not (out / f"{m.name}.pem").exists() or not (out / f"{m.name}-key.pem").exists()]
    if force or not ca_cert_path.exists():
        ca_cert, ca_key = make_ca(days)
        _write(ca_key_path, ca_key, 0o600)
        _write(ca_cert_path, ca_cert, 0o644)
        written += [ca_cert_path.name, ca_key_path.name]
        todo = list(MEMBERS)  # a new CA: every certificate must be signed by it
    else:
        kept.append(ca_cert_path.name)
        if todo and not ca_key_path.exists():
            raise ValueError(
                f"{ca_cert_path} exists but {ca_key_path} does not, so {todo[0].name}.pem cannot be "
                "signed; restore the CA key or run with --force to make a new CA and every certificate"
            )
        ca_cert = ca_cert_path.read_bytes()
        ca_key = ca_key_path.read_bytes() if todo else b""
        if ca_key_path.exists():
            kept.append(ca_key_path.name)
    all_hosts = [*DEFAULT_HOSTS, *hosts]
    for m in MEMBERS:
        cert_path, key_path = out / f"{m.name}.pem", out / f"{m.name}-key.pem"
        if m not in todo:
            kept += [cert_path.name, key_path.name]
            continue
        cert, key = issue_cert(
            ca_cert,
            ca_key,
            common_name=f"pagedkv {m.name}",
            role=m.role,
            hosts=all_hosts if m.server else (),
            server=m.server,
            days=days,
        )
        _write(key_path, key, 0o600)
        _write(cert_path, cert, 0o644)
        written += [cert_path.name, key_path.name]
    return {"written": written, "kept": kept}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags of ``pagedkv certs``."""
    p = parser or argparse.ArgumentParser(prog="pagedkv certs")
    p.add_argument("--out", required=True, help="folder to write the CA, certificates and keys to")
    p.add_argument(
        "--hosts",
        default="",
        help="comma-separated DNS names or addresses clients dial, for the server "
        f"certificates (always also {', '.join(DEFAULT_HOSTS)})",
    )
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})")
    p.add_argument("--force", action="store_true", help="make everything anew, the CA included (default: keep files)")
    return p


def run(args: argparse.Namespace) -> int:
    """``pagedkv certs``: make the files, print what was written and kept; 1 on an error."""
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    try:
        done = make_certs(Path(args.out), hosts, args.days, args.force)
    except (ValueError, OSError) as e:
        print(f"pagedkv certs: error: {e}")
        return 1
    print(
        f"{args.out}: wrote {', '.join(done['written']) or 'nothing'}"
        + (f"; kept {', '.join(done['kept'])}" if done["kept"] else "")
    )
    return 0
