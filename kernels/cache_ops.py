"""Writes into the paged KV cache: new tokens into their slots, and copy-on-write block copies.

The slot of token position p of a sequence is `block_table[p // block_size] * block_size +
p % block_size` (vLLM paper §4.1); copy-on-write pairs come from the block manager as data
(vLLM paper §4.4, "copy-on-write at the block granularity").
"""

from __future__ import annotations

import torch

from kernels import cpu_native, torch_impl
from kernels._common import check_cache, check_int_vector, choose_backend


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write each token's key and value into its cache slot, in place.

    Args:
        key: [num_tokens, num_kv_heads, head_dim], any float dtype (cast to the cache dtype);
            head_dim contiguous.
        value: [num_tokens, num_kv_heads, head_dim], like `key`.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim] fp32/fp16/bf16, any strides
            with head_dim contiguous (e.g. `pool[:, layer, 0]` of the block-major pool).
        value_cache: same shape and dtype as `key_cache` (e.g. `pool[:, layer, 1]`).
        slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset (tokens).
            Slots must be distinct and in range; there is no padding sentinel.
        backend: None (Triton for CUDA tensors, torch otherwise), "triton" or "torch".

    On CPU with fp32 tensors the write is one native call (`kernels.cpu_native`) when built.

    Raises:
        ValueError: shapes, dtypes or devices disagree; on the torch path also a slot out of
            range (then nothing is written).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_cache(key_cache, value_cache)
    want = (key.shape[0], num_kv_heads, head_dim)
    if key.dim() != 3 or tuple(key.shape) != want or tuple(value.shape) != want:
        raise ValueError(
            f"key and value must be [num_tokens, {num_kv_heads}, {head_dim}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_int_vector("slot_mapping", slot_mapping, key.shape[0], (torch.int64,))
    backend = choose_backend(backend, key, value, key_cache, value_cache, slot_mapping)
    if backend == "torch":
        if (
            slot_mapping.is_contiguous()
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
        torch_impl.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value head_dim axis must be contiguous for the triton backend")
    from kernels import triton_cache_ops

    triton_cache_ops.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping.contiguous()
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
            block-major pool; the Triton backend needs each block contiguous (`pool[0]`).
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
    from kernels import triton_cache_ops

    triton_cache_ops.copy_blocks(pool, block_pairs.contiguous())
