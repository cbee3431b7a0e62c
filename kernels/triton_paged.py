"""Device helpers shared by the Triton attention kernels: reading K/V through a block table.

Imported by `kernels.triton_decode` and `kernels.triton_prefill` (this module imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    bt_row,  # pointer to this sequence's block-table row (int32)
    pos,  # [TILE] context positions of the tile
    p_mask,  # [TILE] which positions are inside the context
    d,  # [DIM_PAD] head-dim offsets
    d_mask,  # [DIM_PAD] which offsets are < head_dim
    kv_head,
    stride_kc_blk, stride_kc_off, stride_kc_head,
    stride_vc_blk, stride_vc_off, stride_vc_head,
    BLOCK_SIZE: tl.constexpr,
):
    """(k, v) of one tile, [TILE, DIM_PAD] each; positions outside the context read as 0.

    Slot of position p: block_table[p // BLOCK_SIZE], offset p % BLOCK_SIZE; offsets in int64.
    """
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)  # [TILE]
    off = (pos % BLOCK_SIZE).to(tl.int64)  # [TILE]
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(
        key_cache_ptr + blk[:, None] * stride_kc_blk + off[:, None] * stride_kc_off
        + kv_head * stride_kc_head + d[None, :],
        mask=kv_mask, other=0.0,
    )  # [TILE, DIM_PAD]  # fmt: skip
    v = tl.load(
        value_cache_ptr + blk[:, None] * stride_vc_blk + off[:, None] * stride_vc_off
        + kv_head * stride_vc_head + d[None, :],
        mask=kv_mask, other=0.0,
    )  # [TILE, DIM_PAD]  # fmt: skip
    return k, v
