"""The pool's memory: one allocation per (device, layout), handed only to workers.

DESIGN.md, "The pool" and "Trust model". Two backends, one descriptor:

- ``cpu``: an anonymous memfd (``memfd:pagedkv-pool-<pool_id>-g<generation>``), sealed against
  shrinking and growing. No file name exists anywhere: workers get the fd over the worker
  socket (:mod:`memory_service.worker_socket`) and mmap it; the memory dies with its last
  holder, so a SIGKILLed memory service leaves nothing behind once its workers drop the mapping.
- ``cuda``: plain ``cudaMalloc`` through CuPy (not a caching-allocator interior, not expandable
  segments), exported with ``cudaIpcGetMemHandle`` (64 bytes) plus the byte offset and the GPU's
  UUID, which each worker resolves to its own device index. The handle also travels only over
  the worker socket. CuPy is imported lazily.

Every pool, whatever its backend, also owns per generation:

- the host tier (``host_num_blocks`` > 0; DESIGN.md, "Tiers and transfers"): host memory on both
  backends, a sealed memfd ``memfd:pagedkv-host-<pool_id>-g<generation>`` of ``host_num_blocks``
  blocks with the pool's per-block layout (shape ``[host_num_blocks] + shape[1:]``, block-major,
  ``block_nbytes`` each). Workers map it read-write (fd ``host``; on GPU nodes they also
  ``cudaHostRegister`` it) and do the offload / reload copies grants name; the memory service
  only keeps its books.
- ``all_epochs``: int64[num_blocks + host_num_blocks] in a small memfd, zeros at start, mapped
  read-write here: ``epochs`` (a view, int64[num_blocks]) for the device blocks, ``host_epochs``
  (a view, int64[host_num_blocks]) for the host tier (host block h is ``all_epochs[num_blocks +
  h]``). The block manager bumps a block's epoch each time it is handed out anew. Workers map
  the whole table read-only (they get a read-only fd) to check a grant's block and copy epochs.
- ``plane_key``: 32 random bytes that sign grants and receipts of this generation.

``descriptor()`` is the public view (layout and the worker socket's path, no handle), what
GetPoolDescriptor returns to anyone; ``worker_descriptor()`` and ``worker_fds()`` are what the
worker socket sends. The memory service never reads or writes KV bytes; it only owns the memory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import time
import uuid

import numpy as np

from memory_service.layout import DIM_NAMES, PoolLayout
from pagedkv.config import FP8
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.runtime.cuda_ipc import cuda_uuid_string
from pagedkv.runtime.errors import FailedPreconditionError, InvalidArgumentError
from pagedkv.runtime.kv_scales import check_scales
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.pool_socket import PLANE_KEY_BYTES

log = get_logger("pool")

#: Seals on every memfd: a holder (a worker) can neither shrink it (SIGBUS here) nor grow it.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Longest memfd name Linux keeps (249 bytes).
_MEMFD_NAME_BYTES = 249


def new_generation() -> int:
    """A generation number: microseconds since the epoch, so it grows across restarts."""
    return time.time_ns() // 1000


def sealed_memfd(name: str, nbytes: int) -> int:
    """A close-on-exec memfd of ``nbytes`` zero bytes (sparse), sealed at that size.

    Raises:
        OSError: the kernel refused (no memfd support, or out of memory for the size).
    """
    fd = os.memfd_create(name[:_MEMFD_NAME_BYTES], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_only_fd(fd: int) -> int:
    """A second, read-only open of the memfd ``fd`` (through /proc): mappable only PROT_READ."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


class EpochTable:
    """``int64[n]`` allocation epochs in a memfd (n = device blocks + host blocks): read-write here,
    read-only for workers.

    Attributes:
        array: the shared numpy view (writes are seen by every worker's mapping at once).
        fd: the read-write memfd; ``ro_fd``: its read-only twin, the one workers get.
    """

    def __init__(self, num_blocks: int, name: str):
        nbytes = 8 * num_blocks
        self.fd = sealed_memfd(name, nbytes)
        self.ro_fd = read_only_fd(self.fd)
        self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED)
        self.array = np.frombuffer(self._map, dtype=np.int64)

    def close(self) -> None:
        """Close both fds; the mapping goes when the last view of ``array`` does."""
        if self.fd is None:
            return
        os.close(self.ro_fd)
        os.close(self.fd)
        self.fd = self.ro_fd = None
        self.array = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view (e.g. the block manager's) still holds it; freed with that view


class Pool:
    """Base: the layout, identity, host tier, epoch table, plane key and descriptors of an allocated pool.

    Args:
        layout: the pool's layout (device blocks).
        pool_id: stable name (letters, digits, '_', '.', '-'); default a random one.
        model: the model the pool is laid out for (shown in the descriptor).
        host_num_blocks: blocks of the host tier, same per-block layout (0: no host tier).

    Raises:
        ValueError: a bad pool id or a negative ``host_num_blocks``.
        OSError: the kernel could not create a memfd.
    """

    backend = pb.POOL_BACKEND_UNSPECIFIED
    #: Where the disk tier's slots are (set by the service when it has one; in the descriptor).
    disk_tier: pb.DiskTierInfo | None = None
    #: How the pool's size was decided (set by the service, memory_service.sizing; in GetStats).
    sizing: pb.PoolSizing | None = None

    def __init__(self, layout: PoolLayout, *, pool_id: str | None = None, model: str = "", host_num_blocks: int = 0):
        self.layout = layout
        self.pool_id = pool_id or uuid.uuid4().hex[:12]
        if not re.fullmatch(r"[\w.-]+", self.pool_id):
            raise ValueError(f"pool id {self.pool_id!r} may only hold letters, digits, '_', '.', '-'")
        if host_num_blocks < 0:
            raise ValueError(f"host_num_blocks must be >= 0, got {host_num_blocks}")
        self.generation = new_generation()
        self.model = model
        #: Signs grants and receipts of this generation (32 bytes); workers get it over the socket.
        self.plane_key = os.urandom(PLANE_KEY_BYTES)
        #: An fp8 pool's static KV scales once set (:meth:`set_kv_scales`), kept for the generation.
        self.kv_scales: pb.KvScales | None = None
        #: Blocks in the host tier (0: none) and its size in bytes.
        self.host_num_blocks = host_num_blocks
        self.host_nbytes = host_num_blocks * layout.block_nbytes
        num_blocks = layout.num_blocks
        self._epochs = EpochTable(num_blocks + host_num_blocks, f"pagedkv-epochs-{self.pool_id}-g{self.generation}")
        #: int64[num_blocks + host_num_blocks]: device epochs, then host epochs; zeros at start,
        #: shared read-only with every worker.
        self.all_epochs: np.ndarray = self._epochs.array
        #: int64[num_blocks], the device part of ``all_epochs`` (a view): what the block pool bumps.
        self.epochs: np.ndarray = self.all_epochs[:num_blocks]
        #: int64[host_num_blocks], the host part of ``all_epochs`` (a view): host block h's epoch.
        self.host_epochs: np.ndarray = self.all_epochs[num_blocks:]
        self._host_fd: int | None = None
        if host_num_blocks:
            self.host_memfd_name = f"pagedkv-host-{self.pool_id}-g{self.generation}"
            try:
                self._host_fd = sealed_memfd(self.host_memfd_name, self.host_nbytes)
            except BaseException:
                self._epochs.close()
                raise
            log.info("host_tier_created", memfd=self.host_memfd_name, nbytes=self.host_nbytes,
                     host_num_blocks=host_num_blocks, generation=self.generation)
        #: Path of the worker socket serving this pool ("" until one listens); in the descriptor.
        self.worker_socket = ""

    def descriptor(self) -> pb.PoolDescriptor:
        """The public ``PoolDescriptor``: layout, identity and ``worker_socket``, no handle."""
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
                dtype=lay.dtype.name,
                num_blocks=lay.num_blocks,
            ),
            dim_names=list(DIM_NAMES),
            shape=list(lay.shape),
            strides=list(lay.strides),
            nbytes=lay.nbytes,
            block_nbytes=lay.block_nbytes,
            model=self.model,
            owner_pid=os.getpid(),
            worker_socket=self.worker_socket,
            host_num_blocks=self.host_num_blocks,
            host_nbytes=self.host_nbytes,
            kv_scales=self.kv_scales,
            disk_tier=self.disk_tier,
        )

    def set_kv_scales(self, scales: pb.KvScales) -> tuple[pb.KvScales, bool]:
        """Keep ``scales`` as this fp8 pool's KV scales unless some are kept already (first wins:
        KV written with them must keep reading with them). Returns the kept scales and whether
        they are ``scales``.

        Raises:
            FailedPreconditionError: the pool is not fp8.
            InvalidArgumentError: scales of the wrong count, or not finite and > 0.
        """
        lay = self.layout
        if not lay.dtype.is_fp8:
            raise FailedPreconditionError(f"this pool holds {lay.dtype} KV, which takes no scales; only an "
                                          f"{FP8} pool (--kv-cache-dtype fp8) does")
        try:
            check_scales(scales, lay.num_layers, lay.num_kv_heads)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
        if self.kv_scales is not None:
            return self.kv_scales, False
        self.kv_scales = pb.KvScales()
        self.kv_scales.CopyFrom(scales)
        log.info("kv_scales_set", source=scales.source, generation=self.generation,
                 k_scale_max=max(scales.k_scale), v_scale_max=max(scales.v_scale))
        return self.kv_scales, True

    def worker_descriptor(self) -> pb.PoolDescriptor:
        """The descriptor with the handle fields: only for the worker socket, never an RPC."""
        desc = self.descriptor()
        for name, value in self._handle_fields().items():
            setattr(desc, name, value)
        return desc

    def worker_fds(self) -> dict[str, int]:
        """The fds a worker gets, by name: ``pool`` (cpu only), ``epochs`` (read-only, the whole
        table) and ``host`` (read-write; only with a host tier)."""
        fds = {**self._handle_fds(), "epochs": self._epochs.ro_fd}
        if self._host_fd is not None:
            fds["host"] = self._host_fd
        return fds

    def map_host(self) -> mmap.mmap:
        """A writable shared mapping of the whole host tier (tests and tools).

        Raises:
            ValueError: the pool has no host tier (or it was released).
        """
        if self._host_fd is None:
            raise ValueError("this pool has no host tier (host_num_blocks=0) or it was released")
        return mmap.mmap(self._host_fd, self.host_nbytes, mmap.MAP_SHARED)

    def _handle_fields(self) -> dict:
        raise NotImplementedError

    def _handle_fds(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        """Release the memory (after every importer has been told)."""
        if self._host_fd is not None:
            os.close(self._host_fd)  # the host tier goes when the last worker unmaps it
            self._host_fd = None
        self._epochs.close()


class CpuPool(Pool):
    """A pool in a sealed memfd (sparse: pages cost memory once written).

    Raises:
        OSError: the kernel could not create the memfd.
    """

    backend = pb.POOL_BACKEND_CPU

    def __init__(self, layout: PoolLayout, *, pool_id: str | None = None, model: str = "", host_num_blocks: int = 0):
        super().__init__(layout, pool_id=pool_id, model=model, host_num_blocks=host_num_blocks)
        self.memfd_name = f"pagedkv-pool-{self.pool_id}-g{self.generation}"
        try:
            self._fd: int | None = sealed_memfd(self.memfd_name, layout.nbytes)
        except BaseException:
            super().close()
            raise
        log.info("pool_created", backend="cpu", memfd=self.memfd_name, nbytes=layout.nbytes,
                 num_blocks=layout.num_blocks, generation=self.generation)

    def _handle_fields(self) -> dict:
        return {}  # the handle is the fd itself

    def _handle_fds(self) -> dict[str, int]:
        assert self._fd is not None, "the pool was released"
        return {"pool": self._fd}

    def map(self) -> mmap.mmap:
        """A writable shared mapping of the whole pool (tests and tools)."""
        assert self._fd is not None, "the pool was released"
        return mmap.mmap(self._fd, self.layout.nbytes, mmap.MAP_SHARED)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the memory goes when the last worker unmaps it
            self._fd = None
            super().close()
            log.info("pool_released", backend="cpu", memfd=self.memfd_name)


class CudaPool(Pool):
    """A pool from plain ``cudaMalloc`` on one GPU, exported by CUDA IPC handle.

    Raises:
        RuntimeError: CuPy is not installed (install ``pagedkv[cuda12]`` or ``[cuda13]``).
    """

    backend = pb.POOL_BACKEND_CUDA

    def __init__(self, layout: PoolLayout, *, device_index: int = 0, pool_id: str | None = None, model: str = "",
                 host_num_blocks: int = 0):
        try:
            import cupy
        except ImportError as e:
            raise RuntimeError("the cuda pool backend needs CuPy: pip install 'pagedkv[cuda12]' or '[cuda13]'") from e
        super().__init__(layout, pool_id=pool_id, model=model, host_num_blocks=host_num_blocks)
        self._cupy = cupy
        self.device_index = device_index
        try:
            with cupy.cuda.Device(device_index):
                # cupy.cuda.Memory is a direct cudaMalloc (no memory pool), so the IPC
                # handle covers exactly this allocation and the offset is 0.
                self._memory = cupy.cuda.Memory(layout.nbytes)
                cupy.cuda.runtime.memset(self._memory.ptr, 0, layout.nbytes)
                # The zeros are in place before the handle can be published: a worker's stream is
                # not ordered after this process's work.
                cupy.cuda.runtime.deviceSynchronize()
                self._handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr))
                props = cupy.cuda.runtime.getDeviceProperties(device_index)
        except BaseException:
            super().close()
            raise
        self.device_uuid = cuda_uuid_string(props["uuid"])
        log.info("pool_created", backend="cuda", device=device_index, uuid=self.device_uuid,
                 nbytes=layout.nbytes, num_blocks=layout.num_blocks, generation=self.generation)

    def _handle_fields(self) -> dict:
        return {"cuda_ipc_handle": self._handle, "cuda_offset": 0, "cuda_device_uuid": self.device_uuid}

    def close(self) -> None:
        if self._memory is not None:
            self._memory = None
            super().close()
            log.info("pool_released", backend="cuda", device=self.device_index)
