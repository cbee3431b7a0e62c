"""GPU check, node transfers: KV blocks read from another process's GPU pool over NIXL.

A source process (node A's worker: a pool tensor on the GPU filled with seeded random bytes, a
`compute_service.transfer_agent.TransferAgent` over it, its `TransferSource` printed as hex) and
this process as node B's worker (its own GPU pool and agent) that reads blocks of A's pool into
its own with `read_blocks`, as a step's node transfers do (`compute_service.worker.do_copies`):

- N consecutive blocks (merged into one descriptor) and N scattered ones (one per block): every
  byte equal to A's; GB/s each, best of a few repeats (figures, not checks). Between two processes
  of one GPU, UCX takes CUDA IPC or copies through host memory, whichever the build has; on a
  cluster the same calls go over NVLink or RDMA;
- a fault injected after k blocks (a test hook at ``transfer.read_blocks``, `pagedkv.runtime.test_hooks`):
  TransferError naming k, and exactly the first k blocks written.

`run(report, device="cpu")` does the same with cpu pools (checks this file without a GPU).
SmolLM2's block layout in bf16 (360 KiB a block); about 10 s with N = 256 (90 MiB).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Node A: a pool of seeded random bytes and an agent over it; prints its source, waits for stdin to close.
SOURCE = r"""
import sys, torch
from compute_service.transfer_agent import TransferAgent
device, blocks = sys.argv[1], int(sys.argv[2])
g = torch.Generator(device=device).manual_seed(1234)
pool = torch.randint(-32768, 32767, (blocks, 30, 2, 16, 3, 64), generator=g, device=device,
                     dtype=torch.int16).view(torch.bfloat16)
agent = TransferAgent(f"gpu-check-a-{device}", pool)
print(agent.source().to_proto().SerializeToString().hex(), flush=True)
sys.stdin.read()
agent.close()
"""


def run(report: Callable[[str, bool, str], None], device: str = "cuda", blocks: int | None = None,
        env: dict[str, str] | None = None, repeats: int = 3) -> None:
    """The node-transfer section (see the module docstring); ``report(name, ok, detail)`` per check."""
    import torch

    from compute_service.transfer_agent import TransferAgent, TransferError, TransferSource
    from pagedkv.grant.v1 import grant_pb2
    from pagedkv.runtime import test_hooks

    cuda = device == "cuda"
    blocks = blocks or (256 if cuda else 16)
    label = f"node transfers ({device} pools, {blocks} blocks)"
    env = env or {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos"), *sys.path])}
    source = subprocess.Popen([sys.executable, "-c", SOURCE, device, str(blocks)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    agent = None
    try:
        line = source.stdout.readline().strip()
        if not line:
            report(f"{label}: source process starts", False, f"exit code {source.poll()}")
            return
        peer = TransferSource.from_proto(grant_pb2.TransferSource.FromString(bytes.fromhex(line)))
        g = torch.Generator(device=device).manual_seed(1234)
        want = torch.randint(-32768, 32767, (blocks, 30, 2, 16, 3, 64), generator=g, device=device, dtype=torch.int16)
        pool = torch.zeros(2 * blocks, 30, 2, 16, 3, 64, dtype=torch.bfloat16, device=device)
        agent = TransferAgent(f"gpu-check-b-{device}", pool)
        report(f"{label}: agents over both pools", peer.mem_type == ("VRAM" if cuda else "DRAM")
               and peer.block_bytes == agent.block_bytes, f"peer {peer.mem_type}, {peer.block_bytes} B a block")
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        nbytes = blocks * agent.block_bytes
        runs = {"consecutive": [(b, blocks + b) for b in range(blocks)],
                "scattered": [(b, blocks + (7 * b) % blocks) for b in range(blocks)]}  # 7 is prime to blocks
        for name, pairs in runs.items():
            pool.zero_()
            agent.read_blocks(peer, pairs)
            sync()
            got = pool.view(torch.int16)
            ok = all(torch.equal(got[d], want[s]) for s, d in pairs) and not got[:blocks].any()
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                agent.read_blocks(peer, pairs)
                sync()
                best = min(best, time.perf_counter() - t)
            report(f"{label}: {name} blocks read byte-exact", ok,
                   f"{nbytes / best / 1e9:.2f} GB/s ({nbytes >> 20} MiB in {best * 1e3:.1f} ms)")
        pool.zero_()
        remove_fault = test_hooks.register("transfer.read_blocks", lambda **_: 3)  # a read stops after 3 pairs
        try:
            agent.read_blocks(peer, runs["scattered"][:8])
            failed = None
        except TransferError as e:
            failed = e
        finally:
            remove_fault()
        sync()
        written = [d for d in range(2 * blocks) if pool[d].view(torch.int16).any()]
        report(
            f"{label}: a fault after 3 blocks raises and writes exactly those",
            failed is not None and failed.blocks_done == 3 and written == sorted(d for _, d in runs["scattered"][:3]),
            f"error={failed!r}, blocks written={written}",
        )
    except Exception as e:  # noqa: BLE001 - a section reports, it does not stop the script
        report(f"{label}: ran", False, repr(e))
    finally:
        if agent is not None:
            agent.close()
        source.stdin.close()
        source.wait(timeout=30)
