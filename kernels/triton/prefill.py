"""Triton paged prefill attention: packed new tokens of many sequences, causal over a paged cache.

One program handles `BLOCK_Q` consecutive new tokens of one sequence for one KV head; its rows are
the `BLOCK_M = BLOCK_Q * GROUP` (token, query head) pairs that share that KV head (GQA packing,
as in vLLM's unified Triton attention). The grid is sized without a device-to-host sync: program
`i` finds its sequence by binary search over `query_start_loc[s] // BLOCK_Q + s`, an upper bound
on the query blocks before sequence `s`; programs past a sequence's last query exit at once.

New token `j` of a sequence with `n` new tokens and `seq_len` cached-plus-new tokens sits at
position `seq_len - n + j` and attends to positions `0..itself` (bottom-right aligned causal
mask): this covers plain prefill, chunked prefill, prefix-cache hits and decode tokens alike
(vLLM paper §4.1). Softmax is online, in fp32.

Imported lazily by `kernels.attention` (this module imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import tuning
from kernels.triton.paged import attend_context, attention_strides, dim_pad, fp8_scales

# Rows per program: tuning.PREFILL_BLOCK_M by dtype class (context positions per iteration, warps
# and stages are a tuning.PREFILL candidate's).


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, target, BLOCK_Q: tl.constexpr):
    # Largest s with query_start_loc[s] // BLOCK_Q + s <= target.
    lo = target * 0  # int32 tensors from the start: loop-carried values keep one type
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["LEN_BUCKET"])
def kernel_paged_prefill(
    out_ptr,  # [total_q, num_q_heads, head_dim] query dtype
    query_ptr,  # [total_q, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32, cumulative
    seq_lens_ptr,  # [num_seqs] int32, cached + new tokens
    k_scale_ptr,  # [num_kv_heads] fp32 (FP8; else any pointer, unread)
    v_scale_ptr,  # [num_kv_heads] fp32 (FP8; else any pointer, unread)
    num_seqs,
    scale,  # softmax scale (fp32)
    LEN_BUCKET,  # tuning.len_bucket(total new tokens): part of the autotune key, not read here
    stride_q_tok, stride_q_head,  # query strides
    stride_o_tok, stride_o_head,  # out strides
    stride_kc_blk, stride_kc_off, stride_kc_head, stride_vc_blk, stride_vc_off, stride_vc_head,  # cache strides
    stride_bt_seq,  # block_tables row stride
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # new tokens per program (BLOCK_M // GROUP)
    BLOCK_M: tl.constexpr,  # rows per program, power of two >= 16
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # paged.dim_pad(HEAD_DIM): power of two >= max(16, HEAD_DIM)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # context positions per iteration (a tuning.PREFILL candidate's)
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
    FP8: tl.constexpr,  # e4m3 caches with per-KV-head scales
):  # fmt: skip
    pid = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_block = pid - (q_begin // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    m = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    j = q_block * BLOCK_Q + m // GROUP  # [BLOCK_M] new-token index within the sequence
    heads = kv_head * GROUP + (m % GROUP)  # [BLOCK_M] query head
    row_mask = (m // GROUP < BLOCK_Q) & (j < q_len)
    q_pos = seq_len - q_len + j  # [BLOCK_M] position of the row's token
    tok = (q_begin + j).to(tl.int64)  # [BLOCK_M] packed query row
    d = tl.arange(0, DIM_PAD)  # [DIM_PAD]
    d_mask = d < HEAD_DIM
    q = tl.load(
        query_ptr + tok[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, DIM_PAD]
    # Context needed by this program: up to its last valid token's position.
    ctx_end = seq_len - q_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    m_i, l_i, acc = attend_context(
        q, q_pos, 0, ctx_end, scale, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
        bt_row, kv_head, d, d_mask,
        stride_kc_blk, stride_kc_off, stride_kc_head, stride_vc_blk, stride_vc_off, stride_vc_head,
        BLOCK_M, DIM_PAD, BLOCK_SIZE, TILE, IEEE, FP8,
    )  # [BLOCK_M], [BLOCK_M], [BLOCK_M, DIM_PAD]  # fmt: skip

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim], head_dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], query dtype or fp8
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], as key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, rows contiguous
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 contiguous, cumulative new tokens
    seq_lens: torch.Tensor,  # [num_seqs] int32 contiguous, cached + new tokens
    scale: float,  # softmax scale
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
) -> torch.Tensor:  # [total_q, num_q_heads, head_dim], query dtype
    """Launch `kernel_paged_prefill`; the metadata was checked by `kernels.plan_attention`, the
    tensors by `kernels.paged_attention`."""
    total_q, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert query_start_loc.is_contiguous() and query_start_loc.dtype == torch.int32
    out = torch.empty_like(query)
    strides = attention_strides(query, out, key_cache, value_cache, block_tables, seq_lens)
    k_scale, v_scale, fp8 = fp8_scales(key_cache, k_scale, v_scale, seq_lens)
    if total_q == 0 or num_seqs == 0:
        return out
    ieee = query.dtype == torch.float32
    block_m = max(tuning.PREFILL_BLOCK_M[ieee], triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (total_q // block_q + num_seqs, num_kv_heads)
    # On a GPU the fastest of tuning.PREFILL for this key; elsewhere (the interpreter) its first.
    cuda = query.is_cuda
    kernel = tuning.tuned(kernel_paged_prefill, tuning.PREFILL) if cuda else kernel_paged_prefill
    kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        k_scale, v_scale, num_seqs, scale, tuning.len_bucket(total_q), *strides,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad(head_dim),
        BLOCK_SIZE=block_size,
        IEEE=ieee,
        FP8=fp8,
        **({} if cuda else tuning.default(tuning.PREFILL)),
    )  # fmt: skip
    return out
