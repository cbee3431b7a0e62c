"""Container health check: exit 0 when a pagedkv server is healthy, 1 otherwise.

    python docker/healthcheck.py ADDRESS [--service NAME] [--timeout SECONDS] [--tls-cert PEM --tls-key PEM --tls-ca
    PEM]
    python docker/healthcheck.py http://HOST:PORT/health [--timeout SECONDS]

ADDRESS host:port (e.g. 127.0.0.1:50051): the server must answer SERVING on the standard gRPC
health service (grpc.health.v1.Health/Check). The empty service name (the default) is the
server's overall status: a memory service says NOT_SERVING while it shuts down, a compute worker
while it has no pool mapped. Same answer as `grpcurl -plaintext ADDRESS grpc.health.v1.Health/Check`.
With --tls-cert/--tls-key/--tls-ca (a server run with mutual TLS) the check presents that
certificate, as `grpcurl -cacert CA -cert CERT -key KEY ADDRESS grpc.health.v1.Health/Check` does.

An http:// URL (the HTTP front-end, `pagedkv serve`): a GET must answer 200. The front-end's
/health does so only while the memory service and at least one worker serve. Only the standard
library is used (the image has no curl).

Used by the compose files' `healthcheck`.
"""

from __future__ import annotations

import argparse
import sys


def check_grpc(address: str, service: str, timeout: float, tls: tuple[str, str, str] | None = None) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        cert, key, ca = (open(path, "rb").read() for path in tls)
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        channel = grpc.secure_channel(address, creds)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            print(f"{address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def check_http(url: str, timeout: float) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            status, body = resp.status, resp.read(200)
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read(200)
    except (urllib.error.URLError, OSError) as e:
        print(f"{url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 1
    text = body.decode(errors="replace").strip()
    print(f"{url}: {status} {text}".rstrip())
    return 0 if status == 200 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Exit 0 when ADDRESS answers SERVING on grpc.health.v1, or an http:// URL answers 200."
    )
    p.add_argument("address", help="host:port of a gRPC server, or an http:// URL")
    p.add_argument(
        "--service", default="", help="gRPC service name to check (default: the whole server)"
    )
    p.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)"
    )
    for name in ("cert", "key", "ca"):
        p.add_argument(f"--tls-{name}", default=None, metavar="PEM",
                       help=f"mutual TLS: the {name} file (all three or none)")
    args = p.parse_args(argv)
    tls = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls) and not all(tls):
        p.error("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
    if args.address.startswith(("http://", "https://")):
        if args.service or any(tls):
            p.error("--service and --tls-* apply to gRPC addresses only")
        return check_http(args.address, args.timeout)
    return check_grpc(args.address, args.service, args.timeout, tls if all(tls) else None)


if __name__ == "__main__":
    raise SystemExit(main())
