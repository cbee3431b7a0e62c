"""CPU projections over oneDNN's prepacked weight, read in place, on the kernel the CPU's flags choose.

`compute_service.model.linear.Linear` packs a weight once with oneDNN (`_reorder_linear_weight`)
and sends every product here instead of to oneDNN's matmul, on one of three native kernels, each
for the instruction set the CPU has (`select_kernel`, at start):

======================  ======  =====================================  ==========================
kernel                  dtype   CPU flags                              C file
======================  ======  =====================================  ==========================
``amx``                 bf16    amx_bf16, amx_tile, avx512_bf16        csrc/amx_linear.c
``avx512_bf16``         bf16    avx512_bf16, avx512f, avx512bw         csrc/avx512bf16_linear.c
``avx2``                fp32    avx2, fma                              csrc/fp32_linear.c
======================  ======  =====================================  ==========================

Each walks the packed weight in the order it lies in memory, a block of outputs at a time, with
a prefetch ahead, and multiplies it into a chunk of rows held in registers: a decode step
(memory-bound: every weight read once per step) runs faster than oneDNN's matmul on the CPUs
measured (docs/benchmarks.md), and a prefill step as fast. SwiGLU's gate/up projection can end in
silu(gate) * up inside the kernel (`silu_mul=True`), so its [M, 2I] result is never written out
and read back. No second copy of the weights: `packed_weight` finds the blocking oneDNN chose
(outputs in blocks of B, [N/B][K/2][B][2] for bf16, [N/B][K][B] for fp32) by comparing bytes, and
returns the packed tensor's address, or None (then oneDNN keeps the weight). The same library holds
a decode step's layers in one call (`csrc/decode_layers.c`, `kernels.cpu.layers`) on each kernel.

A row's result never depends on the other rows of the call (the same sums in the same order at
any M), so a sequence's projections are the same whether it runs alone or in a batch. Each kernel
sums in fp32 in order of K and rounds once (bf16: nearest even); the AMX kernel is bit-identical to
oneDNN's result up to 32 rows, the others agree with it to the dtype's rounding.

`PAGEDKV_CPU_LINEAR` ("auto", the default: from the flags) can name a kernel (refused, with the
missing flag, where the CPU lacks it) or "off" (oneDNN runs every product: the switch
benchmarks/bench_ablation.py turns off to measure what this buys).
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import threading

import torch

from kernels.cpu import native as cpu_native
from kernels.cpu import native_lib
from pagedkv.config import env

ENV_SWITCH = "PAGEDKV_CPU_LINEAR"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One projection kernel: its code in csrc/packed_linear.c, the dtype it computes, the CPU flags
    it needs and the output block widths of oneDNN's packing it reads."""

    code: int
    dtype: torch.dtype
    flags: tuple[str, ...]
    blocks: tuple[int, ...]


#: The kernels, in order of preference for their dtype.
KERNELS = {
    "amx": Kernel(0, torch.bfloat16, ("amx_bf16", "amx_tile", "avx512_bf16"), (32,)),
    "avx512_bf16": Kernel(1, torch.bfloat16, ("avx512_bf16", "avx512f", "avx512bw"), (64, 32, 16)),
    "avx2": Kernel(2, torch.float32, ("avx2", "fma"), (64, 48, 32, 16, 8)),
}

_CSRC = native_lib.CSRC
#: The library: the kernels, their entry, and a decode step's layers in one call (`kernels.cpu.layers`),
#: which calls the native CPU kernels, so built from their sources too.
_SOURCES = (*(_CSRC / f"{n}.c" for n in ("packed_linear", "amx_linear", "avx512bf16_linear", "fp32_linear",
                                           "decode_layers")), *cpu_native.SOURCES)


def select_kernel(dtype: torch.dtype, flags: frozenset[str], wanted: str = "auto") -> tuple[str | None, str | None]:
    """The kernel for `dtype` on a CPU with `flags`: (name, None), or (None, why there is none).

    `wanted` "auto" takes the first kernel of `dtype` in `KERNELS` whose flags the CPU lists; a
    kernel's name takes that one only; "off" none. A pure function of its arguments (tests pass a
    fake flag set)."""
    if wanted in ("off", "0", "false", "no"):
        return None, f"disabled by {ENV_SWITCH}={wanted}"
    names = [n for n, k in KERNELS.items() if k.dtype == dtype]
    if wanted != "auto":
        if wanted not in KERNELS:
            return None, f"{ENV_SWITCH}={wanted} names no kernel (auto, off, {', '.join(KERNELS)})"
        if wanted not in names:
            return None, f"the {wanted} kernel computes {str(KERNELS[wanted].dtype).removeprefix('torch.')}"
        names = [wanted]
    if not names:
        return None, f"no native projection kernel for {str(dtype).removeprefix('torch.')}"
    lacking = {name: [f for f in KERNELS[name].flags if f not in flags] for name in names}
    name = next((n for n in names if not lacking[n]), None)
    if name is not None:
        return name, None
    return None, "the CPU lacks " + "; ".join(f"{', '.join(m)} ({n})" for n, m in lacking.items())


#: The library (`kernels.cpu.native_lib`), built and loaded on first use.
LIBRARY = native_lib.NativeLibrary("the native projection kernels are not available", "packed_linear", _SOURCES,
                                   (*cpu_native.HEADERS, _CSRC / "team_cpu.h"), switch=ENV_SWITCH)
LIBRARY.declare("packed_linear", [ctypes.c_void_p])
LIBRARY.declare("amx_request", [])
LIBRARY.declare("decode_layers", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                  ctypes.c_float, ctypes.POINTER(ctypes.c_double)])

_chosen: dict[torch.dtype, tuple[str | None, str | None]] = {}
_lock = threading.Lock()


def _choose(dtype: torch.dtype) -> tuple[str | None, str | None]:
    flags = native_lib.cpu_flags()
    wanted = str(env(ENV_SWITCH)).strip().lower()
    name, reason = select_kernel(dtype, flags, wanted)
    if name is None:
        return None, reason
    lib = LIBRARY.load()
    if lib is None:
        return None, f"the library did not build: {LIBRARY.unavailable_reason}"
    if name == "amx" and lib.amx_request() != 0:
        denied = "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        if wanted != "auto":
            return None, denied
        name, reason = select_kernel(dtype, flags - {"amx_bf16", "amx_tile"})
        if name is None:
            return None, f"{denied}; {reason}"
    return name, None


def kernel_for(dtype: torch.dtype) -> str | None:
    """The kernel this process runs `dtype` projections on, chosen once (builds the library on the
    first call); None where there is none (`unavailable_reason` says why)."""
    chosen = _chosen.get(dtype)
    if chosen is None:
        with _lock:
            chosen = _chosen.get(dtype) or _choose(dtype)
            _chosen[dtype] = chosen
    return chosen[0]


def unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why no kernel runs `dtype` here (None when one does)."""
    kernel_for(dtype)
    return _chosen[dtype][1]


def describe(dtype: torch.dtype) -> str:
    """The projection path of `dtype` here, for logs and GetModelInfo: the kernel's name, or
    "onednn (<why>)"."""
    return kernel_for(dtype) or f"onednn ({unavailable_reason(dtype)})"


def packed_layout(weight: torch.Tensor, block: int) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's blocking of `block` outputs, flat: [N/B][K/2][B][2] for bf16,
    [N/B][K][B] for fp32 (the reference `packed_weight` compares oneDNN's bytes with). N a multiple
    of `block` (K even for bf16)."""
    n, k = weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    return weight.reshape(n // block, block, k // pair, pair).permute(0, 2, 1, 3).reshape(-1)


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A packed weight a kernel reads in place: its address, the kernel and the block width."""

    address: int
    kernel: str
    block: int


def packed_weight(weight: torch.Tensor, packed: torch.Tensor, kernel: str | None = None) -> PackedWeight | None:
    """Where a kernel can read `packed` (oneDNN's `_reorder_linear_weight(weight)`): `kernel` (default
    `kernel_for(weight.dtype)`) available, `weight` [N, K] of its dtype, and the packed bytes exactly
    `packed_layout(weight, B)` for one of the kernel's block widths B. None otherwise (oneDNN then
    runs the product).

    The caller keeps `packed` alive as long as it uses the address."""
    kernel = kernel or kernel_for(weight.dtype)
    if kernel is None or weight.dim() != 2 or not packed.is_mkldnn or weight.dtype != KERNELS[kernel].dtype:
        return None
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        return None
    try:
        address = torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):  # a torch without the op
        return None
    word = ctypes.c_int16 if weight.dtype == torch.bfloat16 else ctypes.c_int32
    as_int = torch.int16 if weight.dtype == torch.bfloat16 else torch.int32
    got = None
    for block in KERNELS[kernel].blocks:
        if n % block == 0:
            got = got if got is not None else torch.frombuffer((word * (n * k)).from_address(address), dtype=as_int)
            if torch.equal(got, packed_layout(weight.contiguous(), block).view(as_int)):
                return PackedWeight(address, kernel, block)
    return None


def linear(x: torch.Tensor, weight: PackedWeight, out_features: int, silu_mul: bool = False) -> torch.Tensor:
    """x W^T on `weight.kernel` for the packed weight W (from `packed_weight`).

    Args:
        x: [M, K] of the kernel's dtype on the CPU, M >= 1, last axis contiguous (rows may be
            strided), K the weight's in_features.
        weight: `packed_weight(W, packed)` of W [out_features, K].
        out_features: N.
        silu_mul: W's rows are [gate | up] (SwiGLU's fused projection, N = 2 I, I a multiple of
            the block width; 32 on AMX): return silu(x W_gate^T) * (x W_up^T) [M, I] instead, gate
            and up rounded to the dtype first, then exactly `kernels.fused_ops.silu_mul` of them
            (the same bits as this product followed by that op, without the [M, N] intermediate).

    Returns [M, N] (fp32 sums, one rounding), or [M, N / 2] with `silu_mul`.

    Raises:
        ValueError: x of another dtype, device, rank or layout, or no rows (nothing written).
        RuntimeError: the kernel is not available, or refused the shapes.
    """
    dtype = KERNELS[weight.kernel].dtype
    if x.dtype != dtype or x.dim() != 2 or not x.is_cpu or x.stride(1) != 1 or x.shape[0] < 1:
        raise ValueError(
            f"x must be a cpu {str(dtype).removeprefix('torch.')} [M, K] tensor with M >= 1 and K contiguous, got "
            f"{x.dtype} {list(x.shape)} on {x.device} (strides {x.stride()})"
        )
    lib = LIBRARY.handle or LIBRARY.require()
    m, k = x.shape
    n_out = out_features // 2 if silu_mul else out_features
    out = torch.empty((m, n_out), dtype=dtype)
    args = array.array("q", (x.data_ptr(), weight.address, out.data_ptr(), m, out_features, k, x.stride(0), n_out,
                             torch.get_num_threads(), int(silu_mul), weight.block, KERNELS[weight.kernel].code))
    if lib.packed_linear(args.buffer_info()[0]) != 0:
        raise RuntimeError(f"the {weight.kernel} kernel refused x {list(x.shape)} with {out_features} outputs"
                           + (f" (silu_mul needs a multiple of {2 * weight.block})" if silu_mul else ""))
    return out
