"""GPU check, node transfers: KV blocks read from another process's GPU pool over NIXL.

Each node's pool is made and mapped as in production (scripts/gpu_check_pools.py): an owner
process holds it (`CudaPool`, exported by CUDA IPC) and the worker maps it through the worker
socket, so the memory NIXL registers is memory imported by CUDA IPC, as in a worker; the check
prints what the driver says of that pointer (its type, whether it is IPC-capable again). Node A's
worker is a source process (its mapped pool filled with seeded random bytes, a
`compute_service.transfer_agent.TransferAgent` over it, its `TransferSource` printed as hex);
this process is node B's worker (its own mapped pool and agent), which reads blocks of A's pool
into its own with `read_blocks`, as a step's node transfers do (`compute_service.worker.do_copies`):

- N consecutive blocks (merged into one descriptor) and N scattered ones (one per block): every
  byte equal to A's; GB/s each, best of a few repeats (figures, not checks). Between two processes
  of one GPU, UCX takes CUDA IPC or copies through host memory, whichever the build has; on a
  cluster the same calls go over NVLink or RDMA;
- a fault injected after k blocks (a test hook at ``transfer.read_blocks``, `pagedkv.runtime.test_hooks`):
  TransferError naming k, and exactly the first k blocks written.

`run(report, device="cpu")` does the same with cpu pools (memfds; checks this file without a GPU).
SmolLM2's block layout in bf16 (360 KiB a block); about 10 s with N = 256 (90 MiB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Node A's worker: maps its node's pool, fills it with seeded random bytes, serves it with an
#: agent; prints its source, waits for stdin to close.
SOURCE = r"""
import sys, torch
from compute_service.pool_map import map_pool
from compute_service.transfer_agent import TransferAgent
from pagedkv.memory.v1 import memory_service_pb2 as mpb
device, desc = sys.argv[1], mpb.PoolDescriptor.FromString(bytes.fromhex(sys.argv[2]))
mapped = map_pool(desc)
g = torch.Generator(device=device).manual_seed(1234)
mapped.tensor.view(torch.int16).copy_(torch.randint(-32768, 32767, mapped.tensor.shape, generator=g, device=device,
                                                    dtype=torch.int16))
agent = TransferAgent(f"gpu-check-a-{device}", mapped.tensor)
print(agent.source().to_proto().SerializeToString().hex(), flush=True)
sys.stdin.read()
agent.close()
mapped.close()
"""


def run(report: Callable[[str, bool, str], None], device: str = "cuda", blocks: int | None = None,
        env: dict[str, str] | None = None, repeats: int = 3) -> None:
    """The node-transfer section (see the module docstring); ``report(name, ok, detail)`` per check."""
    import torch
    from gpu_check_pools import Owner, ipc_capability

    from compute_service.pool_map import map_pool
    from compute_service.transfer_agent import TransferAgent, TransferError, TransferSource
    from pagedkv.grant.v1 import grant_pb2
    from pagedkv.runtime import test_hooks

    cuda = device == "cuda"
    blocks = blocks or (256 if cuda else 16)
    label = f"node transfers ({device} pools, {blocks} blocks)"
    env = env or {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos"), *sys.path])}
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-check-nodes-"))
    owners = [Owner(device, n, "bfloat16", str(run_dir / f"{name}.sock"), env, pool_id=f"node-{name}")
              for name, n in (("a", blocks), ("b", 2 * blocks))]
    source = agent = mapped = None
    try:
        if any(o.descriptor is None for o in owners):
            report(f"{label}: pool owners start", False, f"exit codes {[o.proc.poll() for o in owners]}")
            return
        a_desc = owners[0].descriptor.SerializeToString().hex()
        source = subprocess.Popen([sys.executable, "-c", SOURCE, device, a_desc],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)
        line = source.stdout.readline().strip()
        if not line:
            report(f"{label}: source process starts", False, f"exit code {source.poll()}")
            return
        peer = TransferSource.from_proto(grant_pb2.TransferSource.FromString(bytes.fromhex(line)))
        g = torch.Generator(device=device).manual_seed(1234)
        want = torch.randint(-32768, 32767, (blocks, 30, 2, 16, 3, 64), generator=g, device=device, dtype=torch.int16)
        mapped = map_pool(owners[1].descriptor)
        pool = mapped.tensor
        pool.zero_()
        agent = TransferAgent(f"gpu-check-b-{device}", pool)
        report(f"{label}: agents over both pools, each mapped as a worker maps it",
               peer.mem_type == ("VRAM" if cuda else "DRAM") and peer.block_bytes == agent.block_bytes,
               f"peer {peer.mem_type}, {peer.block_bytes} B a block; this pool: {ipc_capability(pool)}")
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
        if mapped is not None:
            mapped.close()
        if source is not None:
            source.stdin.close()
            source.wait(timeout=30)
        for o in owners:
            o.close()
        shutil.rmtree(run_dir, ignore_errors=True)
