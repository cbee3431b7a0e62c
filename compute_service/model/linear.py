"""Frozen projections for the model, over oneDNN's prepacked weights on CPU (fp32 and bf16).

A CPU-library choice kept out of the architecture (gpt-fast's model.py holds none): the model
builds every projection as `Linear(weight, packed=packed_linear_wanted(device, dtype))`.

oneDNN builds a matmul primitive for each row count it sees and keeps it: in oneDNN's primitive
cache and in ideep's LRU cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``,
1,024 entries each), about 0.6 MB per (row count, weight shape) on the CPUs measured, whatever
the row count. A step's packed token count takes any value up to the batch budget, so a worker
under load would grow by up to ~0.6 GB and keep it (docs/benchmarks.md, "Worker memory under
load"). `Linear` therefore runs oneDNN only at the row counts of `bucket_rows`: a bounded set
(56 up to 512 rows), padded with zero rows and sliced back. Rows are independent in a matmul,
so a row's result does not depend on the padding (equal bits on the CPUs measured).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused_ops
from kernels.cpu import packed_linear
from pagedkv.config import env

#: Set to "0" to run oneDNN at every row count (for the soak's comparison: benchmarks/bench_soak.py).
ROW_BUCKETS_ENV = "PAGEDKV_ROW_BUCKETS"
#: Row counts up to this run as they are (decode batches; below oneDNN's compute-bound sizes).
EXACT_ROWS = 16
#: The most rows of one oneDNN call: more rows run in slices of this many.
MAX_ROWS = 1024


def bucket_rows(rows: int) -> int:
    """The row count a oneDNN matmul of ``rows`` rows runs at: ``rows`` up to `EXACT_ROWS`, else
    rounded up to one of 8 sizes per octave (for rows in (2^k, 2^(k+1)], a multiple of 2^(k-3)),
    so at most 12.5% of a call's rows are padding and a worker builds at most 56 primitives per
    weight shape for row counts up to 512 (64 up to `MAX_ROWS`)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


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

    Where a native kernel computes the weight's dtype on this CPU (`kernels.cpu.packed_linear`:
    AMX or AVX-512 BF16 for bf16, AVX2 for fp32), it applies the packed weight instead, at any
    batch, reading the same packed bytes in place with a prefetch ahead (as fast or faster than
    oneDNN's matmul at every batch measured; a row's result independent of the batch). The
    kernels take no bias: it is added to their result (one more rounding than oneDNN's fused bias
    add in bf16).

    Memory: with `packed`, `weight` is never kept (it may be a scratch buffer the caller reuses;
    if oneDNN refuses it, a copy is kept); without, it is kept as given (no copy).

    Raises ValueError for a bias of another shape than [out_features].
    """

    def __init__(self, weight: torch.Tensor, packed: bool, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = None
        self.row_buckets = env(ROW_BUCKETS_ENV)
        if packed:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            except RuntimeError:
                self.packed = None
        if self.packed is None and packed:
            weight = weight.clone()
        self.weight = None if self.packed is not None else nn.Parameter(weight, requires_grad=False)
        #: The packed weight as `kernels.cpu.packed_linear.linear` reads it; None: oneDNN or F.linear only.
        self.native = packed_linear.packed_weight(weight, self.packed) if self.packed is not None else None
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {list(bias.shape)} for a weight of {self.out_features} output features")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """x [T, in_features] -> x W^T (+ b) [T, out_features].

        With `silu_mul`, SwiGLU's activation of the product instead, for a weight whose rows are
        [W_gate | W_up] (bias [b_gate | b_up]): silu(x W_gate^T) * (x W_up^T) [T, out_features / 2].
        On a native kernel without a bias it ends inside the kernel (the same bits as the product
        followed by `kernels.fused_ops.silu_mul`, without the [T, out_features] intermediate);
        otherwise it is exactly that product followed by that op.
        """
        if self.native is not None and x.shape[0]:
            if silu_mul and self.fuses_silu_mul():
                return packed_linear.linear(x, self.native, self.out_features, silu_mul=True)
            y = packed_linear.linear(x, self.native, self.out_features)
            y = y if self.bias is None else y.add_(self.bias)
        elif self.packed is not None:
            y = self._onednn(x)
        else:
            y = F.linear(x, self.weight, self.bias)
        return fused_ops.silu_mul(y) if silu_mul else y

    def fuses_silu_mul(self) -> bool:
        """Whether `forward(x, silu_mul=True)` ends SwiGLU inside the native kernel: one runs this
        weight, without a bias, and its gate and up halves are whole blocks of its packing."""
        return self.native is not None and self.bias is None and self.out_features % (2 * self.native.block) == 0

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's packed matmul of x [T, in_features] at `bucket_rows` row counts only."""
        rows = x.shape[0]
        if not self.row_buckets:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if rows > MAX_ROWS:
            return torch.cat([self._onednn(x[i:i + MAX_ROWS]) for i in range(0, rows, MAX_ROWS)])
        padded = bucket_rows(rows)
        if padded != rows:
            xp = x.new_empty((padded, x.shape[1]))
            xp[:rows] = x
            xp[rows:] = 0
            x = xp
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y[:rows]

    def nbytes(self) -> int:
        """Bytes this projection holds: the packed weight (or the plain one) and the bias."""
        w = self.packed if self.packed is not None else self.weight
        return w.numel() * w.element_size() + (0 if self.bias is None else self.bias.nbytes)
