"""Shared host-side helpers: backend choice and argument checks.

Every public op validates its arguments here, before any launch, so that a bad shape, dtype or
layout is a `ValueError` with an actionable message instead of a wrong answer or a device fault.
Checks that would need a device-to-host sync (values inside `seq_lens`, `slot_mapping`, ...) are
done only on the torch path, whose tensors live on the host.
"""

from __future__ import annotations

import torch

from pagedkv.config import DTYPES, env

BACKENDS = ("triton", "torch")

# Key/value cache dtypes the ops accept (fp32 or bf16 on CPU, bf16/fp16 on CUDA; fp8 e4m3 with
# per-KV-head scales anywhere: `kernels.fp8`).
CACHE_DTYPES = tuple(d.torch for d in DTYPES.values())
# Dtypes of queries and of new key/value rows (never fp8: they are quantized on write).
QUERY_DTYPES = tuple(d.torch for d in DTYPES.values() if d.computes)


def choose_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """Resolve `backend`: None picks "triton" for CUDA tensors and "torch" otherwise.

    Raises:
        ValueError: unknown backend name, tensors on different devices, or "triton" asked for
            CPU tensors without `TRITON_INTERPRET=1`.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices))
    if backend is None:
        return "triton" if device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and device.type != "cuda":
        if not env("TRITON_INTERPRET"):
            raise ValueError(
                "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton "
                f"is imported); got tensors on {device}"
            )
    return backend


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check one layer's cache views; return (num_blocks, block_size, num_kv_heads, head_dim)."""
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "must have the same shape"
        )
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"key/value cache dtypes must match and be one of {CACHE_DTYPES}, "
            f"got {key_cache.dtype} and {value_cache.dtype}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of key_cache/value_cache must be contiguous (stride 1)")
    return tuple(key_cache.shape)  # type: ignore[return-value]


def check_int_vector(name: str, t: torch.Tensor, length: int | None, dtypes) -> None:
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"[{length}]" if length is not None else "1-D"
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {t.dtype}")


def check_host_lengths(
    seq_lens: torch.Tensor, q_lens: torch.Tensor, block_size: int, max_blocks: int
) -> None:
    """Value checks (host tensors only): 1 <= q_len <= seq_len, table wide enough.

    A sequence must have at least one query token; `q_len` may be 0 only if its seq_len is too
    (nothing to attend to and nothing to write).
    """
    if bool(((q_lens > 0) & (seq_lens < 1)).any()):
        raise ValueError("seq_lens must be >= 1 for a sequence with query tokens")
    if bool((q_lens < 0).any()) or bool((seq_lens < q_lens).any()):
        raise ValueError("every sequence needs 0 <= new tokens <= seq_len (tokens in cache)")
    if seq_lens.numel() and int(seq_lens.max()) > block_size * max_blocks:
        raise ValueError(
            f"a seq_len ({int(seq_lens.max())}) exceeds the block table's capacity "
            f"({max_blocks} blocks x {block_size} tokens)"
        )
