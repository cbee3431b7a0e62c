"""Memory-service calls that hold the event loop: time per call, and a keep-alive's latency meanwhile.

The memory service answers every RPC on one asyncio event loop, so a call that runs long delays
every other caller, keep-alives included (issue 15: no call should hold the loop for more than
~50 ms). Against a REAL memory-service process (a pool of ``--num-blocks`` blocks of 16 tokens,
with a tiny one-layer model so a big pool costs little memory), each case below sets up its state,
then sends one large call while a second thread sends KeepAlive on another lease back to back.
Calls carry what they need (docs/security.md): the lease's secret (``pagedkv-lease-secret``) on
every call on a lease, the admin token (``authorization: Bearer``) on the admin-only ones
(ListSequences of every lease, ResetPrefixCache); replies that return sequences carry their
signed grants, whose signing is part of the call's time.

Printed per case: the call, its size, its outcome (OK or the status code), the call's time as the
caller sees it (an upper bound of its time on the loop: request parsing, the work, the reply),
and the slowest keep-alive answered while it ran (what a bystander waits).

Cases: AllocateSequences of many 1-token sequences; FreeSequences of as many; ReleaseLease of a
lease holding the whole pool and expiry of a big lease (each at most the service's default quota of
sequences per lease); ListSequences (admin) over 10,000 sequences, one page of the default, of the
largest size and one over it; ResetPrefixCache with many cached blocks; AllocateSequences and
AppendSlots carrying many token ids; ForkSequences at its limits. Sizes over a per-call limit are
refused (INVALID_ARGUMENT) before any work, which the table shows too.

Cached blocks are real: a compute worker (its own process, the same tiny model with seeded random
weights) computes sequences of 16 full blocks each, 255 sequences per Step, and their receipts are
handed in with CommitComputedTokens (the only way a block enters the prefix cache); the sequences
are then freed, so their blocks stay cached until the reset. The set-up's time is printed.

    python benchmarks/bench_memory_latency.py [--quick] [--num-blocks 131072] [--big 65536]

``--quick``: 32,768 blocks and batches of 16,384.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
from common import Service, admin_token, machine, table, write_result

from memory_service.main import DEFAULT_MAX_SEQUENCES_PER_LEASE
from memory_service.manager.paging import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.runtime.credentials import LEASE_SECRET_METADATA
from pagedkv.runtime.limits import MAX_BATCH, MAX_FORK_BLOCK_IDS, MAX_FORK_CHILDREN, MAX_TOKEN_IDS_PER_CALL

BLOCK_SIZE = 16
_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
#: The tiny model's vocabulary; cached sequences are told apart by their first two tokens.
VOCAB = 4096
#: Full blocks per cached sequence (and one more token, so the worker has a position to sample).
CACHED_SEQ_BLOCKS = 16
#: Sequences per Step while filling the cache: 255 x 257 tokens fit the worker's 65,536 per step.
CACHE_FILL_BATCH = 255


def secret_md(lease: pb.CreateLeaseResponse) -> tuple[tuple[str, str], ...]:
    """The metadata that authorizes calls on ``lease``."""
    return ((LEASE_SECRET_METADATA, lease.lease_secret),)


class KeepAliveProbe:
    """A thread sending KeepAlive on its own lease back to back; records (start, seconds) per call."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address, options=_OPTIONS)
        self.stub = pb_grpc.MemoryServiceStub(self.channel)
        lease = self.stub.CreateLease(pb.CreateLeaseRequest(owner="probe", ttl_seconds=3600))
        self.lease, self.md = lease.lease_id, secret_md(lease)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while len(self.samples) < 5 and time.monotonic() < deadline:  # connected and answering
            time.sleep(0.01)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            self.stub.KeepAlive(pb.KeepAliveRequest(lease_id=self.lease), timeout=120, metadata=self.md)
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
    """A Hugging Face Llama directory with seeded random weights: one layer, hidden size 8, two query
    heads of width 4 over one KV head (a 512-byte fp32 block), a VOCAB-token vocabulary."""
    from safetensors.torch import save_file

    d = tmp / "tiny"
    d.mkdir()
    hidden, inter, head_dim = 8, 16, 4
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": hidden // head_dim, "num_key_value_heads": 1,
        "max_position_embeddings": 4096, "tie_word_embeddings": True}))
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    layer = "model.layers.0."
    save_file({
        "model.embed_tokens.weight": randn(VOCAB, hidden), "model.norm.weight": torch.ones(hidden),
        layer + "input_layernorm.weight": torch.ones(hidden),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
        layer + "self_attn.q_proj.weight": randn(hidden,
                                                 hidden), layer + "self_attn.k_proj.weight": randn(head_dim, hidden),
        layer + "self_attn.v_proj.weight": randn(head_dim,
                                                 hidden), layer + "self_attn.o_proj.weight": randn(hidden, hidden),
        layer + "mlp.gate_proj.weight": randn(inter, hidden), layer + "mlp.up_proj.weight": randn(inter, hidden),
        layer + "mlp.down_proj.weight": randn(hidden, inter),
    }, d / "model.safetensors")  # fmt: skip
    return d


def fill_prefix_cache(stub, worker, generation: int, nseq: int) -> tuple[int, float]:
    """Compute ``nseq`` distinct sequences of CACHED_SEQ_BLOCKS full blocks (+1 token) on ``worker``,
    hand in the receipts, free them: their full blocks stay in the prefix cache.

    Returns (blocks registered in the cache, seconds).

    Raises:
        RuntimeError: a receipt was not taken (the cache would not hold what this claims).
    """
    t = time.perf_counter()
    lease = stub.CreateLease(pb.CreateLeaseRequest(ttl_seconds=3600))
    md = secret_md(lease)
    per_seq = CACHED_SEQ_BLOCKS * BLOCK_SIZE + 1
    registered = 0
    for at in range(0, nseq, CACHE_FILL_BATCH):
        # Sequence k starts with (k // (VOCAB - 1) + 1, k % (VOCAB - 1) + 1): no two share a block hash.
        prompts = [
            [k // (VOCAB - 1) + 1, k % (VOCAB - 1) + 1] + [(k + j) % (VOCAB - 1) + 1 for j in range(per_seq - 2)]
            for k in range(at, min(nseq, at + CACHE_FILL_BATCH))
        ]
        got = stub.AllocateSequences(
            pb.AllocateSequencesRequest(
                lease_id=lease.lease_id,
                sequences=[pb.SequenceAllocation(num_tokens=per_seq, token_ids=p) for p in prompts],
            ),
            timeout=300,
            metadata=md,
        )
        step = cpb.StepRequest(pool_generation=generation, sequences=[
            cpb.StepSequence(seq_id=s.seq_id, token_ids=p, positions=range(per_seq), block_ids=s.block_ids,
                             skip_sampling=True, grant=g)
            for s, g, p in zip(got.sequences, got.grants, prompts)])  # fmt: skip
        out = worker.Step(step, timeout=300)
        done = stub.CommitComputedTokens(
            pb.CommitComputedTokensRequest(lease_id=lease.lease_id, receipts=[r.receipt for r in out.results]),
            timeout=300,
            metadata=md,
        )
        if done.skipped:
            raise RuntimeError(f"CommitComputedTokens skipped {done.skipped} of {len(prompts)} receipts")
        registered += done.blocks_registered
        stub.FreeSequences(
            pb.FreeSequencesRequest(lease_id=lease.lease_id, seq_ids=[s.seq_id for s in got.sequences]),
            timeout=300,
            metadata=md,
        )
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=300, metadata=md)
    return registered, time.perf_counter() - t


def cases(stub, worker, generation: int, admin: tuple, probe: KeepAliveProbe, num_blocks: int, big: int) -> list[list]:
    rows = []
    secrets: dict[str, tuple] = {}

    def row(call: str, size: str, fn) -> None:
        outcome, secs, worst = timed(probe, fn)
        rows.append([call, size, outcome, f"{secs * 1e3:.1f}", f"{worst * 1e3:.1f}"])
        print(rows[-1], flush=True)

    def lease(ttl: float = 3600) -> str:
        created = stub.CreateLease(pb.CreateLeaseRequest(ttl_seconds=ttl))
        secrets[created.lease_id] = secret_md(created)
        return created.lease_id

    def md(lease_id: str) -> tuple:
        return secrets[lease_id]

    def release(lease_id: str):
        return stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease_id), timeout=300, metadata=md(lease_id))

    def allocate(lease_id: str, n: int, tokens: int = 1, token_ids=None) -> list:
        out = []
        for at in range(0, n, MAX_BATCH):
            req = pb.AllocateSequencesRequest(
                lease_id=lease_id,
                sequences=[
                    pb.SequenceAllocation(num_tokens=tokens, token_ids=token_ids or ())
                    for _ in range(min(MAX_BATCH, n - at))
                ],
            )
            out += stub.AllocateSequences(req, timeout=300, metadata=md(lease_id)).sequences
            stub.KeepAlive(
                pb.KeepAliveRequest(lease_id=lease_id), metadata=md(lease_id)
            )  # a 1 s TTL lives through set-up
        return [s.seq_id for s in out]

    one = pb.SequenceAllocation(num_tokens=1)
    a = lease()  # warm-up: the first calls of a fresh service (and channel) are not what is measured
    for _ in range(3):
        allocate(a, 64)
    release(a)
    for n in (MAX_BATCH, big):
        a = lease()
        seqs = []

        def alloc(a=a, n=n, seqs=seqs):
            seqs += stub.AllocateSequences(
                pb.AllocateSequencesRequest(lease_id=a, sequences=[one] * n), timeout=300, metadata=md(a)
            ).sequences

        row("AllocateSequences", f"{n} seqs", alloc)
        ids = [s.seq_id for s in seqs] or list(range(n))  # refused: free as many ids (refused the same way)
        row(
            "FreeSequences",
            f"{n} seqs",
            lambda a=a, ids=ids: stub.FreeSequences(
                pb.FreeSequencesRequest(lease_id=a, seq_ids=ids), timeout=300, metadata=md(a)
            ),
        )
        release(a)

    # The service's default per-lease quota of sequences bounds what one lease's end drops at once.
    per_lease = min(DEFAULT_MAX_SEQUENCES_PER_LEASE, num_blocks)
    a = lease()
    each = num_blocks // per_lease
    allocate(a, per_lease, each * BLOCK_SIZE)  # the whole pool
    row("ReleaseLease", f"{per_lease} seqs x {each} blocks", lambda: release(a))
    time.sleep(0.5)  # the rest of its blocks return in chunks; the probe sees those turns too
    rows[-1][-1] = (
        f"{max(float(rows[-1][-1]), probe.worst_between(time.perf_counter() - 0.6, time.perf_counter()) * 1e3):.1f}"
    )

    a = lease(ttl=1)
    allocate(a, min(big, per_lease))
    # The expiry sweep runs within a second of the TTL; watch the keep-alives over that window.
    t = time.perf_counter()
    while stub.GetStats(pb.GetStatsRequest()).num_sequences:
        time.sleep(0.01)
    time.sleep(0.5)  # its blocks return in chunks meanwhile
    end = time.perf_counter()
    rows.append(
        ["(lease expiry)", f"{min(big, per_lease)} seqs", "OK", "-", f"{probe.worst_between(t, end) * 1e3:.1f}"]
    )
    print(rows[-1], flush=True)

    a = lease()
    allocate(a, 10_000)
    for size in (DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, 10_000):  # the default page, the largest, one over it
        row(
            "ListSequences (admin)",
            f"10000 seqs, page of {size}",
            lambda size=size: stub.ListSequences(pb.ListSequencesRequest(page_size=size), timeout=300, metadata=admin),
        )
    release(a)

    # Cached blocks: computed by the worker, receipts committed, sequences freed (they stay cached).
    nseq = min(big, num_blocks // 2) // (CACHED_SEQ_BLOCKS + 1)
    registered, secs = fill_prefix_cache(stub, worker, generation, nseq)
    cached = stub.GetStats(pb.GetStatsRequest()).cached_blocks
    print(
        f"prefix cache filled by the worker: {nseq} sequences, {registered} blocks registered, {cached} cached, "
        f"{secs:.1f} s",
        flush=True,
    )
    row(
        "ResetPrefixCache (admin)",
        f"{cached} cached blocks",
        lambda: stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=300, metadata=admin),
    )

    for n in (MAX_TOKEN_IDS_PER_CALL, 1 << 20):
        a = lease()
        row(
            "AllocateSequences",
            f"1 seq, {n} token ids",
            lambda a=a, n=n: stub.AllocateSequences(
                pb.AllocateSequencesRequest(
                    lease_id=a, sequences=[pb.SequenceAllocation(num_tokens=n, token_ids=[7] * n)]
                ),
                timeout=300,
                metadata=md(a),
            ),
        )
        (s,) = allocate(a, 1, 1, [7])
        row(
            "AppendSlots",
            f"1 seq, {n} token ids",
            lambda a=a, n=n, s=s: stub.AppendSlots(
                pb.AppendSlotsRequest(lease_id=a, appends=[pb.SlotAppend(seq_id=s, num_tokens=n, token_ids=[7] * n)]),
                timeout=300,
                metadata=md(a),
            ),
        )
        release(a)

    for children, blocks in ((MAX_FORK_CHILDREN, MAX_FORK_BLOCK_IDS // MAX_FORK_CHILDREN), (4096, 1024)):
        a = lease()
        (p,) = allocate(a, 1, blocks * BLOCK_SIZE)
        row(
            "ForkSequences",
            f"{children} children x {blocks} blocks",
            lambda a=a, p=p, c=children: stub.ForkSequences(
                pb.ForkSequencesRequest(lease_id=a, forks=[pb.SequenceFork(parent_seq_id=p)] * c),
                timeout=300,
                metadata=md(a),
            ),
        )
        release(a)
    a = lease()
    (p,) = allocate(a, 1, 1)
    row(
        "ForkSequences",
        "40000 children",
        lambda: stub.ForkSequences(
            pb.ForkSequencesRequest(lease_id=a, forks=[pb.SequenceFork(parent_seq_id=p)] * 40_000),
            timeout=300,
            metadata=md(a),
        ),
    )
    release(a)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32768 blocks, batches of 16384")
    ap.add_argument("--num-blocks", type=int, default=None, help="blocks in the pool (default 131072)")
    ap.add_argument("--big", type=int, default=None, help="sequences in the large batches (default 65536)")
    args = ap.parse_args()
    num_blocks = args.num_blocks or (32_768 if args.quick else 131_072)
    big = args.big or (16_384 if args.quick else 65_536)
    info = machine()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        svc = Service(
            [
                "memory",
                "--model",
                str(model),
                "--num-blocks",
                str(num_blocks),
                "--block-size",
                str(BLOCK_SIZE),
                "--lease-ttl",
                "3600",
            ],
            "memory",
            Path(tmp),
        )
        worker = None
        try:
            worker = Service(["compute", "--memory", svc.address, "--model", str(model)], "worker", Path(tmp))
            admin = (("authorization", f"Bearer {admin_token('memory', Path(tmp))}"),)
            channel = grpc.insecure_channel(svc.address, options=_OPTIONS)
            wchannel = grpc.insecure_channel(worker.address, options=_OPTIONS)
            stub = pb_grpc.MemoryServiceStub(channel)
            generation = stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool.generation
            probe = KeepAliveProbe(svc.address)
            try:
                rows = cases(stub, cpb_grpc.ComputeServiceStub(wchannel), generation, admin, probe, num_blocks, big)
                idle = sorted(s for _, s in probe.samples)
            finally:
                probe.close()
                channel.close()
                wchannel.close()
        finally:
            if worker is not None:
                worker.stop()
            svc.stop()
    text = table(
        f"memory-service calls on the event loop ({num_blocks} blocks of {BLOCK_SIZE} tokens; "
        f"keep-alive median {idle[len(idle) // 2] * 1e3:.2f} ms over the run)",
        ["call", "size", "outcome", "call ms", "keep-alive max ms"],
        rows,
    )
    print(f"load average {info['load_avg_1m']:.2f} at the start; {time.perf_counter() - t0:.0f} s in all")
    write_result(
        "bench_memory_latency", {"machine": info, "num_blocks": num_blocks, "big": big, "table": text, "rows": rows}
    )


if __name__ == "__main__":
    main()
