"""Mutual TLS on the internal plane (pagedkv.runtime.tls, pagedkv certs).

A memory service started with ``--tls-cert/--tls-key/--tls-ca`` (certificates made here with
trustme) serves a client holding a scheduler certificate, over the memory service's RPCs, the
health service and reflection; a client without a certificate, or with one from another CA, fails
the handshake (UNAVAILABLE) and gets nothing. ``peer_role`` reads the role from the SAN URI. A
plaintext service refuses to bind a non-loopback host. ``pagedkv certs`` writes what it says.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import trustme
from conftest import ROOT, pagedkv_process
from cryptography import x509
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client.errors import ServiceError
from client.ops.stack import serving
from client.services import MemoryClient
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime import tls
from pagedkv.runtime.certs import MEMBERS, issue_cert
from pagedkv.runtime.tls import TlsFiles

_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_TLS_")}


def _files(tmp: Path, name: str, cert_pem: bytes, key_pem: bytes, ca_pem: bytes) -> TlsFiles:
    paths = [tmp / f"{name}.pem", tmp / f"{name}-key.pem", tmp / f"{name}-ca.pem"]
    for path, data in zip(paths, (cert_pem, key_pem, ca_pem)):
        path.write_bytes(data)
    return TlsFiles(*paths)


def _role_cert(ca: trustme.CA, tmp: Path, name: str, role: str | None) -> TlsFiles:
    """A client certificate with the SAN URI ``pagedkv:role:<role>``, signed by ``ca``."""
    cert, key = issue_cert(ca.cert_pem.bytes(), ca.private_key_pem.bytes(), common_name=name, role=role,
                           hosts=() if role else ("client.invalid",))
    return _files(tmp, name, cert, key, ca.cert_pem.bytes())


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """The plane's CA, the memory service's server files, a scheduler's and an outsider's client files."""
    tmp = tmp_path_factory.mktemp("tls")
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    outsider, outsider_key = issue_cert(other_ca.cert_pem.bytes(), other_ca.private_key_pem.bytes(),
                                        common_name="outsider", role="admin")
    return {
        "ca": ca,
        "tmp": tmp,
        "server": _files(tmp, "memory", server.cert_chain_pems[0].bytes(), server.private_key_pem.bytes(),
                         ca.cert_pem.bytes()),
        "scheduler": _role_cert(ca, tmp, "scheduler", "scheduler"),
        # Another CA's admin certificate, trusting our CA: the server must still refuse it.
        "outsider": _files(tmp, "outsider", outsider, outsider_key, ca.cert_pem.bytes()),
    }


@pytest.fixture(scope="module")
def tls_memory(plane):
    svc = pagedkv_process(["memory", "--num-blocks", "16", "--block-size", "4", *plane["server"].flags()],
                          plane["tmp"], "memory", env=_ENV)
    yield svc
    svc.stop()


def test_memory_service_serves_a_scheduler_over_mutual_tls(plane, tls_memory):
    assert tls_memory.info["tls"] is True
    assert "mutual TLS" in tls_memory.log()
    m = MemoryClient(tls_memory.address, timeout=10, tls=plane["scheduler"])
    try:
        stats = m.stats()
        assert (stats.total_blocks, stats.used_blocks) == (16, 0)
        assert m.pool().layout.block_size == 4
    finally:
        m.close()
    with tls.channel(tls_memory.address, plane["scheduler"]) as ch:
        assert serving(ch, timeout=5)
        reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"pagedkv.memory.v1.MemoryService", health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                "grpc.reflection.v1alpha.ServerReflection"} <= names


@pytest.mark.parametrize("role", ["router", "worker", None])
def test_a_certificate_without_the_scheduler_role_holds_no_lease(plane, tls_memory, role):
    # Least authority: routers read stats and events, workers compute; neither holds leases, and a
    # certificate of the plane's CA that names no role gets no more. A scheduler (and the admin) may.
    files = _role_cert(plane["ca"], plane["tmp"], f"member-{role}", role)
    m = MemoryClient(tls_memory.address, timeout=10, tls=files)
    try:
        assert m.stats().total_blocks == 16  # every member reads the counters
        with pytest.raises(ServiceError) as e:
            m.create_lease()
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert f"has {role or 'no role'}" in str(e.value) and "role scheduler" in str(e.value)
    finally:
        m.close()
    ok = MemoryClient(tls_memory.address, timeout=10, tls=plane["scheduler"])
    try:
        lease = ok.create_lease()
        assert ok.release_lease(lease.lease_id) == 0
    finally:
        ok.close()


def test_under_tls_a_peer_is_its_certificate(plane):
    """--max-leases-per-peer counts a certificate's leases: a second scheduler certificate (same role,
    another certificate) still opens one when the first is at its limit."""
    svc = pagedkv_process(["memory", "--num-blocks", "16", "--block-size", "4", "--max-leases-per-peer", "1",
                           *plane["server"].flags()], plane["tmp"], "memory-per-peer", env=_ENV)
    first = MemoryClient(svc.address, timeout=10, tls=plane["scheduler"])
    other = _role_cert(plane["ca"], plane["tmp"], "scheduler-2", "scheduler")
    second = MemoryClient(svc.address, timeout=10, tls=other)
    try:
        first.create_lease()
        with pytest.raises(ServiceError) as e:
            first.create_lease()
        assert e.value.reason == "QUOTA_EXCEEDED" and "this caller (certificate CN=scheduler sha256:" in str(e.value)
        second.create_lease()
    finally:
        first.close()
        second.close()
        svc.stop()


@pytest.mark.parametrize("who", ["plaintext", "no certificate", "another CA"])
def test_client_outside_the_plane_is_refused(plane, tls_memory, who):
    if who == "plaintext":
        m = MemoryClient(tls_memory.address, timeout=5)
    elif who == "no certificate":
        m = MemoryClient(tls_memory.address, timeout=5)
        m.channel.close()
        m.channel = grpc.secure_channel(tls_memory.address, grpc.ssl_channel_credentials(plane["ca"].cert_pem.bytes()))
        m.stub = type(m.stub)(m.channel)
    else:
        m = MemoryClient(tls_memory.address, timeout=5, tls=plane["outsider"])
    try:
        with pytest.raises(ServiceError) as e:
            m.stats()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        m.close()


@pytest.fixture(scope="module")
def role_server(plane):
    """An in-process TLS server whose one method answers ``peer_role(context)`` (None as "")."""

    def role(request: bytes, context) -> bytes:
        return (tls.peer_role(context) or "").encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Role", {"Get": grpc.unary_unary_rpc_method_handler(role)}),))
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(plane["server"]))
    plain_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, plain_port
    server.stop(None)


@pytest.mark.parametrize("role", [*tls.ROLES, None])
def test_peer_role_is_the_certificate_san_role(plane, role_server, role):
    files = _role_cert(plane["ca"], plane["tmp"], f"peer-{role}", role)
    with tls.channel(f"127.0.0.1:{role_server[0]}", files) as ch:
        assert ch.unary_unary("/test.Role/Get")(b"", timeout=5) == (role or "").encode()


def test_peer_role_is_none_without_tls(role_server):
    with tls.channel(f"127.0.0.1:{role_server[1]}", None) as ch:
        assert ch.unary_unary("/test.Role/Get")(b"", timeout=5) == b""


def _memory(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client.ops.cli", "memory", "--port", "0", "--num-blocks", "16",
                           *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=_ENV, check=False)


def test_plaintext_service_refuses_a_non_loopback_bind():
    r = _memory(["--host", "0.0.0.0"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to bind 0.0.0.0 without TLS" in r.stdout
    assert [tls.is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "0.0.0.0", "::",
                                         "10.0.0.7", "example.org", "")] == [True] * 5 + [False] * 5


def test_incomplete_tls_flags_are_refused(plane):
    r = _memory(["--tls-cert", str(plane["server"].cert)])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "missing --tls-key, --tls-ca" in r.stdout


def _sans(path: Path) -> x509.SubjectAlternativeName:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_pagedkv_certs_writes_a_ca_and_one_certificate_per_member(tmp_path, capsys):
    from client.ops.cli import main

    out = tmp_path / "tls"
    assert main(["certs", "--out", str(out), "--hosts", "memory,compute,10.0.0.7", "--days", "30"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["ca.pem", "ca-key.pem", *(f"{m.name}{s}" for m in MEMBERS for s in (".pem", "-key.pem"))])
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for path in out.iterdir():
        want = 0o600 if path.name.endswith("-key.pem") else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == want, path.name
    for m in MEMBERS:
        cert = x509.load_pem_x509_certificate((out / f"{m.name}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        sans = _sans(out / f"{m.name}.pem")
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == (
            [f"pagedkv:role:{m.role}"] if m.role else [])
        assert sans.get_values_for_type(x509.DNSName) == ["localhost", "memory", "compute"]
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1", "10.0.0.7"]
    assert [m.role for m in MEMBERS] == [None, "worker", "scheduler", "router", "admin"]

    # Idempotent: a second run keeps every file; a lost certificate is signed again by the same CA.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "router.pem").unlink()
    assert main(["certs", "--out", str(out)]) == 0
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {n for n in after if after[n] != before[n]} == {"router.pem", "router-key.pem"}
    x509.load_pem_x509_certificate(after["router.pem"]).verify_directly_issued_by(ca)
    assert "kept ca.pem" in capsys.readouterr().out
    # --force: everything anew, the CA included.
    assert main(["certs", "--out", str(out), "--force"]) == 0
    assert all((out / n).read_bytes() != before[n] for n in before)


def test_pagedkv_certs_files_make_a_working_plane(tmp_path):
    """The memory and admin files of `pagedkv certs` shake hands by every loopback name, with the admin role."""
    from pagedkv.runtime.certs import make_certs

    out = tmp_path / "tls"
    make_certs(out)
    member = lambda name: TlsFiles(out / f"{name}.pem", out / f"{name}-key.pem", out / "ca.pem")

    def role(request: bytes, context) -> bytes:
        return (tls.peer_role(context) or "").encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Role", {"Get": grpc.unary_unary_rpc_method_handler(role)}),))
    port = server.add_secure_port("[::]:0", tls.server_credentials(member("memory")))
    server.start()
    try:
        for host in ("127.0.0.1", "localhost", "[::1]"):
            with tls.channel(f"{host}:{port}", member("admin")) as ch:
                assert ch.unary_unary("/test.Role/Get")(b"", timeout=5) == b"admin"
    finally:
        server.stop(None)


def test_kubernetes_manifest_runs_the_plane_with_mutual_tls(monkeypatch):
    """deploy/k8s/pagedkv-cpu.yaml: `certs` runs first; every container presents its own member's files and its
    command parses with the CLI's parsers."""
    import yaml

    from client.ops.cli import build_parser as cli_parser
    from client.serve.config import parse_args as serve_args
    from compute_service.main import build_parser as compute_parser
    from memory_service.main import build_parser as memory_parser

    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "pagedkv-cpu.yaml").read_text()))
    (pod,) = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    (init,) = pod["initContainers"]
    assert init["args"][:4] == ["pagedkv", "certs", "--out", "/etc/pagedkv/tls"]
    cli_parser().parse_args(init["args"][1:])
    members = {"memory": ("memory", memory_parser), "compute": ("worker", compute_parser),
               "frontend": ("scheduler", None)}
    for c in pod["containers"]:
        member, parser = members[c["name"]]
        args = c["args"][2:]
        for k in list(os.environ):
            if k.startswith("PAGEDKV_TLS_"):
                monkeypatch.delenv(k)
        ns = serve_args(args) if parser is None else parser().parse_args(args)
        assert (ns.tls_cert, ns.tls_key, ns.tls_ca) == (f"/etc/pagedkv/tls/{member}.pem",
                                                        f"/etc/pagedkv/tls/{member}-key.pem", "/etc/pagedkv/tls/ca.pem")
        assert {"name": "tls", "mountPath": "/etc/pagedkv/tls", "readOnly": True} in c["volumeMounts"]


@pytest.mark.parametrize("role", ["router", "scheduler", "worker", None])
def test_kv_events_need_the_router_role(plane, tls_memory, role):
    """StreamKvEvents (which prefixes the node caches) is the router's read too: others are refused at once;
    the router's stream opens and waits for events (none come here: the deadline ends it)."""
    files = _role_cert(plane["ca"], plane["tmp"], f"events-{role}", role)
    m = MemoryClient(tls_memory.address, timeout=10, tls=files)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(m.stub.StreamKvEvents(mpb.StreamKvEventsRequest(), timeout=1.5))
        want = grpc.StatusCode.DEADLINE_EXCEEDED if role == "router" else grpc.StatusCode.PERMISSION_DENIED
        assert e.value.code() == want, e.value.details()
    finally:
        m.close()


@pytest.mark.parametrize("role", ["router", "scheduler", "worker", None])
def test_lookup_prefix_needs_the_router_role(plane, tls_memory, role):
    """LookupPrefix (how much of a prompt the node caches) is the router's read: a scheduler, a worker
    or a certificate without a role is refused; the router gets the answer (nothing cached here)."""
    files = _role_cert(plane["ca"], plane["tmp"], f"lookup-{role}", role)
    m = MemoryClient(tls_memory.address, timeout=10, tls=files)
    try:
        call = m.stub.LookupPrefix
        req = mpb.LookupPrefixRequest(token_ids=list(range(40)), model_id="m")
        if role == "router":
            assert call(req, timeout=10) == mpb.LookupPrefixResponse()
        else:
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "role router" in e.value.details()
    finally:
        m.close()
