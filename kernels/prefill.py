"""Paged prefill attention: packed new tokens of a batch, causal over each sequence's paged cache.

One call serves a whole mixed batch: prompt prefill, chunked prefill, prefill after a
prefix-cache hit, and decode tokens (a sequence with one new token). vLLM paper §4.1; the
bottom-right aligned causal mask follows FlashAttention-2's convention for seqlen_q < seqlen_k.
"""

from __future__ import annotations

import torch

from kernels import torch_impl
from kernels._common import check_attention_args, check_int_vector, choose_backend
from kernels.plan import AttentionPlan, plan_attention


def paged_prefill_attention(
    query: torch.Tensor,  # [total_new_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    plan: AttentionPlan | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged context.

    Call after `reshape_and_cache` has written this step's keys and values. New token j of a
    sequence with n new tokens sits at position seq_len - n + j and attends to positions
    0..seq_len - n + j of its own sequence.

    Args:
        query: [total_new_tokens, num_q_heads, head_dim] fp32/fp16/bf16, sequences packed in
            order, head_dim contiguous.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides with head_dim
            contiguous (e.g. `pool[:, layer, 0]`); Triton needs the query's dtype.
        value_cache: same shape and dtype as `key_cache` (e.g. `pool[:, layer, 1]`).
        block_tables: [num_seqs, max_blocks] int32 block ids; entries past a sequence's last
            block are never read.
        query_start_loc: [num_seqs + 1] int32, cumulative new-token counts (starts at 0, ends
            at total_new_tokens).
        seq_lens: [num_seqs] int32, tokens in the cache after this step (cached + new).
        scale: softmax scale, usually head_dim ** -0.5.
        plan: `kernels.plan_attention(block_tables, query_start_loc, seq_lens, block_size)`,
            built once per step and shared by every layer: the call then does no host work, no
            sync and no value validation (the plan did it). None: planned inside the call.
        backend: None (Triton for CUDA tensors, torch otherwise), "triton" or "torch".

    Returns:
        [total_new_tokens, num_q_heads, head_dim] in the query's dtype; softmax in fp32.

    Raises:
        ValueError: bad shapes/dtypes/devices, num_q_heads not a multiple of num_kv_heads, a
            plan built from other tensors or for another backend; on the torch path also
            query_start_loc not matching the query, new tokens > seq_len, or seq_len past the
            block table.
    """
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _, _, _, block_size, _ = check_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, num_seqs
    )
    check_int_vector("query_start_loc", query_start_loc, num_seqs + 1, (torch.int32, torch.int64))
    backend = choose_backend(
        backend, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens
    )
    if plan is not None:
        plan.check_source(block_tables, query_start_loc, seq_lens, query.shape[0])
        if plan.backend != backend or plan.block_size != block_size:
            raise ValueError(
                f"the plan is for backend {plan.backend!r} and block size {plan.block_size}, "
                f"the call for {backend!r} and {block_size}"
            )
        return run_planned(query, key_cache, value_cache, plan, scale)
    if backend == "torch":
        qsl = query_start_loc.to("cpu", torch.int64)
        if int(qsl[0]) != 0 or int(qsl[-1]) != query.shape[0]:
            raise ValueError(
                f"query_start_loc must run from 0 to total_new_tokens={query.shape[0]}, "
                f"got {int(qsl[0])}..{int(qsl[-1])}"
            )
        plan = plan_attention(block_tables, query_start_loc, seq_lens, block_size, backend="torch")
        return run_planned(query, key_cache, value_cache, plan, scale)
    if query.dtype != key_cache.dtype:
        raise ValueError(
            f"the triton backend needs query and cache of one dtype, got {query.dtype} "
            f"and {key_cache.dtype}"
        )
    from kernels import triton_prefill

    return triton_prefill.paged_prefill_attention(
        query, key_cache, value_cache,
        block_tables.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        float(scale),
    )  # fmt: skip


def run_planned(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Attention of a planned batch on the plan's backend (arguments already checked)."""
    if plan.backend == "torch":
        out = torch_impl.planned_attention(query, key_cache, value_cache, plan, scale)
        if out is None:  # no flat row view of this cache, or a huge group: chunked path
            out = torch_impl.paged_attention(
                query, key_cache, value_cache, plan.block_tables, plan.query_start_loc,
                plan.seq_lens, scale,
            )  # fmt: skip
        return out
    if query.dtype != key_cache.dtype:
        raise ValueError(
            f"the triton backend needs query and cache of one dtype, got {query.dtype} "
            f"and {key_cache.dtype}"
        )
    from kernels import triton_prefill

    return triton_prefill.paged_prefill_attention(
        query, key_cache, value_cache, plan.block_tables, plan.query_start_loc, plan.seq_lens,
        float(scale),
    )  # fmt: skip
