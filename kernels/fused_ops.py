"""The elementwise ops of a Llama block, each one call: native fused kernels on CPU, torch ops
elsewhere.

`rms_norm`, `add_rms_norm` (vLLM's `fused_add_rms_norm`: the residual add and the next norm),
`silu_mul` (SwiGLU's silu(gate) * up) and `rope` (rotate-half RoPE). On CPU fp32 / bf16 tensors,
with the native library built (`kernels.cpu.native.available()`), each goes to one C kernel
(`kernels.cpu.fused`); otherwise (CUDA, fp16, PAGEDKV_NATIVE_CPU=0) to the torch ops below, which
are also the references the kernels are tested against. Both paths compute in fp32 and round to
the dtype; in bf16 they may differ by one ulp (torch rounds between its ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import fused as cpu_fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] -> [T, D] x / sqrt(mean(x^2) + eps) * weight (weight: [D], x's dtype)."""
    if cpu_fused.wanted(x):
        return cpu_fused.rms_norm(x, weight, eps)
    # One op: statistics and scaling in fp32 for bf16/fp16 inputs, one rounding at the end
    # (transformers' LlamaRMSNorm rounds before the weight multiply: within one bf16 ulp).
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place (the new residual stream, rounded to the dtype), then return
    rms_norm(residual) * weight. x, residual: [T, D], one dtype; weight: [D]."""
    if cpu_fused.wanted(x):
        return cpu_fused.add_rms_norm(x, residual, weight, eps)
    residual.add_(x)
    return F.rms_norm(residual, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] = [gate | up] -> [T, I] silu(gate) * up."""
    if cpu_fused.wanted(gate_up):
        return cpu_fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x: [T, H, Dh] (rows and heads may be strided) with cos, sin: [T, 1, Dh]
    from `signed_sin`. Returns [T, H, Dh]: `x` itself, rotated in place, on the native path (x
    must then be scratch the caller owns, e.g. the QKV projection's output); a new contiguous
    tensor from `apply_rope` otherwise."""
    if cpu_fused.wanted(x):
        return cpu_fused.rope_(x, cos, sin)
    return apply_rope(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, as transformers' `apply_rotary_pos_emb`: x * cos + rotate_half(x) * sin.

    x: [T, H, Dh] (any strides); cos: [T, 1, Dh], each frequency twice; sin: [T, 1, Dh] with the
    first half negated (`signed_sin`), so that rotate_half(x) * sin(θ) == roll(x, Dh/2) * sin:
    three ops instead of six. Returns [T, H, Dh] contiguous, in x's dtype.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., Dh] sin with each frequency twice -> its first half negated (see `apply_rope`)."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)
