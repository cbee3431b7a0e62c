"""bf16 projections on Intel AMX, reading oneDNN's prepacked weight in place.

`compute_service.model.linear.Linear` packs a bf16 weight once with oneDNN (`_reorder_linear_weight`)
and sends every product here instead of to oneDNN's matmul: the C kernel in
`csrc/amx_linear.c` streams the same packed bytes with a prefetch ahead of its tile loads, which
on a decode step (memory-bound: every weight read once per step) runs ~1.6-1.8x as fast as
oneDNN's brgemm on this project's CPU machines, and on a prefill step is as fast or faster (K of
576-1536, docs/benchmarks.md). SwiGLU's gate/up projection can end in silu(gate) * up inside the
kernel (`silu_mul=True`), so its [M, 2I] result is never written out and read back. No second
copy of the weights: `weight_address` checks that oneDNN chose the blocking the kernel reads
(AB16b32a2b) and returns the packed tensor's address, or None (then oneDNN keeps the weight).

Up to 32 rows the result is bit-identical to oneDNN's on the same packed weight (fp32 sums in
the same order, one rounding to bf16); above, the two agree to bf16 rounding. A row's result
never depends on the other rows of the call (the same sums in the same order at any M), so a
sequence's projections are the same whether it runs alone or in a batch.

Used when the CPU lists `amx_bf16`, `amx_tile` and `avx512_bf16`, Linux grants the AMX state,
the library builds, and `PAGEDKV_AMX_LINEAR` is not "0" (the switch benchmarks/bench_ablation.py
turns off to measure what this bought). The same library holds a decode step's layers in one
call (`csrc/decode_layers.c`, `kernels.cpu.layers`), built with the native kernels it calls.
"""

from __future__ import annotations

import array
import ctypes

import torch

from kernels.cpu import native as cpu_native
from kernels.cpu import native_lib

ENV_SWITCH = "PAGEDKV_AMX_LINEAR"
_SOURCE = native_lib.CSRC / "amx_linear.c"
#: The library also holds a decode step's layers in one call (`kernels.cpu.layers`), which calls
#: the native CPU kernels: built from their sources too.
_SOURCES = (_SOURCE, _SOURCE.with_name("decode_layers.c"), *cpu_native.SOURCES)
_CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


def _check_cpu() -> str | None:
    missing = [f for f in _CPU_FLAGS if f not in native_lib.cpu_flags()]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _request_amx(lib: ctypes.CDLL) -> None:
    if lib.amx_request() != 0:
        raise RuntimeError("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")


#: The library (`kernels.cpu.native_lib`), built and loaded on first use.
LIBRARY = native_lib.NativeLibrary("the AMX kernel is not available", "amx_linear", _SOURCES, cpu_native.HEADERS,
                                   switch=ENV_SWITCH, check=_check_cpu, start=_request_amx)
LIBRARY.declare("amx_linear_bf16", [ctypes.c_void_p])
LIBRARY.declare("decode_layers_bf16", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                       ctypes.c_float, ctypes.POINTER(ctypes.c_double)])


def __getattr__(name: str):
    # `unavailable_reason`: why the AMX kernel is not in use (None while it is, or before the first try).
    if name == "unavailable_reason":
        return LIBRARY.unavailable_reason
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available() -> bool:
    """True when the AMX kernel is built and usable on this CPU (builds it on the first call)."""
    return LIBRARY.available()


def packed_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's AB16b32a2b blocking, flat: [N/32][K/32][16][32][2] (the
    reference `weight_address` compares oneDNN's bytes with). N and K multiples of 32."""
    n, k = weight.shape
    return weight.reshape(n // 32, 32, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1)


def weight_address(weight: torch.Tensor, packed: torch.Tensor) -> int | None:
    """The address of `packed` (oneDNN's `_reorder_linear_weight(weight)`) when this kernel can
    read it: AMX available, `weight` a bf16 [N, K] with N and K multiples of 32, and the packed
    bytes exactly `packed_layout(weight)`. None otherwise (oneDNN then runs the product).

    The caller keeps `packed` alive as long as it uses the address."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not available():
        return None
    n, k = weight.shape
    if n % 32 or k % 32 or not packed.is_mkldnn:
        return None
    try:
        address = torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):  # a torch without the op
        return None
    got = torch.frombuffer((ctypes.c_int16 * (n * k)).from_address(address), dtype=torch.int16)
    return address if torch.equal(got, packed_layout(weight.contiguous()).view(torch.int16)) else None


def linear(x: torch.Tensor, address: int, out_features: int, silu_mul: bool = False) -> torch.Tensor:
    """x W^T on AMX for the packed weight at `address` (from `weight_address`).

    Args:
        x: [M, K] bf16 on the CPU, M >= 1, last axis contiguous (rows may be strided), K the
            weight's in_features.
        address: `weight_address(W, packed)` of W [out_features, K].
        out_features: N.
        silu_mul: W's rows are [gate | up] (SwiGLU's fused projection, N = 2 I, I a multiple of
            32): return silu(x W_gate^T) * (x W_up^T) [M, I] instead, gate and up rounded to bf16
            first, then exactly `kernels.fused_ops.silu_mul` of them (the same bits as this product
            followed by that op, without the [M, N] intermediate).

    Returns [M, N] bf16 (fp32 sums, one rounding), or [M, N / 2] with `silu_mul`.

    Raises:
        ValueError: x of another dtype, device, rank or layout, or no rows (nothing written).
        RuntimeError: the kernel is not available, or refused the shapes.
    """
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_cpu or x.stride(1) != 1 or x.shape[0] < 1:
        raise ValueError(
            f"x must be a cpu bfloat16 [M, K] tensor with M >= 1 and K contiguous, got "
            f"{x.dtype} {list(x.shape)} on {x.device} (strides {x.stride()})"
        )
    lib = LIBRARY.handle or LIBRARY.require()
    m, k = x.shape
    n_out = out_features // 2 if silu_mul else out_features
    out = torch.empty((m, n_out), dtype=torch.bfloat16)
    args = array.array("q", (x.data_ptr(), address, out.data_ptr(), m, out_features, k, x.stride(0), n_out,
                             torch.get_num_threads(), int(silu_mul)))
    if lib.amx_linear_bf16(args.buffer_info()[0]) != 0:
        raise RuntimeError(f"the AMX kernel refused x {list(x.shape)} with {out_features} outputs"
                           + (" (silu_mul needs a multiple of 64)" if silu_mul else ""))
    return out
