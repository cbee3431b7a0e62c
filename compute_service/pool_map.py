"""Map the memory service's pool into this process, zero-copy, as a torch tensor.

DESIGN.md, "The pool" and "Trust model". GetPoolDescriptor (gRPC) gives anyone the layout and
the path of the memory service's worker socket; the handle comes only over that socket
(:mod:`pagedkv.runtime.pool_socket`, same uid only), with the epoch table and the plane key:

- ``cpu``: the pool is a memfd: mmap it (MAP_SHARED) and wrap it with ``torch.frombuffer``;
  writes are seen by every process mapping it.
- ``cuda``: resolve the GPU UUID to this process's device index, open the CUDA IPC handle once
  per process (``cudaIpcOpenMemHandle`` through CuPy) and wrap the pointer as a torch tensor
  through ``__cuda_array_interface__`` (bytes, then ``.view(dtype)``, since bf16 has no type
  string).
- both: the epoch table's read-only memfd, mapped PROT_READ as ``int64[num_blocks +
  host_num_blocks]`` (device epochs, then host-tier epochs).
- the host tier (``host_num_blocks`` > 0; DESIGN.md, "Tiers and transfers"): its memfd (fd
  ``host``), mapped read-write as a CPU tensor ``[host_num_blocks] + shape[1:]`` with the pool's
  per-block strides, on both backends. On a cuda pool the mapping is also page-locked with
  ``cudaHostRegister`` (portable: every context), so offloads and reloads are asynchronous DMA
  copies on the step's stream; it is unregistered before the mapping goes.

The result is the 6-D block-major pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` with the descriptor's strides.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from compute_service.device_sync import synchronize
from pagedkv import config
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.pool_socket import PoolHandle, receive_handle

log = get_logger("pool_map")


@dataclass
class MappedPool:
    """A pool mapped into this process."""

    #: The descriptor it was mapped from (with its handle fields on cuda).
    descriptor: mpb.PoolDescriptor
    #: The pool tensor, [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
    tensor: torch.Tensor
    #: Allocation epoch of each device block, int64 [num_blocks], read-only, shared with the
    #: memory service (which bumps epochs[b] each time block b is handed out anew); the device
    #: part (a view) of ``all_epochs``.
    epochs: np.ndarray | None = None
    #: This generation's 32-byte key for grants and receipts.
    plane_key: bytes = field(default=b"", repr=False)
    #: The host tier, [host_num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in the
    #: pool's dtype, a CPU tensor over shared host memory (page-locked on a cuda pool); None
    #: without a host tier.
    host_tensor: torch.Tensor | None = None
    #: An fp8 pool's static scales as the model takes them (per layer: k_scale, v_scale, each
    #: [num_kv_heads] float32 on the pool's device; `compute_service.kv_calibration.fit_kv_scales`);
    #: None for other dtypes, and until set.
    kv_scales: list | None = None
    #: Epochs of the host tier's blocks, int64 [host_num_blocks] (a view of ``all_epochs``), read-only;
    #: None without a host tier.
    host_epochs: np.ndarray | None = None
    #: The whole epoch table, int64 [num_blocks + host_num_blocks], read-only.
    all_epochs: np.ndarray | None = None
    #: On a CUDA pool with a host tier: whether the tier is page-locked (its copies are asynchronous DMA);
    #: False when the memlock limit refused it. None on a CPU pool or without a host tier.
    host_page_locked: bool | None = None
    #: What keeps the mappings alive (mmap objects, CUDA IPC pointer, host registration), closed in order.
    _keepalive: list = field(default_factory=list, repr=False)

    @property
    def generation(self) -> int:
        return self.descriptor.generation

    @property
    def host_num_blocks(self) -> int:
        """Blocks in the host tier (0: none)."""
        return 0 if self.host_tensor is None else self.host_tensor.shape[0]

    def close(self) -> None:
        """Drop the mapping (the tensors must not be used afterwards). On CUDA, first waits for every
        kernel and copy queued on the pool's device: none may touch memory whose import or
        page-lock (``cudaIpcCloseMemHandle``, ``cudaHostUnregister``) is gone."""
        if self.tensor is not None:
            try:
                synchronize(self.tensor.device)
            except RuntimeError as e:  # a failed device runs nothing more: the mappings can go
                log.error("pool_close_sync_failed", error=str(e))
        self.tensor = None  # type: ignore[assignment]
        self.host_tensor = None
        self.epochs = self.host_epochs = self.all_epochs = None
        keep, self._keepalive = self._keepalive, []
        for k in keep:
            if isinstance(k, mmap.mmap):
                try:
                    k.close()
                except BufferError:
                    pass  # a view is still alive; the mapping goes when it does
            else:
                k.close()


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` exporter for a raw device pointer (bytes)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


class _CudaIpcMapping:
    def __init__(self, ptr: int, device: int):
        self.ptr, self.device = ptr, device

    def close(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)


#: cudaHostRegisterPortable: the range is pinned for every CUDA context, not just this device's.
_CUDA_HOST_REGISTER_PORTABLE = 1


class _HostRegistration:
    """A host range page-locked with ``cudaHostRegister``; ``close`` unregisters it (before its
    mapping goes)."""

    def __init__(self, ptr: int, nbytes: int, device: int):
        import cupy

        with cupy.cuda.Device(device):
            cupy.cuda.runtime.hostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
        self.ptr, self.device = ptr, device

    def close(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.hostUnregister(self.ptr)


def _span_bytes(shape: list[int], strides: list[int], dtype: torch.dtype) -> int:
    """Bytes from the first element of a strided tensor to one past its last."""
    esize = torch.empty((), dtype=dtype).element_size()
    return (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * esize


def _check(desc: mpb.PoolDescriptor) -> tuple[torch.dtype, list[int], list[int]]:
    lay = desc.layout
    try:
        dtype = config.dtype(lay.dtype).torch
    except ValueError as e:
        raise ValueError(f"pool descriptor: {e}") from None
    shape = [int(x) for x in desc.shape]
    strides = [int(x) for x in desc.strides]
    expected = [lay.num_blocks, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim]
    if shape != expected or len(strides) != 6:
        raise ValueError(f"pool descriptor shape {shape} / strides {strides} do not match its layout {expected}")
    span = _span_bytes(shape, strides, dtype)
    if span > desc.nbytes:
        raise ValueError(f"pool descriptor strides reach {span} bytes past a {desc.nbytes}-byte pool")
    if desc.host_num_blocks:
        span = _span_bytes([desc.host_num_blocks, *shape[1:]], strides, dtype)
        if span > desc.host_nbytes:
            raise ValueError(f"the host tier's {desc.host_num_blocks} blocks reach {span} bytes past its "
                             f"{desc.host_nbytes} bytes")
    return dtype, shape, strides


#: The first compute capability with e4m3 conversions in hardware (Ada, sm_89): Triton's fp8 casts need it.
FP8_MIN_CAPABILITY = (8, 9)


def check_fp8_capability(dtype: torch.dtype, capability: tuple[int, int], device: str) -> None:
    """Refuse an fp8 (e4m3) pool on a GPU below compute capability 8.9.

    Raises:
        ValueError: naming the GPU's capability and what to do instead.
    """
    if dtype == torch.float8_e4m3fn and tuple(capability) < FP8_MIN_CAPABILITY:
        raise ValueError(f"the pool's KV cache is fp8 (e4m3), and {device} has compute capability "
                         f"{capability[0]}.{capability[1]}; fp8 needs {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                         "or later (Ada, Hopper): start the memory service with --kv-cache-dtype auto or bfloat16")


def map_pool(desc: mpb.PoolDescriptor, socket_path: str | None = None, timeout: float = 10.0) -> MappedPool:
    """Receive the pool ``desc`` (the public descriptor) describes from its worker socket and map it.

    Args:
        desc: GetPoolDescriptor's answer (layout, identity, ``worker_socket``).
        socket_path: the worker socket's path in this process's filesystem when it differs from
            ``desc.worker_socket`` (a container mounting it elsewhere: ``--memory-socket``).
        timeout: seconds for the socket exchange.

    Raises:
        ValueError: no socket path, a socket serving another pool or generation, an inconsistent
            descriptor, an unknown backend.
        OSError: the socket cannot be reached (the memory service stopped; the path is not shared
            with this container) or refused this process (another uid: ConnectionError).
        LookupError: no visible GPU has the pool's UUID.
    """
    path = socket_path or desc.worker_socket
    if not path:
        raise ValueError("the memory service names no worker socket in its pool descriptor; pass --memory-socket PATH")
    handle = receive_handle(path, timeout)
    try:
        got = handle.descriptor
        if (got.pool_id, got.generation) != (desc.pool_id, desc.generation):
            raise ValueError(
                f"the worker socket {path} serves pool {got.pool_id!r} generation {got.generation}, but the memory "
                f"service's descriptor names pool {desc.pool_id!r} generation {desc.generation}: --memory-socket must "
                "name that service's socket (or it restarted just now: retry)")
        return map_handle(handle)
    finally:
        handle.close()


def _map_fd(handle: PoolHandle, name: str, nbytes: int, prot: int) -> mmap.mmap:
    fd = handle.fds.get(name)
    if fd is None:
        raise ValueError(f"the worker socket sent no {name!r} fd (got {sorted(handle.fds)})")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise ValueError(f"the {name} memfd holds {size} bytes, the descriptor needs {nbytes}")
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)


def map_handle(handle: PoolHandle) -> MappedPool:
    """Map what the worker socket sent (the fds stay open: the caller closes them).

    Raises:
        ValueError: an inconsistent descriptor, a missing or short fd, an unknown backend, an fp8
            pool on a GPU below compute capability 8.9 (:func:`check_fp8_capability`).
        LookupError: no visible GPU has the pool's UUID.
    """
    desc = handle.descriptor
    if desc.backend not in (mpb.POOL_BACKEND_CPU, mpb.POOL_BACKEND_CUDA):
        raise ValueError(f"unknown pool backend {desc.backend}; this worker maps cpu and cuda pools")
    dtype, shape, strides = _check(desc)
    num_blocks, host_blocks = desc.layout.num_blocks, desc.host_num_blocks
    # What keeps the mappings alive, in the order MappedPool.close (or a failure here) closes them.
    keep: list = [_map_fd(handle, "epochs", 8 * (num_blocks + host_blocks), mmap.PROT_READ)]
    all_epochs = np.frombuffer(keep[0], dtype=np.int64)  # read-only: the mapping is PROT_READ
    try:
        host, page_locked = None, None
        if host_blocks:
            host_mm = _map_fd(handle, "host", desc.host_nbytes, mmap.PROT_READ | mmap.PROT_WRITE)
            keep.insert(0, host_mm)
            host = torch.frombuffer(host_mm, dtype=torch.uint8).view(dtype).as_strided(
                [host_blocks, *shape[1:]], strides)
        if desc.backend == mpb.POOL_BACKEND_CPU:
            mm = _map_fd(handle, "pool", desc.nbytes, mmap.PROT_READ | mmap.PROT_WRITE)
            keep.insert(0, mm)
            tensor = torch.frombuffer(mm, dtype=torch.uint8).view(dtype).as_strided(shape, strides)
        else:
            import cupy

            from pagedkv.runtime.cuda_ipc import device_index_for_uuid

            index = device_index_for_uuid(desc.cuda_device_uuid)
            check_fp8_capability(dtype, torch.cuda.get_device_capability(index), f"cuda:{index}")
            with cupy.cuda.Device(index):
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes(desc.cuda_ipc_handle))
            keep.insert(0, _CudaIpcMapping(ptr, index))
            raw = torch.as_tensor(_CudaArray(ptr + desc.cuda_offset, desc.nbytes), device=f"cuda:{index}")
            tensor = raw.view(dtype).as_strided(shape, strides)
            if host is not None:  # unregistered first, before its mapping closes
                try:
                    keep.insert(0, _HostRegistration(host.data_ptr(), desc.host_nbytes, index))
                    page_locked = True
                except Exception as e:  # noqa: BLE001 - e.g. RLIMIT_MEMLOCK below the tier's size
                    page_locked = False
                    log.warning("host_tier_not_page_locked", error=str(e), nbytes=desc.host_nbytes,
                                hint="raise the memlock limit (ulimit -l unlimited; compose: ulimits: memlock: -1); "
                                     "until then the host tier's copies are synchronous")
        return MappedPool(desc, tensor, all_epochs[:num_blocks], handle.plane_key, _keepalive=keep,
                          host_tensor=host, host_epochs=all_epochs[num_blocks:] if host_blocks else None,
                          all_epochs=all_epochs, host_page_locked=page_locked)
    except BaseException:
        del all_epochs
        host = None
        for k in keep:
            try:
                k.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes when it does
        raise
