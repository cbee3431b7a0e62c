"""The pool's memory: one allocation per (device, layout), exported for workers to map.

DESIGN.md, "The pool". Two backends, one descriptor:

- ``cpu``: a file in shared memory (``$PAGEDKV_SHM_DIR``, default ``/dev/shm``)
  named ``pagedkv-<pool_id>-g<generation>-p<owner pid>.kv``; workers mmap it and
  wrap it with ``torch.frombuffer``. The owner holds an exclusive ``flock`` on
  it; a starting service removes pool files nobody holds (owner exited or
  crashed, whatever its pid).
- ``cuda``: plain ``cudaMalloc`` through CuPy (not a caching-allocator
  interior, not expandable segments), exported with ``cudaIpcGetMemHandle``
  (64 bytes) plus the byte offset and the GPU's UUID, which each worker
  resolves to its own device index. CuPy is imported lazily.

The memory service never reads or writes KV bytes; it only owns the memory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import time
import uuid
from pathlib import Path

from memory_service.layout import DIM_NAMES, PoolLayout
from pagedkv.cuda_ipc import cuda_uuid_string
from pagedkv.logs import get_logger
from pagedkv.memory.v1 import memory_service_pb2 as pb

log = get_logger("pool")

_POOL_FILE = re.compile(r"pagedkv-(?P<pool_id>[\w.-]+)-g(?P<generation>\d+)-p(?P<pid>\d+)\.kv")


def shm_dir() -> Path:
    """Folder of cpu pool files: ``$PAGEDKV_SHM_DIR`` or ``/dev/shm``."""
    return Path(os.environ.get("PAGEDKV_SHM_DIR", "/dev/shm"))


def _owner_gone(path: Path) -> bool:
    """True when no process holds the pool file's lock (its owner exited or crashed).

    The owner keeps an exclusive ``flock`` for its life; the kernel drops it when
    the owner dies, whatever its pid (pids repeat across container restarts).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        return True
    finally:
        os.close(fd)


def remove_stale_pool_files(directory: Path | None = None) -> list[Path]:
    """Delete cpu pool files whose owner process is gone; returns what was removed."""
    directory = directory or shm_dir()
    removed = []
    for path in directory.glob("pagedkv-*.kv"):
        if _POOL_FILE.fullmatch(path.name) and _owner_gone(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("stale_pool_files_removed", paths=[str(p) for p in removed])
    return removed


def new_generation() -> int:
    """A generation number: microseconds since the epoch, so it grows across restarts."""
    return time.time_ns() // 1000


class Pool:
    """Base: the layout, identity and descriptor of an allocated pool."""

    backend = pb.POOL_BACKEND_UNSPECIFIED

    def __init__(self, layout: PoolLayout, *, pool_id: str | None = None, model: str = ""):
        self.layout = layout
        self.pool_id = pool_id or uuid.uuid4().hex[:12]
        if not re.fullmatch(r"[\w.-]+", self.pool_id):
            raise ValueError(f"pool id {self.pool_id!r} may only hold letters, digits, '_', '.', '-'")
        self.generation = new_generation()
        self.model = model

    def descriptor(self) -> pb.PoolDescriptor:
        """The ``PoolDescriptor`` a worker maps the pool from."""
        lay = self.layout
        return pb.PoolDescriptor(
            pool_id=self.pool_id,
            generation=self.generation,
            backend=self.backend,
            layout=pb.PoolLayout(
                num_layers=lay.num_layers,
                num_kv_heads=lay.num_kv_heads,
                head_dim=lay.head_dim,
                block_size=lay.block_size,
                dtype=lay.dtype,
                num_blocks=lay.num_blocks,
            ),
            dim_names=list(DIM_NAMES),
            shape=list(lay.shape),
            strides=list(lay.strides),
            nbytes=lay.nbytes,
            block_nbytes=lay.block_nbytes,
            model=self.model,
            owner_pid=os.getpid(),
            **self._handle_fields(),
        )

    def _handle_fields(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        """Release the memory (after every importer has been told)."""
        raise NotImplementedError


class CpuPool(Pool):
    """A pool in a shared-memory file (sparse: pages cost memory once written)."""

    backend = pb.POOL_BACKEND_CPU

    def __init__(self, layout: PoolLayout, *, pool_id: str | None = None, model: str = "", directory: Path | None = None):
        super().__init__(layout, pool_id=pool_id, model=model)
        directory = directory or shm_dir()
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_pool_files(directory)
        self.path = directory / f"pagedkv-{self.pool_id}-g{self.generation}-p{os.getpid()}.kv"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for the owner's life: marks the file live
            os.ftruncate(fd, layout.nbytes)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        log.info("pool_created", backend="cpu", path=str(self.path), nbytes=layout.nbytes,
                 num_blocks=layout.num_blocks, generation=self.generation)

    def _handle_fields(self) -> dict:
        return {"shm_path": str(self.path)}

    def map(self) -> mmap.mmap:
        """A writable shared mapping of the whole pool (tests and tools)."""
        with open(self.path, "r+b") as f:
            return mmap.mmap(f.fileno(), self.layout.nbytes, mmap.MAP_SHARED)

    def close(self) -> None:
        if self._lock_fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None
            log.info("pool_released", backend="cpu", path=str(self.path))


class CudaPool(Pool):
    """A pool from plain ``cudaMalloc`` on one GPU, exported by CUDA IPC handle.

    Raises:
        RuntimeError: CuPy is not installed (install ``pagedkv[cuda12]`` or ``[cuda13]``).
    """

    backend = pb.POOL_BACKEND_CUDA

    def __init__(self, layout: PoolLayout, *, device_index: int = 0, pool_id: str | None = None, model: str = ""):
        super().__init__(layout, pool_id=pool_id, model=model)
        try:
            import cupy
        except ImportError as e:
            raise RuntimeError("the cuda pool backend needs CuPy: pip install 'pagedkv[cuda12]' or '[cuda13]'") from e
        self._cupy = cupy
        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            # cupy.cuda.Memory is a direct cudaMalloc (no memory pool), so the IPC
            # handle covers exactly this allocation and the offset is 0.
            self._memory = cupy.cuda.Memory(layout.nbytes)
            cupy.cuda.runtime.memset(self._memory.ptr, 0, layout.nbytes)
            self._handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr))
            props = cupy.cuda.runtime.getDeviceProperties(device_index)
        self.device_uuid = cuda_uuid_string(props["uuid"])
        log.info("pool_created", backend="cuda", device=device_index, uuid=self.device_uuid,
                 nbytes=layout.nbytes, num_blocks=layout.num_blocks, generation=self.generation)

    def _handle_fields(self) -> dict:
        return {"cuda_ipc_handle": self._handle, "cuda_offset": 0, "cuda_device_uuid": self.device_uuid}

    def close(self) -> None:
        if self._memory is not None:
            self._memory = None
            log.info("pool_released", backend="cuda", device=self.device_index)
