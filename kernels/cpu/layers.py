"""A decode step's decoder layers in one native call (bf16 or fp32, native projections, CPU).

The per-op path (`compute_service.model.llama`) crosses from Python into a native kernel ~10 times a
layer, each call with its checks and argument packing: ~3-4 ms a step on a 2-core CPU, against a
15-35 ms decode step. `csrc/decode_layers.c` runs the same kernels in the same order on the same
buffers (so the result is bit-identical), one call for every layer: what a CUDA graph saves on a
GPU. `compute_service.model.fused_decode` decides when a step can take it.

Part of the projection library (`kernels.cpu.packed_linear`, which builds it with the kernels it
calls), on whichever projection kernel the CPU's flags chose (AMX or AVX-512 BF16 for bf16, AVX2
for fp32); used when a kernel runs the model's dtype, the native CPU kernels are not switched off,
and `PAGEDKV_FUSED_DECODE` is not "0" (the switch benchmarks/bench_ablation.py turns off to measure
what this bought).
"""

from __future__ import annotations

import array
import ctypes

from kernels.cpu import native as cpu_native
from kernels.cpu import packed_linear
from pagedkv.config import env

ENV_SWITCH = "PAGEDKV_FUSED_DECODE"

#: Return codes of decode_layers and what they mean.
_ERRORS = {
    -1: "a projection's shapes do not suit the projection kernel",
    2: "a slot or a block table entry lies outside the cache",
    3: "a seq_len needs more blocks than its block table row holds",
    4: "no native decode kernel for these dtypes",
}


def unavailable_reason(dtype) -> str | None:
    """Why the fused decode layers do not run `dtype` here, or None when they do (builds the
    projection library on the first call)."""
    if not env(ENV_SWITCH):
        return f"disabled by {ENV_SWITCH}=0"
    if packed_linear.kernel_for(dtype) is None:
        return f"no native projection kernel: {packed_linear.unavailable_reason(dtype)}"
    if not cpu_native.available():
        return f"the native CPU kernels are not available: {cpu_native.unavailable_reason}"
    return None


def available(dtype) -> bool:
    """True when the fused decode layers run `dtype` here (see `unavailable_reason`)."""
    return unavailable_reason(dtype) is None


def decode_layers(step: array.array, layers: array.array, num_layers: int, eps: float, scale: float) -> float:
    """Run `num_layers` decoder layers of a decode step (see `csrc/decode_layers.c` for the layout of
    `step` and `layers`, int64 arrays of addresses and sizes). Returns the wall seconds spent in the
    cache writes and attention.

    The caller owns every check: the arrays must describe live CPU tensors of the dtype and shapes the
    C file names (`compute_service.model.fused_decode` builds them).

    Raises:
        RuntimeError: the layers are not available here.
        ValueError: a kernel refused the step (a slot or block outside the cache, a seq_len past its
            table row); the layers before the failing one have run.
    """
    lib = packed_linear.LIBRARY.handle  # loaded by the `available()` that chose this path; not re-checked per step
    if lib is None:
        raise RuntimeError(f"the fused decode layers are not available: {packed_linear.LIBRARY.unavailable_reason}")
    seconds = ctypes.c_double(0.0)
    rc = lib.decode_layers(step.buffer_info()[0], layers.buffer_info()[0], num_layers, eps, scale,
                           ctypes.byref(seconds))
    if rc:
        raise ValueError(f"the fused decode layers refused the step: {_ERRORS.get(rc, f'code {rc}')}")
    return seconds.value
