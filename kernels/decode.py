"""Paged decode attention: one new query token per sequence over its paged KV cache.

vLLM paper §4.1 (PagedAttention: keys and values are read through the block table), with a
split-KV pass for long contexts (flash-decoding, Dao et al. 2023): the context is cut into
`num_splits` ranges handled in parallel, each giving a partial output and its log-sum-exp, and a
reduce step merges them.
"""

from __future__ import annotations

import torch

from kernels import torch_impl
from kernels._common import check_attention_args, check_host_lengths, choose_backend
from kernels.plan import AttentionPlan, plan_attention
from kernels.prefill import run_planned

# Split-KV policy (Triton): below this context length one pass per (sequence, KV head) is used.
SPLIT_KV_MIN_TOKENS = 1024
# Context positions per split when splitting.
SPLIT_KV_TOKENS_PER_SPLIT = 512
# Split only while (sequences x KV heads) leaves the GPU under-filled: aim for this many programs.
SPLIT_KV_TARGET_PROGRAMS = 1024
# Upper bound on splits.
SPLIT_KV_MAX_SPLITS = 64


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Number of split-KV ranges the Triton path uses when `num_splits` is None."""
    if max_seq_len <= SPLIT_KV_MIN_TOKENS:
        return 1
    by_length = -(-max_seq_len // SPLIT_KV_TOKENS_PER_SPLIT)
    by_occupancy = max(1, SPLIT_KV_TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    return max(1, min(by_length, by_occupancy, SPLIT_KV_MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    plan: AttentionPlan | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        query: [num_seqs, num_q_heads, head_dim] fp32/fp16/bf16, head_dim contiguous.
        key_cache: [num_blocks, block_size, num_kv_heads, head_dim], any strides with head_dim
            contiguous (e.g. `pool[:, layer, 0]`); Triton needs the query's dtype.
        value_cache: same shape and dtype as `key_cache` (e.g. `pool[:, layer, 1]`).
        block_tables: [num_seqs, max_blocks] int32 block ids; entries past a sequence's last
            block are never read.
        seq_lens: [num_seqs] int32, tokens in the cache including the current one (>= 1).
        scale: softmax scale, usually head_dim ** -0.5.
        num_splits: split-KV ranges (flash-decoding). None: Triton picks by length and
            occupancy (`default_num_splits`); the torch path chunks the context by its memory
            budget. An int forces that many ranges on both paths (tests use it at short lengths).
        max_seq_len: max(seq_lens) if the caller knows it, saving a device-to-host sync on CUDA.
        plan: a plan of this batch from `kernels.plan_attention` (with query_start_loc
            `arange(num_seqs + 1)`), shared by every layer of a step; ignored when num_splits
            is given.
        backend: None (Triton for CUDA tensors, torch otherwise), "triton" or "torch".

    Returns:
        [num_seqs, num_q_heads, head_dim] in the query's dtype; softmax accumulated in fp32.
        Query head h reads KV head h // (num_q_heads // num_kv_heads) (GQA).

    Raises:
        ValueError: bad shapes/dtypes/devices, num_q_heads not a multiple of num_kv_heads,
            num_splits < 1, a plan from other tensors; on the torch path also seq_lens < 1 or
            past the block table.
    """
    num_seqs = query.shape[0] if query.dim() == 3 else -1
    _, num_kv_heads, _, block_size, max_blocks = check_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, num_seqs
    )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    backend = choose_backend(backend, query, key_cache, value_cache, block_tables, seq_lens)
    if plan is not None and num_splits is None:
        plan.check_source(block_tables, None, seq_lens, num_seqs)
        if plan.backend != backend or plan.block_size != block_size:
            raise ValueError(
                f"the plan is for backend {plan.backend!r} and block size {plan.block_size}, "
                f"the call for {backend!r} and {block_size}"
            )
        if plan.decode_only is False:
            raise ValueError("the plan has a sequence without exactly one new token: not decode")
        if backend == "torch":
            return run_planned(query, key_cache, value_cache, plan, scale)
        max_seq_len = plan.max_seq_len
    if backend == "torch" and num_splits is None:
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
        plan = plan_attention(block_tables, query_start_loc, seq_lens, block_size, backend="torch")
        return run_planned(query, key_cache, value_cache, plan, scale)
    if backend == "torch":
        q_lens = torch.ones(num_seqs, dtype=torch.int64)
        check_host_lengths(seq_lens.to("cpu", torch.int64), q_lens, block_size, max_blocks)
        kv_chunk = None
        if num_splits is not None and num_seqs:
            longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
            kv_chunk = max(1, -(-longest // num_splits))
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int64)
        return torch_impl.paged_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            kv_chunk=kv_chunk,
        )  # fmt: skip
    if query.dtype != key_cache.dtype:
        raise ValueError(
            f"the triton backend needs query and cache of one dtype, got {query.dtype} "
            f"and {key_cache.dtype}"
        )
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len)
    from kernels import triton_decode

    return triton_decode.paged_decode_attention(
        query, key_cache, value_cache,
        block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
        float(scale), num_splits, max_seq_len,
    )  # fmt: skip
