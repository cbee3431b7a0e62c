"""Native CPU kernels for the elementwise ops of a Llama block, fp32 and bf16: RMSNorm, the
residual add fused with the next RMSNorm, SwiGLU's silu(gate) * up, and RoPE in place.

In torch 2.13 on CPU `F.rms_norm` is a composite of ~8 ops with dtype copies (~100 us a call for
one token), and silu, mul and rotate-half RoPE each make a pass and a temporary. The C kernels in
`csrc/fused_cpu.c` (built into the library of `kernels.cpu.native`) do each op in one pass over
its rows, fp32 arithmetic inside, one bf16 rounding (to nearest even) per output element. The
residual add follows vLLM's `fused_add_rms_norm`: `residual += x` in place, then the norm of the
new residual. Rows go to torch's OpenMP threads only for large calls (prefill).

Callers check `wanted(x)` first (`kernels.fused_ops` does and falls back to torch ops). The
wrappers check shapes, dtypes and layouts and raise ValueError before anything is written.
"""

from __future__ import annotations

import array
import ctypes

import torch

from kernels.cpu import native as cpu_native

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
#: The library of `kernels.cpu.native` holds these ops too (csrc/fused_cpu.c).
_LIBRARY = cpu_native.LIBRARY
_LIBRARY.declare("rms_norm_packed", [ctypes.c_void_p, ctypes.c_float])
_LIBRARY.declare("silu_mul_packed", [ctypes.c_void_p])
_LIBRARY.declare("rope_packed", [ctypes.c_void_p])


def wanted(x: torch.Tensor) -> bool:
    """Whether ops on `x` go native: a CPU fp32 or bf16 tensor and the library built (and not
    switched off by `cpu_native.use_native(False)` or PAGEDKV_NATIVE_CPU=0)."""
    return x.dtype in _DTYPE_CODE and x.is_cpu and cpu_native.available()


# NOTE: a batch-1 call's kernel takes ~1 us: the checks below read each tensor attribute once,
# in one expression, and build messages only on failure.


def _fits(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """t is a cpu `dtype` tensor of `shape` with its last axis contiguous."""
    return t.dtype == dtype and t.shape == shape and t.is_cpu and t.stride(-1) == 1


def _misfit(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"{name} must be a cpu {dtype} tensor of shape {list(shape)} with its last axis contiguous, "
        f"got {t.dtype} {list(t.shape)} on {t.device} (strides {t.stride()})"
    )


def _rows_of(x: torch.Tensor, dims: int, what: str) -> tuple[int, ...]:
    """x's shape after checking it is a `dims`-axis fp32/bf16 cpu tensor, last axis contiguous."""
    shape = x.shape
    if x.dtype not in _DTYPE_CODE or len(shape) != dims or not x.is_cpu or x.stride(-1) != 1:
        raise ValueError(
            f"{what} must be a cpu fp32 or bf16 tensor with {dims} axes, the last contiguous, "
            f"got {x.dtype} {list(shape)} on {x.device} (strides {x.stride()})"
        )
    return shape


def _per_token_stride(name: str, t: torch.Tensor, dtype: torch.dtype, rows: int, dh: int) -> int:
    """Row stride of t [rows, 1, dh] or [rows, dh] (checked)."""
    if not (_fits(t, dtype, (rows, 1, dh)) or _fits(t, dtype, (rows, dh))):
        raise _misfit(name, t, dtype, (rows, 1, dh))
    return t.stride(0)


def _norm(x, residual, weight, eps, out, add: int) -> torch.Tensor:
    rows, d = _rows_of(x, 2, "x ([rows, hidden])")
    dtype = x.dtype
    if not _fits(weight, dtype, (d,)):
        raise _misfit("weight", weight, dtype, (d,))
    if add and not _fits(residual, dtype, (rows, d)):
        raise _misfit("residual", residual, dtype, (rows, d))
    if out is None:
        out = torch.empty((rows, d), dtype=dtype)
    elif not _fits(out, dtype, (rows, d)):
        raise _misfit("out", out, dtype, (rows, d))
    r = residual if add else x
    args = array.array(
        "q",
        (
            x.data_ptr(), r.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, d, x.stride(0), r.stride(0),
            out.stride(0), add, _DTYPE_CODE[dtype], torch.get_num_threads(),
        ),
    )  # fmt: skip
    (_LIBRARY.handle or _LIBRARY.require()).rms_norm_packed(args.buffer_info()[0], eps)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = x / sqrt(mean(x^2, -1) + eps) * weight (RMSNorm, Zhang & Sennrich 2019).

    Args:
        x: [rows, hidden] fp32 or bf16, last axis contiguous (rows may be strided).
        weight: [hidden], x's dtype, contiguous.
        eps: added to the mean square (rounded to fp32).
        out: [rows, hidden] x's dtype, last axis contiguous; a new tensor when None.

    Returns `out`. Statistics and scaling in fp32, one rounding to the dtype at the end.

    Raises:
        ValueError: wrong dtype, device, shape or layout (nothing written).
        RuntimeError: the native kernels are not available.
    """
    return _norm(x, None, weight, eps, out, 0)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """residual += x in place (rounded to the dtype, as torch's add), then out = rms_norm(residual)
    * weight: vLLM's `fused_add_rms_norm`, one pass instead of an add and a norm.

    Args:
        x: [rows, hidden] fp32 or bf16, last axis contiguous (the block's output).
        residual: [rows, hidden] x's dtype, last axis contiguous (the residual stream; updated).
        weight, eps, out: as in `rms_norm`.

    Returns `out`. Raises as `rms_norm`.
    """
    return _norm(x, residual, weight, eps, out, 1)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = silu(gate) * up for gate_up = [gate | up] (SwiGLU, Shazeer 2020; vLLM's `silu_and_mul`).

    Args:
        gate_up: [rows, 2 * inter] fp32 or bf16, last axis contiguous.
        out: [rows, inter] gate_up's dtype, last axis contiguous; a new tensor when None.

    Returns `out`: fp32 arithmetic (exp within 2 fp32 ulp), one rounding to the dtype.

    Raises:
        ValueError: wrong dtype, device, shape or layout, an odd last axis (nothing written).
        RuntimeError: the native kernels are not available.
    """
    rows, width = _rows_of(gate_up, 2, "gate_up ([rows, 2 * inter])")
    if width % 2:
        raise ValueError(f"gate_up's last axis must be even (gate | up), got {width}")
    inter, dtype = width // 2, gate_up.dtype
    if out is None:
        out = torch.empty((rows, inter), dtype=dtype)
    elif not _fits(out, dtype, (rows, inter)):
        raise _misfit("out", out, dtype, (rows, inter))
    args = array.array(
        "q",
        (
            gate_up.data_ptr(), out.data_ptr(), rows, inter, gate_up.stride(0), out.stride(0),
            _DTYPE_CODE[dtype], torch.get_num_threads(),
        ),
    )  # fmt: skip
    (_LIBRARY.handle or _LIBRARY.require()).silu_mul_packed(args.buffer_info()[0])
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place: x = x * cos + rotate_half(x) * sin_true (RoFormer, Su et al.
    2021, in transformers' Llama layout), with `sin` signed as `kernels.fused_ops.signed_sin`.

    Args:
        x: [rows, heads, head_dim] fp32 or bf16, head_dim even and contiguous; rows and heads
            may be strided (e.g. the query and key heads of a fused QKV projection's output).
        cos: [rows, 1, head_dim] or [rows, head_dim], x's dtype, each frequency twice, last axis
            contiguous.
        sin: like cos, first half negated.

    Returns `x`, rotated (fp32 arithmetic, one rounding per element).

    Raises:
        ValueError: wrong dtype, device, shape or layout (nothing written).
        RuntimeError: the native kernels are not available.
    """
    rows, heads, dh = _rows_of(x, 3, "x ([rows, heads, head_dim])")
    if dh % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {dh}")
    cs = _per_token_stride("cos", cos, x.dtype, rows, dh)
    ss = _per_token_stride("sin", sin, x.dtype, rows, dh)
    args = array.array(
        "q",
        (
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, dh, x.stride(0), x.stride(1), cs, ss,
            _DTYPE_CODE[x.dtype], torch.get_num_threads(),
        ),
    )  # fmt: skip
    (_LIBRARY.handle or _LIBRARY.require()).rope_packed(args.buffer_info()[0])
    return x
