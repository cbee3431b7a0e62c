"""Block-manager speed: in-process operations per second, and batched AppendSlots latency.

Prints two tables and writes benchmarks/results/bench_allocator.json:

1. in-process ops/s of allocate (16-token sequence), append (1 token), fork and free;
2. microseconds per batched append of 1, 32 and 256 sequences (median, p99),
   in-process and through gRPC to a real memory-service process on loopback.

Targets (issue): a batched append of 256 sequences under 1 ms in-process and
under 3 ms over gRPC.

    python benchmarks/bench_allocator.py [--iters 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from common import Service, machine  # noqa: E402

from memory_service.manager.block_manager import BlockManager  # noqa: E402
from memory_service.manager.requests import Append  # noqa: E402
from pagedkv.memory.v1 import memory_service_pb2 as pb  # noqa: E402
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc  # noqa: E402
from pagedkv.runtime.credentials import LEASE_SECRET_METADATA  # noqa: E402

NUM_BLOCKS = 65_536
BLOCK_SIZE = 16


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ops_per_second(n: int) -> dict[str, float]:
    m = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    lease = m.leases.create(ttl=3600).lease_id
    out = {}
    t = time.perf_counter()
    seqs = [m.allocate(lease, [16])[0].seq_id for _ in range(n)]
    out["allocate"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for s in seqs:
        m.append_slots(lease, [Append(s, 1)])
    out["append"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    children = [m.fork(lease, [s])[0].seq_id for s in seqs]
    out["fork"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for s in seqs + children:
        m.free(lease, [s])
    out["free"] = 2 * n / (time.perf_counter() - t)
    return out


def append_latency_inprocess(batch: int, iters: int) -> list[float]:
    m = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    lease = m.leases.create(ttl=3600).lease_id
    seqs = [s.seq_id for s in m.allocate(lease, [100] * batch)]
    appends = [Append(s, 1) for s in seqs]
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        m.append_slots(lease, appends)
        times.append((time.perf_counter() - t) * 1e6)
    return times


def append_latency_grpc(stub, batch: int, iters: int) -> list[float]:
    created = stub.CreateLease(pb.CreateLeaseRequest(ttl_seconds=3600))
    lease, md = created.lease_id, ((LEASE_SECRET_METADATA, created.lease_secret),)
    seqs = stub.AllocateSequences(pb.AllocateSequencesRequest(
        lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=100)] * batch), metadata=md).sequences
    request = pb.AppendSlotsRequest(lease_id=lease,
                                    appends=[pb.SlotAppend(seq_id=s.seq_id, num_tokens=1) for s in seqs])
    for _ in range(10):  # warm up the channel
        stub.GetStats(pb.GetStatsRequest())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        stub.AppendSlots(request, metadata=md)
        times.append((time.perf_counter() - t) * 1e6)
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300, help="appends per batch size")
    parser.add_argument("--ops", type=int, default=5000, help="operations per in-process op type")
    args = parser.parse_args()
    os.environ.setdefault("PAGEDKV_LOG_LEVEL", "warning")

    result: dict = {"machine": machine()}
    ops = ops_per_second(args.ops)
    result["ops_per_second"] = ops
    print("\nIn-process block-manager operations (one sequence per call)")
    print(f"{'operation':<12}{'ops/s':>12}")
    for name, v in ops.items():
        print(f"{name:<12}{v:>12,.0f}")

    with tempfile.TemporaryDirectory() as tmp:
        svc = Service(["memory", "--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                       "--lease-ttl", "3600"], "memory", Path(tmp))
        try:
            with grpc.insecure_channel(svc.address) as ch:
                stub = pb_grpc.MemoryServiceStub(ch)
                rows = []
                for batch in (1, 32, 256):
                    local = append_latency_inprocess(batch, args.iters)
                    remote = append_latency_grpc(stub, batch, args.iters)
                    rows.append({"batch": batch,
                                 "inprocess_median_us": statistics.median(local), "inprocess_p99_us": pct(local, 0.99),
                                 "grpc_median_us": statistics.median(remote), "grpc_p99_us": pct(remote, 0.99)})
        finally:
            svc.stop()
    result["batched_append"] = rows
    print("\nBatched AppendSlots (1 token per sequence), microseconds")
    print(f"{'sequences':>10}{'in-proc p50':>14}{'in-proc p99':>14}{'gRPC p50':>12}{'gRPC p99':>12}")
    for r in rows:
        print(f"{r['batch']:>10}{r['inprocess_median_us']:>14.1f}{r['inprocess_p99_us']:>14.1f}"
              f"{r['grpc_median_us']:>12.1f}{r['grpc_p99_us']:>12.1f}")
    last = rows[-1]
    print(f"\ntarget 256 sequences: in-process p50 {last['inprocess_median_us']:.0f} us (< 1000), "
          f"gRPC p50 {last['grpc_median_us']:.0f} us (< 3000)")
    out = ROOT / "benchmarks" / "results" / "bench_allocator.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
