"""The fp8 KV-cache format: e4m3 values with a static scale per KV head.

After vLLM's fp8 KV cache (`--kv-cache-dtype fp8`, `kv_cache_dtype="fp8_e4m3"`): keys and values
are stored as float8_e4m3fn (1 sign, 4 exponent, 3 mantissa bits; finite up to 448, no infinity,
0x7F / 0xFF is NaN) divided by a static scale, and read back as `fp8 * scale`. The scales are
per layer and, here, per KV head (vLLM's per-tensor scale is the case of equal heads); a model
step passes each layer's scales to every op (`kernels.reshape_and_cache`,
`kernels.paged_attention`), as vLLM passes `layer._k_scale` / `layer._v_scale`.

`quantize_fp8` is the definition that every write path matches bit for bit (torch, Triton):
divide by the scale in fp32 (IEEE round to nearest), saturate to ±448 (as vLLM's static fp8
quantization does; NaN stays NaN), round to nearest even. Reads widen the e4m3 values exactly
(e4m3 fits in fp16, bf16 and fp32) and apply the scale in fp32.

NOTE: scales are the caller's contract, never checked by value (that would read the device):
positive and finite. A zero, negative or non-finite scale gives NaN or wrong signs, silently.
"""

from __future__ import annotations

import torch

from pagedkv.config import FP8

#: The torch dtype of the fp8 KV cache (:data:`pagedkv.config.FP8`).
FP8_DTYPE = FP8.torch
# Largest finite e4m3fn value (torch.finfo(torch.float8_e4m3fn).max).
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` as float8_e4m3fn, saturating: the stored form of keys or values.

    Args:
        x: [..., num_kv_heads, head_dim], any float dtype.
        scale: [num_kv_heads] float32 (> 0, finite), on x's device.

    Returns:
        float8_e4m3fn of x's shape: `(x.float() / scale[:, None]).clamp(-448, 448)` rounded to
        nearest even; NaN stays NaN (0x7F, with x's sign bit).
    """
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`x * scale` in `dtype`: the values an fp8 cache stands for.

    Args:
        x: [..., num_kv_heads, head_dim] float8_e4m3fn.
        scale: [num_kv_heads] float32, on x's device.
        dtype: the result's dtype (the product is taken in fp32, then cast).
    """
    return (x.to(torch.float32) * scale[:, None]).to(dtype)


# `widen_to_fp16` returns e4m3 values times this: 2^-8 (7, e4m3's exponent bias, less fp16's 15).
WIDENED_UNIT = 2.0**-8


def widen_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values (or their uint8 bytes) as fp16 holding `value * WIDENED_UNIT`,
    exactly, NaN kept: several times faster on the CPU than torch's own fp8 conversion.

    Shifted left by 7, a byte's sign lands on fp16's sign bit and its 4-bit exponent and 3-bit
    mantissa on fp16's low exponent and high mantissa bits: the fp16 of the same significand
    whose exponent bias is 15 instead of 7 (subnormals included); the NaN pattern (all ones)
    gets fp16's all-ones exponent. The native CPU kernel decodes the same way.
    """
    h = x.view(torch.int8).to(torch.int16).bitwise_left_shift_(7).bitwise_and_(-0x4080)  # 0xBF80
    # The NaN pattern 0x3F80 carries into fp16's top exponent bit 0x4000; no other does.
    h.bitwise_or_((h & 0x3F80).add_(0x80).bitwise_and_(0x4000))
    return h.view(torch.float16)


def is_fp8(t: torch.Tensor) -> bool:
    """Whether `t` holds fp8 (e4m3) values."""
    return t.dtype == FP8_DTYPE


def check_kv_scales(key_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """Check a layer's KV scales against its cache (shapes, dtypes, devices; never values).

    Args:
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim] of the layer.
        k_scale, v_scale: for a float8_e4m3fn cache, each [num_kv_heads] float32, contiguous, on
            the cache's device (positive and finite: the caller's contract, see the module's
            NOTE); for a cache of any other dtype, None.

    Raises:
        ValueError: a scale missing for an fp8 cache, given for another cache, or of the wrong
            shape (e.g. [num_layers, num_kv_heads]: pass one layer's row), dtype, device or
            layout.
    """
    num_kv_heads = key_cache.shape[-2] if key_cache.dim() >= 2 else None
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not is_fp8(key_cache):
            if s is not None:
                raise ValueError(
                    f"{name} is for fp8 (float8_e4m3fn) caches only; this cache is {key_cache.dtype}: "
                    f"pass {name}=None"
                )
            continue
        if s is None:
            raise ValueError(
                f"an fp8 (float8_e4m3fn) cache needs {name}: [num_kv_heads] float32 scales of the layer"
            )
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{name} must be a [{num_kv_heads}] float32 tensor, got {type(s).__name__}")
        if s.dim() != 1 or s.shape[0] != num_kv_heads:
            raise ValueError(
                f"{name} must be [num_kv_heads] = [{num_kv_heads}] (one layer's scales), "
                f"got shape {tuple(s.shape)}"
            )
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {s.dtype}")
        if s.device != key_cache.device:
            raise ValueError(f"{name} must be on the cache's device {key_cache.device}, got {s.device}")
        if not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got stride {s.stride()}")
