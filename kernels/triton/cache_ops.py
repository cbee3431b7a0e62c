"""Triton kernels that write the paged KV cache: slot writes and copy-on-write block copies.

Imported lazily by `kernels.cache_ops` (this module imports triton). All address arithmetic is
int64: a pool of a few GiB has element offsets past 2**31.

An fp8 (e4m3) cache is written through its uint8 view with the bits computed in the kernel
(`fp8_e4m3_bits`): integer arithmetic that reproduces torch's float -> float8_e4m3fn conversion
exactly, so that every backend stores `kernels.quantize_fp8`'s bytes (Triton's interpreter
rounds fp8 casts differently from the GPU's `cvt.rn.satfinite`; bits do not depend on either).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def fp8_e4m3_bits(y):
    """float8_e4m3fn bit patterns (int32, 0..255) of fp32 `y`, saturating: |y| > 448 (and inf)
    gives ±448 (0x7E), NaN 0x7F with y's sign bit, else round to nearest even (subnormals
    included). The same steps as torch's `fp8e4m3fn_from_fp32_value` after a clamp to ±448."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # arithmetic shift: bit 7 is y's sign
    a = bits & 0x7FFFFFFF  # |y| as bits
    # Normal e4m3 (|y| >= 2**-6): rebias the exponent (127 -> 7), round the mantissa to 3 bits,
    # ties to even; a carry into the exponent is the correct next value.
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    # Subnormal e4m3 (|y| < 2**-6, step 2**-9): adding 2**14 rounds |y| to that step (fp32 RNE)
    # and leaves the count of steps in the low mantissa bits.
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    mag = tl.where(a < (121 << 23), sub, normal)
    mag = tl.where(a > 0x43E00000, 0x7E, mag)  # beyond 448 (fp32 bits 0x43E00000): saturate
    mag = tl.where(a > 0x7F800000, 0x7F, mag)  # NaN
    return mag | sign


@triton.jit
def kernel_reshape_and_cache(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (uint8 view when FP8)
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (uint8 view when FP8)
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale_ptr,  # [num_kv_heads] fp32 (FP8; else any pointer, unread)
    v_scale_ptr,  # [num_kv_heads] fp32 (FP8; else any pointer, unread)
    stride_k_tok, stride_k_head,  # key strides (head_dim stride is 1)
    stride_v_tok, stride_v_head,  # value strides (head_dim stride is 1)
    stride_kc_blk, stride_kc_off, stride_kc_head,  # key_cache strides
    stride_vc_blk, stride_vc_off, stride_vc_head,  # value_cache strides
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    FP8: tl.constexpr,  # the caches are e4m3 bytes: store quantize_fp8(row, scale)
):  # fmt: skip
    # One program per token: copy its [num_kv_heads, head_dim] key and value into its slot.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD).to(tl.int64)[:, None]  # [HEADS_PAD, 1]
    d = tl.arange(0, DIM_PAD)[None, :]  # [1, DIM_PAD]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)  # slot -1: a padded row (CUDA graphs), not written
    k = tl.load(key_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
    kc = key_cache_ptr + blk * stride_kc_blk + off * stride_kc_off + h * stride_kc_head + d
    vc = value_cache_ptr + blk * stride_vc_blk + off * stride_vc_off + h * stride_vc_head + d
    if FP8:
        k_scale = tl.load(k_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)  # [HEADS_PAD, 1]
        v_scale = tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
        # IEEE division, as torch's `x.float() / scale` (a plain `/` may be approximate)
        k = fp8_e4m3_bits(tl.math.div_rn(k.to(tl.float32), k_scale)).to(tl.uint8)
        v = fp8_e4m3_bits(tl.math.div_rn(v.to(tl.float32), v_scale)).to(tl.uint8)
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], head_dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64 contiguous, block * block_size + offset; -1: not written
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
) -> None:
    """Launch `kernel_reshape_and_cache`, one program per token; the arguments were checked by
    `kernels.reshape_and_cache`. An fp8 cache is written through its uint8 view."""
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1, "head_dim must be contiguous"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8:
        assert k_scale is not None and v_scale is not None and k_scale.is_contiguous() and v_scale.is_contiguous()
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    else:
        k_scale = v_scale = slot_mapping  # unread
    kernel_reshape_and_cache[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        FP8=fp8,
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
