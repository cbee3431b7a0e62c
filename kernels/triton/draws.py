"""Triton kernel of kernels.draws: one Philox uniform per sampled row, on the GPU.

Imported lazily by `kernels.draws.uniforms` (this module imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows per program.
BLOCK = 128


@triton.jit
def kernel_uniforms(
    keys_ptr,  # [S] int64: each row's 64-bit key (its bits)
    out_ptr,  # [S] float32
    num_rows,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_rows
    keys = tl.load(keys_ptr + rows, mask=mask, other=0)
    r = tl.randint(keys, tl.zeros_like(rows))  # Philox4x32-10, counter 0: kernels.draws.random_uint32
    bits = r.to(tl.uint32, bitcast=True)
    u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: kernels.draws.to_uniform
    tl.store(out_ptr + rows, u, mask=mask)


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """keys: [S] int64 on the GPU (the 64-bit keys' bits); returns [S] float32 uniforms there."""
    assert keys.dtype == torch.int64 and keys.is_contiguous()
    out = torch.empty(keys.shape[0], dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        kernel_uniforms[(triton.cdiv(keys.shape[0], BLOCK),)](keys, out, keys.shape[0], BLOCK=BLOCK)
    return out
