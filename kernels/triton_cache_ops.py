"""Triton kernels that write the paged KV cache: slot writes and copy-on-write block copies.

Imported lazily by `kernels.cache_ops` (this module imports triton). All address arithmetic is
int64: a pool of a few GiB has element offsets past 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kernel_reshape_and_cache(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_k_tok, stride_k_head,  # key strides (head_dim stride is 1)
    stride_v_tok, stride_v_head,  # value strides (head_dim stride is 1)
    stride_kc_blk, stride_kc_off, stride_kc_head,  # key_cache strides
    stride_vc_blk, stride_vc_off, stride_vc_head,  # value_cache strides
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
):  # fmt: skip
    # One program per token: copy its [num_kv_heads, head_dim] key and value into its slot.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD).to(tl.int64)[:, None]  # [HEADS_PAD, 1]
    d = tl.arange(0, DIM_PAD)[None, :]  # [1, DIM_PAD]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
    kc = key_cache_ptr + blk * stride_kc_blk + off * stride_kc_off + h * stride_kc_head + d
    vc = value_cache_ptr + blk * stride_vc_blk + off * stride_vc_off + h * stride_vc_head + d
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64 contiguous, block * block_size + offset
) -> None:
    """Launch `kernel_reshape_and_cache`, one program per token; the arguments were checked by
    `kernels.reshape_and_cache`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1, "head_dim must be contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    kernel_reshape_and_cache[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


@triton.jit
def kernel_copy_blocks(
    pool_ptr,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], block contiguous
    block_pairs_ptr,  # [num_pairs, 2] int64 (src, dst), contiguous
    stride_pool_blk,  # elements between consecutive blocks
    BLOCK_NUMEL: tl.constexpr,  # elements in one block (all layers, K and V)
    CHUNK: tl.constexpr,  # elements copied per program
):
    # Grid: (num_pairs, cdiv(BLOCK_NUMEL, CHUNK)).
    pair = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    src = tl.load(block_pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_pairs_ptr + 2 * pair + 1).to(tl.int64)
    idx = part * CHUNK + tl.arange(0, CHUNK).to(tl.int64)  # [CHUNK]
    mask = idx < BLOCK_NUMEL
    x = tl.load(pool_ptr + src * stride_pool_blk + idx, mask=mask)
    tl.store(pool_ptr + dst * stride_pool_blk + idx, x, mask=mask)


def copy_blocks(pool: torch.Tensor, block_pairs: torch.Tensor) -> None:
    """Launch `kernel_copy_blocks` over pool [num_blocks, ...] (each block contiguous) and
    block_pairs [num_pairs, 2] int64 (src, dst); checked by `kernels.copy_blocks`."""
    num_pairs = block_pairs.shape[0]
    block_numel = pool[0].numel()
    assert pool[0].is_contiguous(), "each block must be one contiguous range"
    assert block_pairs.dtype == torch.int64 and block_pairs.is_contiguous()
    if num_pairs == 0:
        return
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (num_pairs, triton.cdiv(block_numel, chunk))
    kernel_copy_blocks[grid](
        pool, block_pairs, pool.stride(0), BLOCK_NUMEL=block_numel, CHUNK=chunk
    )
