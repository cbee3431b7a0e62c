"""CUDA helpers shared by the pool owner and its importers (CuPy imported lazily)."""

from __future__ import annotations


def cuda_uuid_string(raw: bytes) -> str:
    """Format a 16-byte CUDA device UUID as nvidia-smi does: ``GPU-8-4-4-4-12`` hex groups.

    Raises:
        ValueError: ``raw`` is not 16 bytes.
    """
    h = bytes(raw).hex()
    if len(h) != 32:
        raise ValueError(f"a CUDA UUID has 16 bytes, got {len(bytes(raw))}")
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_index_for_uuid(uuid: str) -> int:
    """This process's CUDA device index of the GPU named ``uuid``.

    The index differs between containers (CUDA_VISIBLE_DEVICES), the UUID does not.

    Raises:
        LookupError: no visible device has that UUID.
    """
    import cupy

    seen = []
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        u = cuda_uuid_string(cupy.cuda.runtime.getDeviceProperties(i)["uuid"])
        if u == uuid:
            return i
        seen.append(u)
    raise LookupError(
        f"no visible GPU has UUID {uuid} (visible: {seen or 'none'}); run the worker on the same "
        "physical GPU as the memory service (check CUDA_VISIBLE_DEVICES / the compose device ids)"
    )
