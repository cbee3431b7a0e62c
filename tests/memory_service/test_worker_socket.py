"""The pool's handle goes only to workers: the worker socket, its uid check, the memfd pool.

GetPoolDescriptor over gRPC shows the layout and the socket's path, never a handle; the socket
hands a process of the service's own uid the pool memfd, the epoch table (read-only) and the
plane key; another uid is refused (tested with a fake peer uid: a second uid needs root); and a
SIGKILLed memory service leaves no pool file behind.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from compute_service.pool_map import map_pool
from memory_service.layout import PoolLayout
from memory_service.pool import CpuPool
from memory_service.worker_socket import PeerCred, WorkerSocketServer, check_peer, peer_credentials
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.runtime.pool_socket import receive_handle

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32", num_blocks=6)

READER = r"""
import sys
from compute_service.pool_map import map_pool
from pagedkv.memory.v1 import memory_service_pb2 as pb
pool = map_pool(pb.PoolDescriptor.FromString(sys.stdin.buffer.read()))
print(*pool.epochs.tolist(), pool.epochs.flags.writeable, pool.plane_key.hex(), float(pool.tensor[2, 1, 0, 3, 0, 5]))
"""


def test_uid_check_refuses_another_uid():
    me = os.getuid()
    with capture_logs() as logs:
        assert check_peer(PeerCred(pid=123, uid=me, gid=0), me)
        assert not check_peer(PeerCred(pid=123, uid=me + 1, gid=0), me)
    assert [(e["event"], e["peer_uid"], e["own_uid"]) for e in logs] == [("worker_socket_refused", me + 1, me)]


async def test_a_peer_of_another_uid_gets_nothing(tmp_path):
    # The real server with the kernel's answer replaced by a peer of another uid: it closes the
    # connection without a byte or an fd, and says why in its log.
    pool = CpuPool(LAYOUT, pool_id="refuse")
    server = WorkerSocketServer(pool, tmp_path / "w.sock",
                                credentials=lambda conn: PeerCred(peer_credentials(conn).pid, os.getuid() + 1, 0))
    await server.start()
    try:
        with capture_logs() as logs, pytest.raises(ConnectionError, match="own uid"):
            await asyncio.to_thread(receive_handle, str(server.path))
    finally:
        await server.close()
        pool.close()
    assert not server.path.exists()
    assert "worker_socket_refused" in [e["event"] for e in logs]


def test_grpc_descriptor_has_no_handle(memory_stub, memory_service):
    desc = memory_stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool
    assert desc.backend == pb.POOL_BACKEND_CPU and desc.layout.num_blocks == 64
    assert desc.shm_path == "" and desc.cuda_ipc_handle == b"" and desc.cuda_device_uuid == ""
    path = Path(desc.worker_socket)
    assert str(path) == memory_service.info["worker_socket"]
    assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # What the socket gives this (same-uid) process: the same layout, the fds, a 32-byte key.
    handle = receive_handle(desc.worker_socket)
    try:
        assert handle.descriptor.generation == desc.generation and handle.descriptor.shape == desc.shape
        assert sorted(handle.fds) == ["epochs", "pool"] and len(handle.plane_key) == 32
        with pytest.raises(PermissionError):  # the epoch table's fd is read-only
            mmap.mmap(handle.fds["epochs"], 8 * 64, mmap.MAP_SHARED)
        with pytest.raises(PermissionError):  # the pool is sealed at its size
            os.ftruncate(handle.fds["pool"], 4096)
    finally:
        handle.close()


async def test_worker_maps_through_the_socket_and_sees_the_epochs(tmp_path):
    pool = CpuPool(LAYOUT, pool_id="epochs")
    server = WorkerSocketServer(pool, tmp_path / "w.sock")
    await server.start()
    try:
        assert pool.descriptor().worker_socket == str(server.path) and pool.descriptor().shm_path == ""
        pool.epochs[[1, 4]] = [3, 9]
        np.frombuffer(pool.map(), dtype=np.float32).reshape(LAYOUT.shape)[2, 1, 0, 3, 0, 5] = 2.5
        desc = pool.descriptor().SerializeToString()
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", READER, stdin=subprocess.PIPE,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate(desc)
        assert proc.returncode == 0, err.decode()
        assert out.decode().split() == ["0", "3", "0", "0", "9", "0", "False", pool.plane_key.hex(), "2.5"]

        mapped = await asyncio.to_thread(map_pool, pool.descriptor())
        pool.epochs[1] += 1  # a bump by the memory service shows at once in the worker's mapping
        assert mapped.epochs.tolist() == [0, 4, 0, 0, 9, 0] and mapped.plane_key == pool.plane_key
        with pytest.raises(ValueError, match="read-only"):
            mapped.epochs[0] = 1
        mapped.close()
    finally:
        await server.close()
        pool.close()


def test_sigkill_leaves_no_pool_file(start_service, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"PAGEDKV_HOME": str(tmp_path / "home"), "PAGEDKV_SHM_DIR": str(shm)}
    pool_id = f"kill{os.getpid()}"
    svc = start_service(["memory", "--num-blocks", "8", "--pool-id", pool_id], name="kill", env=env)
    sock = Path(svc.info["worker_socket"])
    assert sock.parent == tmp_path / "home" / "run"
    fds = [os.readlink(p) for p in Path(f"/proc/{svc.pid}/fd").iterdir()]
    assert any(f.startswith(f"/memfd:pagedkv-pool-{pool_id}-g") for f in fds), fds
    os.kill(svc.pid, signal.SIGKILL)
    assert svc.proc.wait(30) == -signal.SIGKILL
    leftovers = [p for d in (Path("/dev/shm"), shm) for p in d.iterdir() if pool_id in p.name]
    assert leftovers == [] and list(shm.iterdir()) == []
    # Its socket file stays (a path nobody listens on); the next service there removes it.
    assert sock.exists()
    nxt = start_service(["memory", "--num-blocks", "8", "--grace", "0"], name="next", env=env)
    assert not sock.exists() and Path(nxt.info["worker_socket"]).exists()
