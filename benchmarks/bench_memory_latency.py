"""Memory-service calls that hold the event loop: time per call, and a keep-alive's latency meanwhile.

The memory service answers every RPC on one asyncio event loop, so a call that runs long delays
every other caller, keep-alives included (issue 15: no call should hold the loop for more than
~50 ms). Against a REAL memory-service process (a pool of ``--num-blocks`` blocks of 16 tokens,
with a one-layer layout so a big pool costs little memory), each case below sets up its state,
then sends one large call while a second thread sends KeepAlive on another lease back to back.

Printed per case: the call, its size, its outcome (OK or the status code), the call's time as the
caller sees it (an upper bound of its time on the loop: request parsing, the work, the reply),
and the slowest keep-alive answered while it ran (what a bystander waits).

Cases: AllocateSequences of many 1-token sequences; FreeSequences of as many; ReleaseLease and
expiry of a lease holding as many; ListSequences over 10,000 sequences; ResetPrefixCache with
many cached blocks; AllocateSequences and AppendSlots carrying many token ids; ForkSequences at
its limits. Sizes over a per-call limit are refused (INVALID_ARGUMENT) before any work, which the
table shows too.

    python benchmarks/bench_memory_latency.py [--num-blocks 131072]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import grpc
from common import Service, machine, table, write_result

from pagedkv.limits import MAX_BATCH, MAX_FORK_BLOCK_IDS, MAX_FORK_CHILDREN, MAX_TOKEN_IDS_PER_CALL
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc

BLOCK_SIZE = 16
_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]


class KeepAliveProbe:
    """A thread sending KeepAlive on its own lease back to back; records (start, seconds) per call."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=_OPTIONS)
        self.stub = pb_grpc.MemoryServiceStub(self.channel)
        self.lease = self.stub.CreateLease(pb.CreateLeaseRequest(owner="probe", ttl_seconds=3600)).lease_id
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            self.stub.KeepAlive(pb.KeepAliveRequest(lease_id=self.lease), timeout=120)
            self.samples.append((t, time.perf_counter() - t))
            time.sleep(0.002)

    def worst_between(self, start: float, end: float) -> float:
        """Slowest keep-alive (seconds) that was in flight at some point in [start, end]."""
        return max((s for t, s in list(self.samples) if t <= end and t + s >= start), default=0.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.channel.close()


def timed(probe: KeepAliveProbe, fn) -> tuple[str, float, float]:
    """Run ``fn()``; returns (outcome, call seconds, worst keep-alive seconds meanwhile)."""
    time.sleep(0.05)  # let the probe settle
    t = time.perf_counter()
    try:
        fn()
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = e.code().name
    end = time.perf_counter()
    time.sleep(0.02)
    return outcome, end - t, probe.worst_between(t, end)


def tiny_model(tmp: Path) -> Path:
    """A Hugging Face directory whose layout is one layer, one KV head of width 1 (128 B per block)."""
    d = tmp / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "hidden_size": 1}))
    return d


def cases(stub, probe: KeepAliveProbe, num_blocks: int, big: int) -> list[list]:
    rows = []

    def row(call: str, size: str, fn) -> None:
        outcome, secs, worst = timed(probe, fn)
        rows.append([call, size, outcome, f"{secs * 1e3:.1f}", f"{worst * 1e3:.1f}"])
        print(rows[-1], flush=True)

    def lease(ttl: float = 3600) -> str:
        return stub.CreateLease(pb.CreateLeaseRequest(ttl_seconds=ttl)).lease_id

    def allocate(lease_id: str, n: int, tokens: int = 1, token_ids=None) -> list:
        out = []
        for at in range(0, n, MAX_BATCH):
            req = pb.AllocateSequencesRequest(lease_id=lease_id, sequences=[
                pb.SequenceAllocation(num_tokens=tokens, token_ids=token_ids or ()) for _ in range(min(MAX_BATCH, n - at))])
            out += stub.AllocateSequences(req, timeout=300).sequences
            stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease_id))  # a short-TTL lease lives through set-up
        return [s.seq_id for s in out]

    one = pb.SequenceAllocation(num_tokens=1)
    for n in (MAX_BATCH, big):
        a = lease()
        seqs = []

        def alloc(a=a, n=n, seqs=seqs):
            seqs += stub.AllocateSequences(pb.AllocateSequencesRequest(lease_id=a, sequences=[one] * n),
                                           timeout=300).sequences
        row("AllocateSequences", f"{n} seqs", alloc)
        ids = [s.seq_id for s in seqs] or list(range(n))  # refused: free as many ids (refused the same way)
        row("FreeSequences", f"{n} seqs", lambda a=a, ids=ids: stub.FreeSequences(
            pb.FreeSequencesRequest(lease_id=a, seq_ids=ids), timeout=300))
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=a))

    a = lease()
    allocate(a, num_blocks // 4, 4 * BLOCK_SIZE)  # the whole pool
    row("ReleaseLease", f"{num_blocks // 4} seqs x 4 blocks", lambda: stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=a),
                                                                           timeout=300))
    time.sleep(0.5)  # the rest of its blocks return in chunks; the probe sees those turns too
    rows[-1][-1] = f"{max(float(rows[-1][-1]), probe.worst_between(time.perf_counter() - 0.6, time.perf_counter()) * 1e3):.1f}"

    a = lease(ttl=1)
    allocate(a, big)
    # The expiry sweep runs within a second of the TTL; watch the keep-alives over that window.
    t = time.perf_counter()
    while stub.GetStats(pb.GetStatsRequest()).num_sequences:
        time.sleep(0.01)
    time.sleep(0.5)  # its blocks return in chunks meanwhile
    end = time.perf_counter()
    rows.append(["(lease expiry)", f"{big} seqs", "OK", "-", f"{probe.worst_between(t, end) * 1e3:.1f}"])
    print(rows[-1], flush=True)

    a = lease()
    allocate(a, 10_000)
    row("ListSequences", "10000 seqs", lambda: stub.ListSequences(pb.ListSequencesRequest(), timeout=300))
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=a), timeout=300)

    # Cached blocks: sequences of 16 full blocks each, committed, freed (they stay cached).
    a = lease()
    per_seq = 16 * BLOCK_SIZE + 1
    nseq = min(big, num_blocks // 2) // 17
    seq_ids = []
    for at in range(0, nseq, 256):
        reqs = [pb.SequenceAllocation(num_tokens=per_seq, token_ids=[at + i] * 16 * BLOCK_SIZE + [0])
                for i in range(min(256, nseq - at))]
        got = stub.AllocateSequences(pb.AllocateSequencesRequest(lease_id=a, sequences=reqs), timeout=300).sequences
        ids = [s.seq_id for s in got]
        try:
            stub.CommitComputedTokens(pb.CommitComputedTokensRequest(lease_id=a, sequences=[
                pb.ComputedTokens(seq_id=s, num_computed_tokens=per_seq) for s in ids]), timeout=300)
        except grpc.RpcError as e:
            print("commit refused:", e.code().name, e.details())
            break
        seq_ids += ids
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=a), timeout=300)
    cached = stub.GetStats(pb.GetStatsRequest()).cached_blocks
    row("ResetPrefixCache", f"{cached} cached blocks", lambda: stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(),
                                                                                     timeout=300))

    for n in (MAX_TOKEN_IDS_PER_CALL, 1 << 20):
        a = lease()
        row("AllocateSequences", f"1 seq, {n} token ids", lambda a=a, n=n: stub.AllocateSequences(
            pb.AllocateSequencesRequest(lease_id=a, sequences=[pb.SequenceAllocation(num_tokens=n, token_ids=[7] * n)]),
            timeout=300))
        (s,) = allocate(a, 1, 1, [7])
        row("AppendSlots", f"1 seq, {n} token ids", lambda a=a, n=n, s=s: stub.AppendSlots(
            pb.AppendSlotsRequest(lease_id=a, appends=[pb.SlotAppend(seq_id=s, num_tokens=n, token_ids=[7] * n)]),
            timeout=300))
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=a), timeout=300)

    for children, blocks in ((MAX_FORK_CHILDREN, MAX_FORK_BLOCK_IDS // MAX_FORK_CHILDREN), (4096, 1024)):
        a = lease()
        (p,) = allocate(a, 1, blocks * BLOCK_SIZE)
        row("ForkSequences", f"{children} children x {blocks} blocks", lambda a=a, p=p, c=children: stub.ForkSequences(
            pb.ForkSequencesRequest(lease_id=a, forks=[pb.SequenceFork(parent_seq_id=p)] * c), timeout=300))
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=a), timeout=300)
    a = lease()
    (p,) = allocate(a, 1, 1)
    row("ForkSequences", "40000 children", lambda: stub.ForkSequences(pb.ForkSequencesRequest(
        lease_id=a, forks=[pb.SequenceFork(parent_seq_id=p)] * 40_000), timeout=300))
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=a), timeout=300)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=131_072, help="blocks in the pool (default 131072)")
    ap.add_argument("--big", type=int, default=65_536, help="sequences in the large batches (default 65536)")
    args = ap.parse_args()
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        svc = Service(["memory", "--model", str(model), "--num-blocks", str(args.num_blocks),
                       "--block-size", str(BLOCK_SIZE), "--lease-ttl", "3600"], "memory", Path(tmp))
        try:
            channel = grpc.insecure_channel(svc.address, options=_OPTIONS)
            stub = pb_grpc.MemoryServiceStub(channel)
            probe = KeepAliveProbe(svc.address)
            try:
                rows = cases(stub, probe, args.num_blocks, args.big)
                idle = sorted(s for _, s in probe.samples)
            finally:
                probe.close()
                channel.close()
        finally:
            svc.stop()
    text = table(f"memory-service calls on the event loop ({args.num_blocks} blocks of {BLOCK_SIZE} tokens; "
                 f"keep-alive median {idle[len(idle) // 2] * 1e3:.2f} ms over the run)",
                 ["call", "size", "outcome", "call ms", "keep-alive max ms"], rows)
    write_result("bench_memory_latency", {"machine": info, "num_blocks": args.num_blocks, "table": text,
                                          "rows": rows})


if __name__ == "__main__":
    main()
