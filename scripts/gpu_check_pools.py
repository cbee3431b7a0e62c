"""The device check's pools, made and mapped as in production: an owner process (the memory
service's side: `memory_service.pool.CudaPool` or `CpuPool`, served on a worker socket) and a
mapping through that socket (`compute_service.pool_map.map_pool`: CUDA IPC for a GPU pool, the
memfd for a CPU one), which is what every worker holds.

Used by scripts/gpu_check_tiers.py (a pool with a host tier) and scripts/gpu_check_nodes.py (two
nodes' pools under NIXL agents: registering memory imported by CUDA IPC with UCX is what a
worker does, and a plain allocation would not show whether it works).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The pool owner: makes the pool (SmolLM2's block layout, ``num_blocks`` blocks, ``host`` host-tier
#: blocks), serves it on the socket, prints the public descriptor (hex), releases it when stdin closes.
OWNER = r"""
import asyncio, sys
from memory_service.layout import PoolLayout
from memory_service.pool import CpuPool, CudaPool
from memory_service.worker_socket import WorkerSocketServer

device, num_blocks, host, dtype, sock, pool_id = sys.argv[1:7]
layout = PoolLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, num_blocks=int(num_blocks))

async def main():
    make = CudaPool if device == "cuda" else CpuPool
    pool = make(layout, pool_id=pool_id, host_num_blocks=int(host))
    server = WorkerSocketServer(pool, sock)
    await server.start()
    print(pool.descriptor().SerializeToString().hex(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.close()
    pool.close()

asyncio.run(main())
"""


class Owner:
    """A pool owner process (:data:`OWNER`); ``descriptor`` is its pool's public descriptor, or None
    when it did not start. ``close()`` releases the pool."""

    def __init__(self, device: str, num_blocks: int, dtype: str, sock: str, env: dict[str, str],
                 host_blocks: int = 0, pool_id: str = "gpu-check"):
        from pagedkv.memory.v1 import memory_service_pb2 as mpb

        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, device, str(num_blocks), str(host_blocks), dtype,
                                      sock, pool_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=ROOT, text=True)
        line = self.proc.stdout.readline().strip()
        self.descriptor = mpb.PoolDescriptor.FromString(bytes.fromhex(line)) if line else None

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ipc_capability(tensor) -> str:
    """How CUDA sees the memory behind ``tensor`` (a pool mapped by CUDA IPC): its memory type and
    whether it may be exported again by legacy CUDA IPC, as the driver's pointer attributes say
    (cuda-bindings); "host memory" on the CPU."""
    if not tensor.is_cuda:
        return "host memory"
    try:
        from cuda.bindings import driver
    except ImportError:
        return "unknown (cuda-bindings is not installed)"
    attr = driver.CUpointer_attribute
    ptr = tensor.data_ptr()
    out = []
    for name in ("CU_POINTER_ATTRIBUTE_MEMORY_TYPE", "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE",
                 "CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES", "CU_POINTER_ATTRIBUTE_MAPPED"):
        if not hasattr(attr, name):
            continue
        err, value = driver.cuPointerGetAttribute(getattr(attr, name), ptr)
        short = name.removeprefix("CU_POINTER_ATTRIBUTE_").lower()
        out.append(f"{short}={value if err == driver.CUresult.CUDA_SUCCESS else err.name}")
    return ", ".join(out)
