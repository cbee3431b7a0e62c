"""Map the memory service's pool into this process, zero-copy, as a torch tensor.

DESIGN.md, "The pool". From a ``PoolDescriptor`` alone:

- ``cpu``: mmap the shared-memory file (MAP_SHARED) and wrap it with
  ``torch.frombuffer``: writes are seen by every process mapping the file.
- ``cuda``: resolve the GPU UUID to this process's device index, open the CUDA
  IPC handle once per process (``cudaIpcOpenMemHandle`` through CuPy) and wrap
  the pointer as a torch tensor through ``__cuda_array_interface__`` (bytes,
  then ``.view(dtype)``, since bf16 has no type string).

The result is the 6-D block-major pool ``[num_blocks, num_layers, 2,
block_size, num_kv_heads, head_dim]`` with the descriptor's strides.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch

from pagedkv.memory.v1 import memory_service_pb2 as mpb

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class MappedPool:
    """A pool mapped into this process."""

    #: The descriptor it was mapped from.
    descriptor: mpb.PoolDescriptor
    #: The pool tensor, [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
    tensor: torch.Tensor
    #: What keeps the mapping alive (mmap object or CUDA IPC pointer).
    _keepalive: object = field(default=None, repr=False)

    @property
    def generation(self) -> int:
        return self.descriptor.generation

    def close(self) -> None:
        """Drop the mapping (the tensor must not be used afterwards)."""
        self.tensor = None  # type: ignore[assignment]
        keep, self._keepalive = self._keepalive, None
        if isinstance(keep, mmap.mmap):
            try:
                keep.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes when it does
        elif isinstance(keep, _CudaIpcMapping):
            keep.close()


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` exporter for a raw device pointer (bytes)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class _CudaIpcMapping:
    def __init__(self, ptr: int, device: int):
        self.ptr, self.device = ptr, device

    def close(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)


def _check(desc: mpb.PoolDescriptor) -> tuple[torch.dtype, list[int], list[int]]:
    lay = desc.layout
    if lay.dtype not in TORCH_DTYPES:
        raise ValueError(f"pool dtype {lay.dtype!r} is not one of {sorted(TORCH_DTYPES)}")
    shape = [int(x) for x in desc.shape]
    strides = [int(x) for x in desc.strides]
    expected = [lay.num_blocks, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim]
    if shape != expected or len(strides) != 6:
        raise ValueError(f"pool descriptor shape {shape} / strides {strides} do not match its layout {expected}")
    esize = torch.empty((), dtype=TORCH_DTYPES[lay.dtype]).element_size()
    span = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * esize
    if span > desc.nbytes:
        raise ValueError(f"pool descriptor strides reach {span} bytes past a {desc.nbytes}-byte pool")
    return TORCH_DTYPES[lay.dtype], shape, strides


def map_pool(desc: mpb.PoolDescriptor) -> MappedPool:
    """Map the pool ``desc`` describes.

    Raises:
        ValueError: an inconsistent descriptor or an unknown backend.
        FileNotFoundError: the cpu pool file is gone (the memory service stopped).
        LookupError: no visible GPU has the pool's UUID.
    """
    dtype, shape, strides = _check(desc)
    if desc.backend == mpb.POOL_BACKEND_CPU:
        with open(desc.shm_path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), desc.nbytes, mmap.MAP_SHARED)
        raw = torch.frombuffer(mm, dtype=torch.uint8)
        tensor = raw.view(dtype).as_strided(shape, strides)
        return MappedPool(desc, tensor, mm)
    if desc.backend == mpb.POOL_BACKEND_CUDA:
        import cupy

        from pagedkv.cuda_ipc import device_index_for_uuid

        index = device_index_for_uuid(desc.cuda_device_uuid)
        with cupy.cuda.Device(index):
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes(desc.cuda_ipc_handle))
        raw = torch.as_tensor(_CudaArray(ptr + desc.cuda_offset, desc.nbytes), device=f"cuda:{index}")
        tensor = raw.view(dtype).as_strided(shape, strides)
        return MappedPool(desc, tensor, _CudaIpcMapping(ptr, index))
    raise ValueError(f"unknown pool backend {desc.backend}; this worker maps cpu and cuda pools")
