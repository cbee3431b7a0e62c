"""Frozen projections for the model, with oneDNN's prepacked matmul on CPU (fp32, and bf16 on AMX).

A CPU-library choice kept out of the architecture (gpt-fast's model.py holds none): the model
builds every projection as `Linear(weight, packed=packed_linear_wanted(device, dtype))`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused_ops
from kernels.cpu import amx as cpu_amx
from pagedkv.config import env

#: Set to "0" to turn packing off (projections through `F.linear`, as transformers').
PACKED_LINEAR_ENV = "PAGEDKV_PACKED_LINEAR"


def packed_linear_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `Linear` packs its weight: CPU, oneDNN in this torch build, fp32 or (where oneDNN
    has bf16 kernels for this CPU: AVX512-BF16 or AMX) bf16, and not turned off with
    `PAGEDKV_PACKED_LINEAR=0`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not env(PACKED_LINEAR_ENV):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class Linear(nn.Module):
    """y = x W^T (+ b) for a frozen weight W [out_features, in_features] and optional bias b [out_features].

    With `packed`, W is reordered once into oneDNN's blocked layout and applied by oneDNN's matmul
    (`torch.ops.mkldnn`, the prepacked path torch.compile's CPU backend uses for frozen linear
    weights; in bf16 it runs on AMX tiles where the CPU has them, accumulating in fp32); only the
    packed copy is kept. At the few rows of a decode step this is much faster on CPU than
    `F.linear` (see docs/benchmarks.md), and the sums are ordered differently (results agree to
    the dtype's rounding). Otherwise, or if oneDNN refuses the weight, `F.linear`.

    A packed bf16 weight on an AMX CPU is applied by `kernels.cpu.amx.linear` instead, at any
    batch, which reads the same packed bytes with a prefetch ahead of its tile loads
    (bit-identical to oneDNN's result up to 32 rows, as fast or faster at every batch measured).
    That kernel takes no bias: it is added to its bf16 result (one more rounding than oneDNN's
    fused bias add).

    Memory: with `packed`, `weight` is never kept (it may be a scratch buffer the caller reuses;
    if oneDNN refuses it, a copy is kept); without, it is kept as given (no copy).

    Raises ValueError for a bias of another shape than [out_features].
    """

    def __init__(self, weight: torch.Tensor, packed: bool, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = None
        if packed:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            except RuntimeError:
                self.packed = None
        if self.packed is None and packed:
            weight = weight.clone()
        self.weight = None if self.packed is not None else nn.Parameter(weight, requires_grad=False)
        #: Address of the packed weight for `kernels.cpu.amx.linear`; None: oneDNN or F.linear only.
        self.amx_address = cpu_amx.weight_address(weight, self.packed) if self.packed is not None else None
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {list(bias.shape)} for a weight of {self.out_features} output features")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """x [T, in_features] -> x W^T (+ b) [T, out_features].

        With `silu_mul`, SwiGLU's activation of the product instead, for a weight whose rows are
        [W_gate | W_up] (bias [b_gate | b_up]): silu(x W_gate^T) * (x W_up^T) [T, out_features / 2].
        On the AMX kernel without a bias it ends inside the kernel (the same bits as the product
        followed by `kernels.fused_ops.silu_mul`, without the [T, out_features] intermediate);
        otherwise it is exactly that product followed by that op.
        """
        if self.amx_address is not None and x.shape[0]:
            if silu_mul and self.bias is None and self.out_features % 64 == 0:
                return cpu_amx.linear(x, self.amx_address, self.out_features, silu_mul=True)
            y = cpu_amx.linear(x, self.amx_address, self.out_features)
            y = y if self.bias is None else y.add_(self.bias)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return fused_ops.silu_mul(y) if silu_mul else y

    def nbytes(self) -> int:
        """Bytes this projection holds: the packed weight (or the plain one) and the bias."""
        w = self.packed if self.packed is not None else self.weight
        return w.numel() * w.element_size() + (0 if self.bias is None else self.bias.nbytes)
