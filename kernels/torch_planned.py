"""The planned torch attention path: the CPU production path of `kernels.paged_attention`.

The grouping and every index are built once per step by `kernels.plan.plan_attention`
(`kernels.torch_groups`); each layer gathers the groups' context rows from a flat row view of the
pool (`kernels.torch_impl.row_view`) into a reused workspace and runs one padded batched
`scaled_dot_product_attention` per group; decode rows go to the native CPU kernel when it is
built (`kernels.cpu.native`), which reads their blocks in place instead. When the cache has no
flat row view or a group would gather too much, `planned_attention` returns None and the caller
runs the general chunked path (`kernels.torch_impl.paged_attention`). fp8 (e4m3) caches are
gathered as bytes and widened, their per-KV-head scales applied to the query and the output, as
`kernels.torch_impl` describes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import native as cpu_native
from kernels.fp8 import FP8_DTYPE, WIDENED_UNIT, is_fp8, widen_to_fp16
from kernels.torch_impl import row_view

# Largest workspace (gathered keys, per buffer) of the planned path, in elements; a plan whose
# biggest group needs more runs on the chunked general path instead.
PLANNED_MAX_GATHER_ELEMS = 1 << 24


def planned_attention(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    plan,  # kernels.plan.AttentionPlan built for this batch on the torch backend
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches only
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches only
) -> torch.Tensor | None:  # [total_q, num_q_heads, head_dim], query dtype; None: not planable
    """Causal (bottom-right aligned) paged attention of a planned batch: no host work, no sync.

    The plan's decode rows (if any) go to the native CPU kernel, which reads their blocks in
    place (`kernels.cpu.native`); when these tensors do not suit it, those rows are gathered like
    the rest. Per gather group of the plan: gather its context rows (clamped to each sequence's
    length, so only written slots are read) into the plan's workspace, then one padded batched
    SDPA (in `sdpa_dtype`: bf16 for a bf16 query over bf16 or fp8 caches, else fp32) with the
    plan's visibility mask, or none for whole prompts of one length (GQA by `enable_gqa`); fp8
    rows are gathered as bytes and widened, their scales applied to the query and the output
    (module docstring). Returns None when a group is to be gathered but the cache has no flat row
    view, or the largest group would exceed `PLANNED_MAX_GATHER_ELEMS`; the caller then uses
    `kernels.torch_impl.paged_attention`.
    """
    groups, decode = plan.groups, plan.decode
    if decode is not None and not cpu_native.supports(query, key_cache, value_cache):
        groups, decode = groups + decode.gather_groups(), None
    views = _gather_views(key_cache, value_cache, groups) if groups else None
    if groups and views is None:
        return None
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if decode is not None:
        cpu_native.paged_decode(
            query, key_cache, value_cache, plan.block_tables, plan.seq_lens, decode.seq_index,
            decode.q_index, scale, out, k_scale, v_scale, memo=plan.workspace,
        )  # fmt: skip
    if groups:
        _attend_gathered(query, key_cache, groups, views, plan.workspace, scale, k_scale, v_scale, out)
    return out


def _gather_views(key_cache: torch.Tensor, value_cache: torch.Tensor, groups) -> tuple | None:
    """(key rows, value rows, rows per block, the largest group's context rows) to gather the plan's
    groups from: flat row views of the caches (`row_view`; of their bytes for fp8), or None when
    the caches have none or the largest group would exceed `PLANNED_MAX_GATHER_ELEMS`."""
    _, _, num_kv_heads, head_dim = key_cache.shape
    if is_fp8(key_cache):  # gathered as bytes, widened per group
        kv = row_view(key_cache.view(torch.uint8)), row_view(value_cache.view(torch.uint8))
    else:
        kv = row_view(key_cache), row_view(value_cache)
    if kv[0] is None or kv[1] is None or kv[0][1] != kv[1][1]:
        return None
    max_tokens = max(g.num_seqs * g.ctx_pad for g in groups)
    if max_tokens * num_kv_heads * head_dim > PLANNED_MAX_GATHER_ELEMS:
        return None
    (k_rows, per_block), (v_rows, _) = kv
    return k_rows, v_rows, per_block, max_tokens


def _attend_gathered(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]: its dtype and device
    groups,  # the plan's gather groups
    views: tuple,  # `_gather_views` of the caches
    workspace: dict,  # the plan's: gather buffers kept between layers
    scale: float,
    k_scale: torch.Tensor | None,  # [num_kv_heads] fp32: fp8 caches only
    v_scale: torch.Tensor | None,  # [num_kv_heads] fp32: fp8 caches only
    out: torch.Tensor,  # [total_q, num_q_heads, head_dim] query dtype, each group's rows written
) -> None:
    """Per gather group: its context rows gathered into the workspace, one padded batched SDPA
    (`planned_attention`)."""
    k_rows, v_rows, per_block, max_tokens = views
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    rows_dtype = k_rows.dtype
    key = (rows_dtype, num_kv_heads, head_dim)
    ws = workspace.get(key)
    if ws is None or ws[0].shape[0] < max_tokens:
        shape = (max_tokens, num_kv_heads, head_dim)
        ws = workspace[key] = tuple(torch.empty(shape, dtype=rows_dtype, device=key_cache.device) for _ in range(2))
    gqa = num_q_heads != num_kv_heads
    compute = sdpa_dtype(query.dtype, key_cache.dtype)
    fp8 = is_fp8(key_cache)
    if fp8:  # [Hq, 1] scales of the KV head each query head reads (over the widened unit)
        group = num_q_heads // num_kv_heads
        q_mul = k_scale.repeat_interleave(group)[:, None] / WIDENED_UNIT
        o_mul = v_scale.repeat_interleave(group)[:, None] / WIDENED_UNIT
    for g in groups:
        n, qp, lp = g.num_seqs, g.q_pad, g.ctx_pad
        rows = g.rows(per_block)  # [n * L]
        # k, v: [n, L, Hk, D]; q: [n, Q, Hq, D]
        k = torch.index_select(k_rows, 0, rows, out=ws[0][: n * lp]).view(n, lp, -1, head_dim)
        v = torch.index_select(v_rows, 0, rows, out=ws[1][: n * lp]).view(n, lp, -1, head_dim)
        if g.q_start is not None:  # one slice of the packed rows (a view, rows may be strided)
            q = query[g.q_start : g.q_start + n * qp].view(n, qp, num_q_heads, head_dim)
        else:
            q = query.index_select(0, g.q_rows).view(n, qp, num_q_heads, head_dim)
        if fp8:  # exact widening; k_scale on the query (fp32 product, one rounding to compute)
            k, v = widen_to_fp16(k).to(torch.float32), widen_to_fp16(v).to(torch.float32)
            q = q.to(torch.float32) * q_mul
        if k.dtype != compute:
            k, v = k.to(compute), v.to(compute)
        if q.dtype != compute:
            q = q.to(compute)
        # o: [n, Q, Hq, D]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=g.attn_mask(compute), is_causal=g.is_causal, scale=scale, enable_gqa=gqa,
        ).transpose(1, 2)  # fmt: skip
        if fp8:
            o = o.to(torch.float32) * o_mul
        if g.q_start is not None:
            out[g.q_start : g.q_start + n * qp].view(n, qp, num_q_heads, head_dim).copy_(o)
            continue
        o = o.reshape(n * qp, num_q_heads, head_dim)
        if g.out_sel is not None:
            o = o.index_select(0, g.out_sel)
        out.index_copy_(0, g.out_rows, o.to(out.dtype))


def sdpa_dtype(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype the planned path runs SDPA in: bf16 for a bf16 query over bf16 or fp8 (e4m3,
    which bf16 holds exactly) caches, else fp32.

    torch's CPU flash attention takes bf16 inputs with fp32 accumulation and softmax (AMX /
    AVX512-BF16 GEMMs); only the probabilities are rounded to bf16 before they weight the
    values (as vLLM's CPU SDPA backend runs bf16). Widening bf16 to fp32 instead costs 2-3x the
    time for an error of the same order as the output's own bf16 rounding. fp16 has no such
    fast path on the CPU: it runs in fp32.
    """
    if query_dtype == torch.bfloat16 and cache_dtype in (torch.bfloat16, FP8_DTYPE):
        return torch.bfloat16
    return torch.float32
