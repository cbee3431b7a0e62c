"""Container health check: exit 0 when a pagedkv server answers SERVING on the standard gRPC
health service (grpc.health.v1.Health/Check), 1 otherwise.

    python docker/healthcheck.py ADDRESS [--service NAME] [--timeout SECONDS]

ADDRESS is host:port, e.g. 127.0.0.1:50051. The empty service name (the default) is the
server's overall status: a memory service says NOT_SERVING while it shuts down, a compute worker
while it has no pool mapped. Used by the compose files' `healthcheck`; same answer as
`grpcurl -plaintext ADDRESS grpc.health.v1.Health/Check`.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Exit 0 when ADDRESS answers SERVING on grpc.health.v1."
    )
    p.add_argument("address", help="host:port of the server")
    p.add_argument(
        "--service", default="", help="service name to check (default: the whole server)"
    )
    p.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)"
    )
    args = p.parse_args(argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as e:
            print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
