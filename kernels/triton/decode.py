"""Triton paged decode attention with an optional split-KV (flash-decoding) pass.

One program handles one (sequence, KV head, split): it loads the `G = num_q_heads //
num_kv_heads` query heads that share the KV head as one [G_PAD, D] tile (GQA packing), walks its
range of context positions `TILE` tokens at a time, finds each token's slot through the block
table (block size is independent of `TILE`, so any block size works, powers of two or not), and
keeps an online softmax in fp32 (vLLM paper §4.1; flash attention). With several splits each
program writes an unnormalized partial result and its log-sum-exp, and `kernel_reduce_splits`
merges them (flash-decoding, Dao et al. 2023).

Imported lazily by `kernels.attention` (this module imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.plan import SPLIT_KV_MAX_SPLITS as MAX_SPLITS
from kernels.plan import split_size
from kernels.triton import tuning
from kernels.triton.paged import MIN_DOT, attend_context, attention_strides, dim_pad, fp8_scales


@triton.jit(do_not_specialize=["num_splits", "LEN_BUCKET"])
def kernel_paged_decode(
    out_ptr,  # [num_seqs, num_q_heads, head_dim] (num_splits == 1) query dtype
    part_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32 (num_splits > 1)
    part_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32 (num_splits > 1)
    query_ptr,  # [num_seqs, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    k_scale_ptr,  # [num_kv_heads] fp32 (FP8; else any pointer, unread)
    v_scale_ptr,  # [num_kv_heads] fp32 (FP8; else any pointer, unread)
    split_args_ptr,  # [2] int32 (num_splits, tokens_per_split) when SPLITS_ON_DEVICE; else any pointer, unread
    scale,  # softmax scale (fp32)
    tokens_per_split,  # context positions per split (a multiple of kernels.plan.SPLIT_KV_GRANULE)
    num_splits,  # split-KV ranges per sequence (>= 1): a runtime value, so a growing context recompiles nothing
    LEN_BUCKET,  # tuning.len_bucket(tokens_per_split): part of the autotune key, not read here
    stride_q_seq, stride_q_head,  # query strides
    stride_o_seq, stride_o_head,  # out strides
    stride_kc_blk, stride_kc_off, stride_kc_head, stride_vc_blk, stride_vc_off, stride_vc_head,  # cache strides
    stride_bt_seq,  # block_tables row stride
    GROUP: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # >= max(16, GROUP), power of two (tl.dot minimum)
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # paged.dim_pad(HEAD_DIM): power of two >= max(16, HEAD_DIM)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # context positions per iteration (a tuning.DECODE candidate's)
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for kernel_reduce_splits
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
    FP8: tl.constexpr,  # e4m3 caches with per-KV-head scales
    SPLITS_ON_DEVICE: tl.constexpr,  # read num_splits and tokens_per_split from split_args_ptr (a CUDA graph)
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    if SPLITS_ON_DEVICE:  # the grid has the most splits a replay may use; a split past num_splits is empty
        num_splits = tl.load(split_args_ptr)
        tokens_per_split = tl.load(split_args_ptr + 1)
    seq_len = tl.load(seq_lens_ptr + seq)

    g = tl.arange(0, G_PAD)  # [G_PAD]
    d = tl.arange(0, DIM_PAD)  # [DIM_PAD]
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g  # [G_PAD] query head of each row
    q = tl.load(
        query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G_PAD, DIM_PAD]
    q_pos = tl.zeros([G_PAD], tl.int32) + seq_len - 1  # [G_PAD] the new token is the last position
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    bt_row = block_tables_ptr + seq * stride_bt_seq
    m_i, l_i, acc = attend_context(
        q, q_pos, start, end, scale, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
        bt_row, kv_head, d, d_mask,
        stride_kc_blk, stride_kc_off, stride_kc_head, stride_vc_blk, stride_vc_off, stride_vc_head,
        G_PAD, DIM_PAD, BLOCK_SIZE, TILE, IEEE, FP8,
    )  # [G_PAD], [G_PAD], [G_PAD, DIM_PAD]  # fmt: skip

    out_mask = g_mask[:, None] & d_mask[None, :]
    # An empty range (a split past the sequence's end, or a padded row of seq_len 0) has l = 0: its
    # output is 0 (and, split, its lse -inf: weight 0), never 0/0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if not SPLIT:
        o_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))  # log2 units
        row = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [G_PAD] int64
        used = split < num_splits  # a split of the grid past the replay's count writes nothing
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask & used)
        tl.store(part_lse_ptr + row, lse, mask=g_mask & used)


@triton.jit(do_not_specialize=["num_splits"])
def kernel_reduce_splits(
    out_ptr,  # [num_seqs, num_q_heads, head_dim] query dtype
    part_out_ptr,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32, contiguous
    part_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32 (log2 units), contiguous
    split_args_ptr,  # [2] int32 (num_splits, tokens_per_split) when SPLITS_ON_DEVICE; else any pointer, unread
    stride_o_seq, stride_o_head,  # out strides
    num_splits,  # split-KV ranges per sequence, 1..SPLITS_PAD (runtime: one compiled kernel for all)
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # kernels.plan.SPLIT_KV_MAX_SPLITS, a power of two
    SPLITS_ON_DEVICE: tl.constexpr,  # read num_splits from split_args_ptr (a CUDA graph)
):  # fmt: skip
    # Grid: (num_seqs, num_q_heads). Merge the splits' partial outputs by their log-sum-exp.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    if SPLITS_ON_DEVICE:
        num_splits = tl.load(split_args_ptr)
    sp = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    d = tl.arange(0, DIM_PAD)  # [DIM_PAD]
    row0 = (seq * NUM_Q_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + row0 + sp, mask=sp < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)  # -inf only for a padded row (seq_len 0): every weight 0, output 0
    w = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # [SPLITS_PAD]
    o = tl.load(
        part_out_ptr + (row0 + sp[:, None]) * HEAD_DIM + d[None, :],
        mask=(sp[:, None] < num_splits) & (d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [SPLITS_PAD, DIM_PAD]
    den = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den == 0.0, 1.0, den)  # [DIM_PAD]
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + d,
        res.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], head_dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], query dtype or fp8
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], as key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, rows contiguous
    seq_lens: torch.Tensor,  # [num_seqs] int32 contiguous, tokens in cache including the new one
    scale: float,  # softmax scale
    num_splits: int,  # split-KV ranges per sequence (>= 1); > 1 adds the reduce kernel
    max_seq_len: int,  # max(seq_lens): sizes the splits without a device-to-host sync
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32 contiguous: fp8 caches only
    split_args: torch.Tensor | None = None,  # [2] int32 (num_splits, tokens_per_split) on the device
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim], query dtype
    """Launch `kernel_paged_decode` (and `kernel_reduce_splits` when split); the metadata was
    checked by `kernels.plan_attention`, the tensors by `kernels.paged_attention`.

    With ``split_args`` (a CUDA graph's decode, `compute_service.model.decode_graphs`) the kernels
    read the split count and size from it at run time, so one captured launch serves every context
    length: ``num_splits`` is then the grid's count, the most ``split_args[0]`` may say; a grid of
    several splits is merged by the reduce kernel even when the step uses one (a merge of one split
    gives its values unchanged); and the launch takes the first tuning candidate (an autotuner
    cannot time inside a capture)."""
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    strides = attention_strides(query, out, key_cache, value_cache, block_tables, seq_lens)
    k_scale, v_scale, fp8 = fp8_scales(key_cache, k_scale, v_scale, seq_lens)
    if num_seqs == 0:
        return out
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    on_device = split_args is not None
    if on_device:
        assert split_args.dtype == torch.int32 and split_args.shape == (2,) and split_args.device == query.device
    tokens_per_split = split_size(max_seq_len, num_splits)  # any TILE fits: ranges need not align with tiles
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused
    # On a GPU the fastest of tuning.DECODE for this key; elsewhere (the interpreter, a capture) its first.
    tune = query.is_cuda and not on_device
    kernel = tuning.tuned(kernel_paged_decode, tuning.DECODE) if tune else kernel_paged_decode
    kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_out, part_lse, query, key_cache, value_cache, block_tables, seq_lens,
        k_scale, v_scale, split_args if on_device else seq_lens, scale, tokens_per_split, num_splits,
        tuning.len_bucket(tokens_per_split), *strides,
        GROUP=group,
        G_PAD=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad(head_dim),
        BLOCK_SIZE=block_size,
        SPLIT=split,
        IEEE=query.dtype == torch.float32,
        FP8=fp8,
        SPLITS_ON_DEVICE=on_device,
        **({} if tune else tuning.default(tuning.DECODE)),
    )  # fmt: skip
    if split:
        kernel_reduce_splits[(num_seqs, num_q_heads)](
            out, part_out, part_lse, split_args if on_device else seq_lens, out.stride(0), out.stride(1), num_splits,
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad(head_dim),
            SPLITS_PAD=MAX_SPLITS,
            SPLITS_ON_DEVICE=on_device,
        )  # fmt: skip
    return out
