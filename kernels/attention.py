"""Paged attention: the one attention op, running the kernel its plan picked.

Causal attention of a step's packed new tokens over their sequences' paged context (vLLM paper
§4.1): new token j of a sequence with n new tokens sits at position seq_len - n + j and attends
to positions 0..seq_len - n + j of its own sequence (the bottom-right aligned causal mask of
FlashAttention-2 for seqlen_q < seqlen_k). One call serves any batch: prompt prefill, chunked
prefill, prefill after a prefix-cache hit, and decode tokens.

`kernels.plan_attention` checks the step's metadata once and picks the kernel; this op, called by
every layer, takes no metadata and dispatches (FlashInfer's `run()`):

- "triton_decode": `kernels.triton.decode` (split-KV / flash-decoding, Dao et al. 2023);
- "triton_prefill": `kernels.triton.prefill`;
- "torch": `kernels.torch_planned.planned_attention` (native CPU decode kernel for decode rows,
  padded batched SDPA for the rest), or its chunked general path when the cache has no flat row
  view or a group is too large.

Every kernel also reads fp8 (e4m3) caches with the layer's per-KV-head scales (`kernels.fp8`,
after vLLM's fp8 KV cache), dequantizing the rows it reads.
"""

from __future__ import annotations

import torch

from kernels import torch_impl, torch_planned
from kernels._common import CACHE_DTYPES, QUERY_DTYPES
from kernels.fp8 import check_kv_scales, is_fp8
from kernels.plan import AttentionPlan, triton_ready


def paged_attention(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [total_q, num_q_heads, head_dim], query dtype
    """Causal attention of the plan's packed new tokens over their paged context.

    Call after `reshape_and_cache` has written this step's keys and values. The metadata (block
    tables, query_start_loc, seq_lens) is the plan's, checked when it was built; this call only
    compares shapes and dtypes with it (no host work, no device sync, no value checks).

    Args:
        query: [total_q, num_q_heads, head_dim] fp32/fp16/bf16, sequences packed in order,
            head_dim contiguous (rows may be strided, e.g. a view of a fused QKV output).
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim] fp32/fp16/bf16 or
            float8_e4m3fn, any strides with head_dim contiguous (e.g. `pool[:, layer, 0]` of the
            block-major pool); Triton needs the query's dtype unless the cache is fp8.
        value_cache: same shape and dtype as `key_cache` (e.g. `pool[:, layer, 1]`).
        plan: `kernels.plan_attention(...)` of this step, shared by every layer.
        scale: softmax scale, usually head_dim ** -0.5.
        k_scale, v_scale: the layer's fp8 scales, [num_kv_heads] float32 on the cache's device
            (positive, finite; `kernels.fp8`), required for a float8_e4m3fn cache and None for
            any other. Keys and values are then `cache * scale` of their KV head (vLLM's fp8 KV
            cache, `--kv-cache-dtype fp8`), dequantized inside every kernel from the rows it
            reads (never a full-precision copy of the cache): e4m3 widens exactly, the scales
            multiply the scores and the output in fp32.

    Returns:
        [total_q, num_q_heads, head_dim] in the query's dtype; softmax accumulated in fp32.
        Query head h reads KV head h // (num_q_heads // num_kv_heads) (GQA).

    Raises:
        ValueError: shapes or dtypes that do not match each other or the plan (query rows vs
            the plan's tokens, cache block size vs the plan's, num_q_heads not a multiple of
            num_kv_heads, an fp8 query, query and a non-fp8 cache dtype differing on Triton),
            scales missing for an fp8 cache, given for another, or misshapen
            (`kernels.check_kv_scales`), or a Triton plan run on CPU tensors without
            `TRITON_INTERPRET=1`. The native CPU kernel raises ValueError for a block id outside
            the cache.
    """
    _check_call(query, key_cache, value_cache, plan, k_scale, v_scale)
    kernel = plan.kernel
    if kernel == "torch":
        out = torch_planned.planned_attention(query, key_cache, value_cache, plan, scale, k_scale, v_scale)
        if out is None:  # no flat row view of this cache, or a huge group: chunked path
            out = torch_impl.paged_attention(
                query, key_cache, value_cache, plan.block_tables, plan.query_start_loc,
                plan.seq_lens, scale, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        return out
    if query.dtype != key_cache.dtype and not is_fp8(key_cache):
        raise ValueError(
            f"the triton kernels need query and cache of one dtype (or an fp8 cache), got "
            f"{query.dtype} and {key_cache.dtype}"
        )
    if not query.is_cuda:
        triton_ready(query)
    if kernel == "triton_decode":
        from kernels.triton import decode as triton_decode

        return triton_decode.paged_decode_attention(
            query, key_cache, value_cache, plan.block_tables, plan.seq_lens, float(scale),
            plan.splits_for(key_cache.shape[2]), plan.max_seq_len, k_scale, v_scale, plan.split_args,
        )  # fmt: skip
    from kernels.triton import prefill as triton_prefill

    return triton_prefill.paged_prefill_attention(
        query, key_cache, value_cache, plan.block_tables, plan.query_start_loc, plan.seq_lens,
        float(scale), k_scale, v_scale,
    )  # fmt: skip


def _check_call(query, key_cache, value_cache, plan: AttentionPlan, k_scale, v_scale) -> None:
    """Raise ValueError unless the tensors fit each other and the plan (shapes, dtypes, head_dim
    contiguous) and the fp8 scales fit the cache (`paged_attention`'s checks, before any kernel)."""
    if query.dtype not in QUERY_DTYPES:
        raise ValueError(
            f"query must have a dtype in {QUERY_DTYPES}, got {query.dtype} (fp8 is a cache format: "
            "the query stays in the model's dtype)"
        )
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
        or key_cache.dtype != value_cache.dtype
        or key_cache.dtype not in CACHE_DTYPES
    ):
        raise ValueError(_mismatch(query, key_cache, value_cache, plan))
    check_kv_scales(key_cache, k_scale, v_scale)


def _mismatch(query, key_cache, value_cache, plan: AttentionPlan) -> str:
    """The message of a call whose tensors do not fit each other or the plan."""
    q, k, v = (f"{tuple(t.shape)} {t.dtype}" for t in (query, key_cache, value_cache))
    return (
        f"paged_attention: query {q}, key_cache {k}, value_cache {v} do not fit the plan "
        f"({plan.total_q} query tokens, block size {plan.block_size}); expected query "
        f"[total_q, num_q_heads, head_dim] in {QUERY_DTYPES} and caches [num_blocks, block_size, "
        f"num_kv_heads, head_dim] of one shape and dtype in {CACHE_DTYPES}, num_q_heads a "
        "multiple of num_kv_heads, head_dim contiguous"
    )
