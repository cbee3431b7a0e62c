"""Paged attention: the one attention op, running the kernel its plan picked.

Causal attention of a step's packed new tokens over their sequences' paged context (vLLM paper
§4.1): new token j of a sequence with n new tokens sits at position seq_len - n + j and attends
to positions 0..seq_len - n + j of its own sequence (the bottom-right aligned causal mask of
FlashAttention-2 for seqlen_q < seqlen_k). One call serves any batch: prompt prefill, chunked
prefill, prefill after a prefix-cache hit, and decode tokens.

`kernels.plan_attention` checks the step's metadata once and picks the kernel; this op, called by
every layer, takes no metadata and dispatches (FlashInfer's `run()`):

- "triton_decode": `kernels.triton_decode` (split-KV / flash-decoding, Dao et al. 2023);
- "triton_prefill": `kernels.triton_prefill`;
- "torch": `kernels.torch_impl.planned_attention` (native CPU decode kernel for decode rows,
  padded batched SDPA for the rest), or its chunked general path when the cache has no flat row
  view or a group is too large.
"""

from __future__ import annotations

import torch

from kernels import torch_impl
from kernels._common import CACHE_DTYPES
from kernels.plan import AttentionPlan, triton_ready


def paged_attention(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:  # [total_q, num_q_heads, head_dim], query dtype
    """Causal attention of the plan's packed new tokens over their paged context.

    Call after `reshape_and_cache` has written this step's keys and values. The metadata (block
    tables, query_start_loc, seq_lens) is the plan's, checked when it was built; this call only
    compares shapes and dtypes with it (no host work, no device sync, no value checks).

    Args:
        query: [total_q, num_q_heads, head_dim] fp32/fp16/bf16, sequences packed in order,
            head_dim contiguous (rows may be strided, e.g. a view of a fused QKV output).
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides with head_dim
            contiguous (e.g. `pool[:, layer, 0]` of the block-major pool); Triton needs the
            query's dtype.
        value_cache: same shape and dtype as `key_cache` (e.g. `pool[:, layer, 1]`).
        plan: `kernels.plan_attention(...)` of this step, shared by every layer.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [total_q, num_q_heads, head_dim] in the query's dtype; softmax accumulated in fp32.
        Query head h reads KV head h // (num_q_heads // num_kv_heads) (GQA).

    Raises:
        ValueError: shapes or dtypes that do not match each other or the plan (query rows vs
            the plan's tokens, cache block size vs the plan's, num_q_heads not a multiple of
            num_kv_heads, query and cache dtypes differing on Triton), or a Triton plan run on
            CPU tensors without `TRITON_INTERPRET=1`. The native CPU kernel raises ValueError
            for a block id outside the cache.
    """
    if (
        query.dim() != 3
        or key_cache.dim() != 4
        or query.shape[0] != plan.total_q
        or key_cache.shape != value_cache.shape
        or key_cache.shape[1] != plan.block_size
        or query.shape[2] != key_cache.shape[3]
        or key_cache.shape[2] == 0
        or query.shape[1] % key_cache.shape[2]
        or query.stride(2) != 1
        or key_cache.stride(3) != 1
        or value_cache.stride(3) != 1
        or query.dtype not in CACHE_DTYPES
        or key_cache.dtype != value_cache.dtype
        or key_cache.dtype not in CACHE_DTYPES
    ):
        raise ValueError(_mismatch(query, key_cache, value_cache, plan))
    kernel = plan.kernel
    if kernel == "torch":
        out = torch_impl.planned_attention(query, key_cache, value_cache, plan, scale)
        if out is None:  # no flat row view of this cache, or a huge group: chunked path
            out = torch_impl.paged_attention(
                query, key_cache, value_cache, plan.block_tables, plan.query_start_loc,
                plan.seq_lens, scale,
            )  # fmt: skip
        return out
    if query.dtype != key_cache.dtype:
        raise ValueError(
            f"the triton kernels need query and cache of one dtype, got {query.dtype} "
            f"and {key_cache.dtype}"
        )
    if not query.is_cuda:
        triton_ready(query)
    if kernel == "triton_decode":
        from kernels import triton_decode

        return triton_decode.paged_decode_attention(
            query, key_cache, value_cache, plan.block_tables, plan.seq_lens, float(scale),
            plan.splits_for(key_cache.shape[2]), plan.max_seq_len,
        )  # fmt: skip
    from kernels import triton_prefill

    return triton_prefill.paged_prefill_attention(
        query, key_cache, value_cache, plan.block_tables, plan.query_start_loc, plan.seq_lens,
        float(scale),
    )  # fmt: skip


def _mismatch(query, key_cache, value_cache, plan: AttentionPlan) -> str:
    """The message of a call whose tensors do not fit each other or the plan."""
    q, k, v = (f"{tuple(t.shape)} {t.dtype}" for t in (query, key_cache, value_cache))
    return (
        f"paged_attention: query {q}, key_cache {k}, value_cache {v} do not fit the plan "
        f"({plan.total_q} query tokens, block size {plan.block_size}); expected query "
        "[total_q, num_q_heads, head_dim] and caches [num_blocks, block_size, num_kv_heads, "
        f"head_dim] of one shape and dtype in {CACHE_DTYPES}, num_q_heads a multiple of "
        "num_kv_heads, head_dim contiguous"
    )
