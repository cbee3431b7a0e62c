"""Helpers shared by the Triton attention kernels: K/V through a block table, online softmax, and
the host-side layout checks and strides of a launch.

fp8 (e4m3) caches (`kernels.fp8`): each tile is loaded as fp8 and widened to the query's dtype
before `tl.dot` (exact: e4m3 fits in fp16, bf16 and fp32, so tensor cores see the cache's
values unrounded); the KV head's k scale multiplies the scores (folded into the softmax scale)
and its v scale the output, in fp32: attention over `fp8 * scale`, vLLM's fp8 KV cache. Loading
float8e4nv needs a GPU of compute capability >= 8.9 (Ada, Hopper) or the interpreter.

Imported by `kernels.triton.decode` and `kernels.triton.prefill` (this module imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: tl.dot's smallest K (and M, N) for 16-bit inputs: a head_dim below it is padded up to it.
MIN_DOT = 16


def dim_pad(head_dim: int) -> int:
    """The head-dim width an attention kernel computes on: the next power of two >= ``head_dim``,
    at least :data:`MIN_DOT` (a 16-bit ``tl.dot`` with K < 16 does not compile for sm_80/sm_90);
    the padding columns are masked on load and store."""
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def attention_strides(
    query: torch.Tensor,  # [tokens, num_q_heads, head_dim]
    out: torch.Tensor,  # [tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
) -> tuple[int, ...]:
    """The strides an attention kernel takes, in its argument order: query (token, head), out
    (token, head), key_cache (block, offset, head), value_cache (block, offset, head),
    block_tables (row). Asserts the layout the kernels assume: head_dim contiguous, block-table
    rows and seq_lens contiguous, int32 metadata."""
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    return (
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
    )  # fmt: skip


def fp8_scales(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale: torch.Tensor | None,  # [num_kv_heads] fp32 (fp8 caches)
    v_scale: torch.Tensor | None,  # [num_kv_heads] fp32 (fp8 caches)
    dummy: torch.Tensor,  # any tensor on the device: the unread scale pointers of other caches
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale, v_scale, FP8) arguments of an attention launch. Asserts an fp8 cache's scales
    are [num_kv_heads] fp32 contiguous (checked by `kernels.check_kv_scales` before)."""
    if key_cache.dtype != torch.float8_e4m3fn:
        return dummy, dummy, False
    for s in (k_scale, v_scale):
        assert s is not None and s.dtype == torch.float32 and s.is_contiguous()
        assert s.shape == (key_cache.shape[2],)
    return k_scale, v_scale, True


@triton.jit
def load_block_ids(
    bt_row,  # pointer to this sequence's block-table row (int32)
    pos,  # [TILE] context positions
    end,  # one past the last context position
    BLOCK_SIZE: tl.constexpr,
):
    """The physical block of each position, int64 [TILE] (0 past ``end``): block_table[p // BLOCK_SIZE]."""
    return tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < end, other=0).to(tl.int64)


@triton.jit
def load_kv_tile(
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    blk,  # [TILE] int64 physical block of each position (load_block_ids)
    pos,  # [TILE] context positions of the tile
    p_mask,  # [TILE] which positions are inside the context
    d,  # [DIM_PAD] head-dim offsets
    d_mask,  # [DIM_PAD] which offsets are < head_dim
    kv_head,
    stride_kc_blk, stride_kc_off, stride_kc_head,
    stride_vc_blk, stride_vc_off, stride_vc_head,
    BLOCK_SIZE: tl.constexpr,
):
    """(k, v) of one tile, [TILE, DIM_PAD] each; positions outside the context read as 0.

    Slot of position p: block ``blk`` (block_table[p // BLOCK_SIZE]), offset p % BLOCK_SIZE; offsets in int64.
    """
    off = (pos % BLOCK_SIZE).to(tl.int64)  # [TILE]
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(
        key_cache_ptr + blk[:, None] * stride_kc_blk + off[:, None] * stride_kc_off
        + kv_head * stride_kc_head + d[None, :],
        mask=kv_mask, other=0.0,
    )  # [TILE, DIM_PAD]  # fmt: skip
    v = tl.load(
        value_cache_ptr + blk[:, None] * stride_vc_blk + off[:, None] * stride_vc_off
        + kv_head * stride_vc_head + d[None, :],
        mask=kv_mask, other=0.0,
    )  # [TILE, DIM_PAD]  # fmt: skip
    return k, v


@triton.jit
def attend_context(
    q,  # [ROWS, DIM_PAD] query rows that share one KV head (query dtype)
    q_pos,  # [ROWS] position of each row's token: it sees positions <= q_pos (causal)
    start,  # first context position to attend
    end,  # one past the last context position to attend
    scale,  # softmax scale (fp32)
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] each
    k_scale_ptr, v_scale_ptr,  # [num_kv_heads] fp32 each (FP8; else unread)
    bt_row,  # pointer to this sequence's block-table row (int32)
    kv_head,
    d, d_mask,  # [DIM_PAD] head-dim offsets, and which are < head_dim
    stride_kc_blk, stride_kc_off, stride_kc_head,
    stride_vc_blk, stride_vc_off, stride_vc_head,
    ROWS: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # context positions per iteration
    IEEE: tl.constexpr,  # fp32 inputs: full-precision dot instead of tf32
    FP8: tl.constexpr,  # e4m3 caches: widen tiles to q's dtype, apply the KV head's scales
):  # fmt: skip
    """Causal online softmax (flash attention, fp32, base 2) of `q` over positions [start, end).

    Returns (m, l, acc): the running max of the scaled scores in log2 units [ROWS] (-inf for a
    row that saw nothing), the sum of exp2(score - m) [ROWS] (0 likewise) and the unnormalized
    output [ROWS, DIM_PAD] fp32 (times the v scale for FP8); the row's attention output is
    acc / l.
    """
    if IEEE:
        q = q.to(tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): use exp2
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)  # scores are linear in the key
    # The block ids of each tile are loaded one iteration ahead: the K/V addresses of a tile then
    # depend on a loop-carried value, not on a load of the same iteration, so the software
    # pipeline (num_stages) can issue the next tile's K/V loads while this tile's dots run.
    blk_next = load_block_ids(bt_row, start + tl.arange(0, TILE), end, BLOCK_SIZE)  # [TILE]
    for t0 in range(start, end, TILE):
        pos = t0 + tl.arange(0, TILE)  # [TILE] context positions
        p_mask = pos < end
        blk = blk_next
        blk_next = load_block_ids(bt_row, pos + TILE, end, BLOCK_SIZE)
        k, v = load_kv_tile(
            key_cache_ptr, value_cache_ptr, blk, pos, p_mask, d, d_mask, kv_head,
            stride_kc_blk, stride_kc_off, stride_kc_head, stride_vc_blk, stride_vc_off, stride_vc_head,
            BLOCK_SIZE,
        )  # [TILE, DIM_PAD] each  # fmt: skip
        if FP8:  # exact widening of the e4m3 values
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # [ROWS, TILE]
        else:
            s = tl.dot(q, tl.trans(k))  # [ROWS, TILE]
        causal = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :]  # [ROWS, TILE]
        s = tl.where(causal, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [ROWS]; -inf for a fully masked row
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])  # [ROWS, TILE]
        alpha = tl.math.exp2(m_i - m_safe)  # [ROWS]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)  # the output is linear in the values
    return m_i, l_i, acc
