"""Writes into the paged KV cache: new tokens into their slots, and copy-on-write block copies.

The slot of token position p of a sequence is `block_table[p // block_size] * block_size +
p % block_size` (vLLM paper §4.1); copy-on-write pairs come from the block manager as data
(vLLM paper §4.4, "copy-on-write at the block granularity"). An fp8 (e4m3) cache stores each
new row quantized with its layer's per-KV-head scales (`kernels.fp8`, after vLLM's fp8 KV
cache); block copies move its bytes.
"""

from __future__ import annotations

import torch

from kernels import torch_impl
from kernels._common import QUERY_DTYPES, check_cache, check_int_vector, choose_backend
from kernels.cpu import native as cpu_native
from kernels.fp8 import check_kv_scales, is_fp8


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim] fp32/fp16/bf16 (cast to the cache dtype, or
            quantized for an fp8 cache); head_dim contiguous.
        value: [num_tokens, num_kv_heads, head_dim], like `key`.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim] fp32/fp16/bf16 or
            float8_e4m3fn, any strides with head_dim contiguous (e.g. `pool[:, layer, 0]` of
            the block-major pool).
        value_cache: same shape and dtype as `key_cache` (e.g. `pool[:, layer, 1]`).
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset (tokens).
            Slots must be distinct and in range. On the Triton backend a slot of -1 marks a
            padded row (a decode batch padded to its CUDA graph's size,
            `compute_service.model.decode_graphs`): its key and value are not written, as vLLM's
            cache write skips negative slots. The torch path refuses negative slots.
        k_scale, v_scale: the layer's fp8 scales, [num_kv_heads] float32 on the cache's device
            (positive, finite), required for a float8_e4m3fn cache and None for any other: the
            slots then hold `kernels.quantize_fp8(key, k_scale)` / `(value, v_scale)`, bit for
            bit on every backend (vLLM's static fp8 KV-cache quantization, saturating at ±448).
        backend: None (Triton for CUDA tensors, torch otherwise), "triton" or "torch".

    On CPU with fp32 or bf16 tensors of one dtype the write is one native call
    (`kernels.cpu.native`) when built; an fp8 write on CPU is the torch path (quantize, then
    copy the bytes).

    Raises:
        ValueError: shapes, dtypes or devices disagree; fp8 rows given as key/value; scales
            missing for an fp8 cache, given for another, or misshapen (`kernels.check_kv_scales`);
            on the torch path also a slot out of range. Nothing is written then.
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    want = (key.shape[0], num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != want or tuple(value.shape) != want:
        raise ValueError(
            f"key and value must be [num_tokens, {num_kv_heads}, {head_dim}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype not in QUERY_DTYPES or value.dtype not in QUERY_DTYPES:
        raise ValueError(
            f"key and value rows must have a dtype in {QUERY_DTYPES} (an fp8 cache quantizes them "
            f"itself), got {key.dtype} and {value.dtype}"
        )
    check_kv_scales(key_cache, k_scale, v_scale)
    check_int_vector("slot_mapping", slot_mapping, key.shape[0], (torch.int64,))
    backend = choose_backend(backend, key, value, key_cache, value_cache, slot_mapping)
    fp8 = is_fp8(key_cache)
    if backend == "torch":
        if (
            not fp8
            and slot_mapping.is_contiguous()
            and cpu_native.supports(key, key_cache, value_cache)
            and cpu_native.supports(value, key_cache, value_cache)
            and cpu_native.available()
        ):
            cpu_native.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
            return
        if slot_mapping.numel() and (
            int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= num_blocks * block_size
        ):
            raise ValueError(
                f"slot_mapping values must lie in [0, {num_blocks * block_size}) "
                f"({num_blocks} blocks x {block_size} tokens)"
            )
        torch_impl.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value head_dim axis must be contiguous for the triton backend")
    from kernels.triton import cache_ops as triton_cache_ops

    triton_cache_ops.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping.contiguous(), k_scale, v_scale
    )


def copy_blocks(
    pool: torch.Tensor,
    block_pairs: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Copy whole blocks (every layer, K and V) from src to dst, in place: copy-on-write.

    Args:
        pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], the whole
            block-major pool, any dtype (an fp8 pool is copied as bytes); the Triton backend
            needs each block contiguous (`pool[0]`).
        block_pairs: [num_pairs, 2] int64 rows (src block, dst block). A dst must not also be
            a src or repeat (the copies then run in any order).
        backend: None (Triton for CUDA tensors, torch otherwise), "triton" or "torch".

    Raises:
        ValueError: bad shapes/dtypes; a pool whose blocks are not contiguous on the triton
            backend; on the torch path also block ids out of range or a dst that repeats or is
            also a src.
    """
    if pool.dim() != 6 or pool.shape[2] != 2:
        raise ValueError(
            "pool must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(pool.shape)}"
        )
    if block_pairs.dim() != 2 or block_pairs.shape[1] != 2 or block_pairs.dtype != torch.int64:
        raise ValueError(
            "block_pairs must be [num_pairs, 2] int64 (src, dst), "
            f"got {tuple(block_pairs.shape)} {block_pairs.dtype}"
        )
    backend = choose_backend(backend, pool, block_pairs)
    if backend == "torch":
        if block_pairs.numel():
            if int(block_pairs.min()) < 0 or int(block_pairs.max()) >= pool.shape[0]:
                raise ValueError(f"block ids must lie in [0, {pool.shape[0]})")
            dst = block_pairs[:, 1]
            if dst.unique().numel() != dst.numel() or bool(
                torch.isin(dst, block_pairs[:, 0]).any()
            ):
                raise ValueError("a dst block repeats or is also a src; copies would race")
        torch_impl.copy_blocks(pool, block_pairs)
        return
    if not pool[0].is_contiguous():
        raise ValueError(
            "the triton copy_blocks needs each block to be one contiguous range "
            f"(block-major pool); got strides {pool.stride()}"
        )
    from kernels.triton import cache_ops as triton_cache_ops

    if is_fp8(pool):  # bytes: a uint8 pointer needs no fp8 support of the GPU
        pool = pool.view(torch.uint8)
    triton_cache_ops.copy_blocks(pool, block_pairs.contiguous())
