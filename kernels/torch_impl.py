"""Vectorized torch implementation of the paged ops: the CPU production path.

Attention over a paged KV cache (vLLM paper §4.1) without a Python loop per token or sequence:

1. Queries are cut into *tiles*: up to `Q_TILE` consecutive new tokens of one sequence (a decode
   token is a tile of one). A tile attends to positions `[0, ctx_len)` of its sequence, where
   `ctx_len` is one past its last query's position; causality inside it is a mask.
2. Tiles are sorted by (query count, ctx_len) and processed in groups, so padding stays small.
3. For a group, the context is walked in chunks of `C` positions: a (block, offset) index is built
   from the block tables, keys/values are gathered with one advanced-indexing call, and scores
   are folded into a running (max, sum, accumulator) as in flash attention / flash-decoding
   (Dao et al. 2023). Group size and `C` are chosen so every temporary stays under
   `GATHER_BUDGET_ELEMS` elements: memory is bounded whatever the batch and context.

Positions past a sequence's length are clamped to its last valid slot before gathering, so no
byte outside a sequence's context (unused slots may hold NaN) reaches an output; the clamped
duplicates are then masked out. Softmax and accumulation run in fp32.

`planned_attention` is the fast path the model uses: the grouping and every index are built once
per step by `kernels.plan.plan_attention`, and each layer gathers the groups' context rows from a
flat row view of the pool into a reused workspace and runs one padded batched
`scaled_dot_product_attention` per group; decode rows go to the native CPU kernel when it is
built (`kernels.cpu_native`), which reads their blocks in place instead. `paged_attention`
(below) is the general path, used when a caller forces context chunks or the cache layout has no
flat row view.

fp8 (e4m3) caches (`kernels.fp8`): both paths gather the fp8 bytes of the rows they read (the
same gather as for any cache, never a copy of the whole cache), widen them exactly to the
compute dtype (`fp8.widen_to_fp16`: value x 2^-8, several times faster than torch's fp8
conversion), and apply the per-KV-head scales (and 2^8) where they cost least and change
nothing: k_scale multiplies the query heads reading that KV head (scores are linear in the key),
v_scale their output (linear in the values). That is attention over `fp8 * scale`, as vLLM's fp8
KV cache reads it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.fp8 import FP8_DTYPE, WIDENED_UNIT, is_fp8, quantize_fp8, widen_to_fp16

# Query tokens of one sequence handled together (prefill).
Q_TILE = 128
# Upper bound on the elements of each temporary (gathered keys, scores) of one chunk.
GATHER_BUDGET_ELEMS = 1 << 23
# Smallest context chunk worth a gather (positions).
MIN_KV_CHUNK = 64


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches only
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches only
) -> None:
    block_size = key_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    blocks, offsets = slots // block_size, slots % block_size
    if is_fp8(key_cache):  # quantized rows, written as bytes (torch has no fp8 index_copy_)
        key, value = quantize_fp8(key, k_scale).view(torch.uint8), quantize_fp8(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    views = row_view(key_cache), row_view(value_cache)
    if views[0] is not None and views[1] is not None and views[0][1] == views[1][1]:
        # One row copy per token into the flat row views (faster than a 2-index put).
        (k_rows, per_block), (v_rows, _) = views
        rows = blocks * per_block + offsets
        k_rows.index_copy_(0, rows, key.to(key_cache.dtype))
        v_rows.index_copy_(0, rows, value.to(value_cache.dtype))
        return
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def copy_blocks(
    pool: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    block_pairs: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    if is_fp8(pool):  # bytes: torch has no fp8 index_copy_
        pool = pool.view(torch.uint8)
    pairs = block_pairs.to(torch.int64)
    # Read every source before writing any destination.
    pool.index_copy_(0, pairs[:, 1], pool.index_select(0, pairs[:, 0]))


# Largest workspace (gathered keys, per buffer) of the planned path, in elements; a plan whose
# biggest group needs more runs on the chunked general path instead.
PLANNED_MAX_GATHER_ELEMS = 1 << 24


def row_view(cache: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """One layer's cache as rows: ([rows, num_kv_heads, head_dim] view, rows per block).

    Row `block * rows_per_block + offset` is the slot (block, offset). Needs each block's
    [block_size, num_kv_heads, head_dim] contiguous (true of the block-major pool); None if not.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    s0, s1, s2, s3 = cache.stride()
    row = num_kv_heads * head_dim
    if (
        num_blocks == 0
        or s3 != 1
        or (num_kv_heads > 1 and s2 != head_dim)
        or (block_size > 1 and s1 != row)
        or s0 % row
    ):
        return None
    per_block = s0 // row
    rows = (num_blocks - 1) * per_block + block_size
    return cache.as_strided((rows, num_kv_heads, head_dim), (row, head_dim, 1)), per_block


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
    place (`kernels.cpu_native`); when these tensors do not suit it, those rows are gathered like
    the rest. Per gather group of the plan: gather its context rows (clamped to each sequence's
    length, so only written slots are read) into the plan's workspace, then one padded batched
    SDPA (in `sdpa_dtype`: bf16 for a bf16 query over bf16 or fp8 caches, else fp32) with the
    plan's visibility mask, or none for whole prompts of one length (GQA by `enable_gqa`); fp8
    rows are gathered as bytes and widened, their scales applied to the query and the output
    (module docstring). Returns None when a group is to be gathered but the cache has no flat row
    view, or the largest group would exceed `PLANNED_MAX_GATHER_ELEMS`; the caller then uses
    `paged_attention`.
    """
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    groups, decode = plan.groups, plan.decode
    if decode is not None and not cpu_native.supports(query, key_cache, value_cache):
        groups, decode = groups + decode.gather_groups(), None
    fp8 = is_fp8(key_cache)
    if groups:
        if fp8:  # gathered as bytes, widened per group
            kv = row_view(key_cache.view(torch.uint8)), row_view(value_cache.view(torch.uint8))
        else:
            kv = row_view(key_cache), row_view(value_cache)
        if kv[0] is None or kv[1] is None or kv[0][1] != kv[1][1]:
            return None
        max_tokens = max(g.num_seqs * g.ctx_pad for g in groups)
        if max_tokens * num_kv_heads * head_dim > PLANNED_MAX_GATHER_ELEMS:
            return None
        (k_rows, per_block), (v_rows, _) = kv
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if decode is not None:
        cpu_native.paged_decode(
            query, key_cache, value_cache, plan.block_tables, plan.seq_lens, decode.seq_index,
            decode.q_index, scale, out, k_scale, v_scale, memo=plan.workspace,
        )  # fmt: skip
    if not groups:
        return out
    rows_dtype = k_rows.dtype
    key = (rows_dtype, num_kv_heads, head_dim)
    ws = plan.workspace.get(key)
    if ws is None or ws[0].shape[0] < max_tokens:
        shape = (max_tokens, num_kv_heads, head_dim)
        ws = plan.workspace[key] = tuple(
            torch.empty(shape, dtype=rows_dtype, device=key_cache.device) for _ in range(2)
        )
    gqa = num_q_heads != num_kv_heads
    compute = sdpa_dtype(query.dtype, key_cache.dtype)
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
    return out


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


def paged_attention(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new tokens
    scale: float,
    kv_chunk: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches only
    v_scale: torch.Tensor | None = None,  # [num_kv_heads] fp32: fp8 caches only
) -> torch.Tensor:  # [total_q, num_q_heads, head_dim], query dtype
    """Causal (bottom-right aligned) attention of packed new tokens over a paged cache.

    `kv_chunk` forces the context chunk length (positions), to exercise the split/merge path. An
    fp8 cache's chunks are gathered as bytes and widened; k_scale scales the query, v_scale the
    result, per KV head (module docstring).
    """
    total_q, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    out = torch.zeros(total_q, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    if total_q == 0:
        return out
    # Tile metadata is small and built on the host; per-group indices move to the device.
    qsl = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    q_lens = qsl[1:] - qsl[:-1]  # [num_seqs]

    # Tiles: (seq, first query row, query count, position of first query).
    tiles_per_seq = (q_lens + Q_TILE - 1) // Q_TILE
    seq_ids = torch.repeat_interleave(torch.arange(len(q_lens)), tiles_per_seq)  # [T]
    tile_first = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq  # [num_seqs]
    local = torch.arange(len(seq_ids)) - tile_first[seq_ids]  # tile index within its seq
    t_q0 = qsl[seq_ids] + local * Q_TILE  # [T] first query row
    t_qn = torch.clamp(q_lens[seq_ids] - local * Q_TILE, max=Q_TILE)  # [T] query count
    t_pos0 = lens[seq_ids] - q_lens[seq_ids] + local * Q_TILE  # [T] position of first query
    t_ctx = t_pos0 + t_qn  # [T] context length the tile needs

    order = torch.argsort(t_qn * (int(t_ctx.max()) + 1) + t_ctx, stable=True)
    # Group tiles that share a padded query count; size groups by the memory budget.
    qn_sorted = t_qn[order].tolist()
    ctx_sorted = t_ctx[order].tolist()
    start = 0
    while start < len(order):
        qn = qn_sorted[start]
        per_tile = max(num_kv_heads * head_dim, qn * num_q_heads)
        max_tiles = max(1, GATHER_BUDGET_ELEMS // (per_tile * MIN_KV_CHUNK))
        stop = start + 1
        # A group shares its query count and at most doubles its shortest context (padding).
        ctx_cap = 2 * ctx_sorted[start] + MIN_KV_CHUNK
        while (
            stop < len(order)
            and stop - start < max_tiles
            and qn_sorted[stop] == qn
            and ctx_sorted[stop] <= ctx_cap
        ):
            stop += 1
        sel = order[start:stop]
        group_ctx = ctx_sorted[stop - 1]
        if kv_chunk is None:
            chunk = GATHER_BUDGET_ELEMS // ((stop - start) * per_tile)
            chunk = max(MIN_KV_CHUNK, min(group_ctx, chunk))
        else:
            chunk = kv_chunk
        tables = block_tables[seq_ids[sel].to(block_tables.device)]  # [T, max_blocks]
        _attend_group(
            query, key_cache, value_cache, tables, out,
            t_q0[sel], t_qn[sel], t_pos0[sel], t_ctx[sel], qn, group_ctx, chunk, scale, k_scale, v_scale,
        )  # fmt: skip
        start = stop
    return out


def _attend_group(
    query: torch.Tensor,  # [total_q, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, B, Hk, D]
    value_cache: torch.Tensor,  # [num_blocks, B, Hk, D]
    tables: torch.Tensor,  # [T, max_blocks] block table row of each tile
    out: torch.Tensor,  # [total_q, Hq, D] written in place
    q0: torch.Tensor,  # [T] first query row
    qn: torch.Tensor,  # [T] query count (<= qmax)
    pos0: torch.Tensor,  # [T] position of the first query
    ctx: torch.Tensor,  # [T] context length (one past the last query's position)
    qmax: int,
    max_ctx: int,
    chunk: int,
    scale: float,
    k_scale: torch.Tensor | None,  # [Hk] fp32: fp8 caches only
    v_scale: torch.Tensor | None,  # [Hk] fp32: fp8 caches only
) -> None:
    num_tiles = q0.shape[0]
    _, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    rows_per_tile = qmax * group  # (query, head-in-group) rows sharing one KV head

    dev = query.device
    q0, qn, pos0, ctx = (x.to(dev) for x in (q0, qn, pos0, ctx))
    qi = torch.arange(qmax, device=dev)
    q_valid = qi[None, :] < qn[:, None]  # [T, Q]
    rows = q0[:, None] + torch.where(q_valid, qi[None, :], 0)  # [T, Q] clamped to a real row
    q_pos = torch.minimum(pos0[:, None] + qi[None, :], (ctx - 1)[:, None])  # [T, Q]
    # q: [Hk, T, Q*G, D] fp32, pre-scaled: one batched matmul per KV head.
    q = query[rows].float().mul_(scale)  # [T, Q, Hq, D]
    q = q.view(num_tiles, qmax, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
    q = q.reshape(num_kv_heads, num_tiles, rows_per_tile, head_dim)
    fp8 = is_fp8(key_cache)
    if fp8:  # per-KV-head scales: k_scale on the query rows of the head; bytes gathered below
        q.mul_(k_scale.view(num_kv_heads, 1, 1, 1) / WIDENED_UNIT)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)

    last_block = ((ctx + block_size - 1) // block_size - 1)[:, None]  # [T, 1]
    chunk_blocks = max(1, chunk // block_size)
    num_blocks_needed = (max_ctx + block_size - 1) // block_size

    m = torch.full((num_kv_heads, num_tiles, rows_per_tile, 1), -math.inf, device=dev)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros(num_kv_heads, num_tiles, rows_per_tile, head_dim, device=dev)
    for b0 in range(0, num_blocks_needed, chunk_blocks):
        # [nb] table columns of this chunk
        j = torch.arange(b0, min(b0 + chunk_blocks, num_blocks_needed), device=dev)
        # Columns past a tile's last block are clamped to it (its data is masked out below), so
        # table entries beyond a sequence's context are never read.
        cols = torch.minimum(j[None, :], last_block)  # [T, nb]
        blocks = torch.gather(tables, 1, cols).long().flatten()  # [T*nb]
        span = j.numel() * block_size
        # Whole blocks at once (each is contiguous in the block-major pool): [T, L, Hk, D].
        k = key_cache.index_select(0, blocks).view(num_tiles, span, num_kv_heads, head_dim)
        v = value_cache.index_select(0, blocks).view(num_tiles, span, num_kv_heads, head_dim)
        if fp8:
            k, v = widen_to_fp16(k), widen_to_fp16(v)
        if k.dtype != torch.float32:
            k, v = k.float(), v.float()
        kpos = b0 * block_size + torch.arange(span, device=dev)  # [L] positions
        # Slots past the context may hold anything (NaN): zero those V rows (a copy, never the
        # cache) so that 0 * V stays 0; their scores are masked to -inf below.
        pad_t, pad_l = (kpos[None, :] >= ctx[:, None]).nonzero(as_tuple=True)
        if pad_t.numel():
            v[pad_t, pad_l] = 0.0
        # s: [Hk, T, Q*G, L] scores
        s = torch.empty(num_kv_heads, num_tiles, rows_per_tile, span, device=dev)
        for h in range(num_kv_heads):  # strided K rows: no transpose copy
            torch.bmm(q[h], k[:, :, h].transpose(1, 2), out=s[h])
        masked = kpos[None, None, :] > q_pos[:, :, None]  # [T, Q, L] causal, and past ctx
        s.view(num_kv_heads, num_tiles, qmax, group, span).masked_fill_(
            masked[None, :, :, None, :], -math.inf
        )
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        p = s.sub_(m_safe).exp_()  # [Hk, T, Q*G, L]
        alpha = torch.exp(m - m_safe)
        l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
        acc.mul_(alpha)
        for h in range(num_kv_heads):
            acc[h].baddbmm_(p[h], v[:, :, h])
        m = m_new
    res = acc / torch.where(l_sum == 0, 1.0, l_sum)  # [Hk, T, Q*G, D]
    if fp8:
        res.mul_(v_scale.view(num_kv_heads, 1, 1, 1) / WIDENED_UNIT)
    res = res.view(num_kv_heads, num_tiles, qmax, group, head_dim).permute(1, 2, 0, 3, 4)
    res = res.reshape(num_tiles, qmax, num_q_heads, head_dim)
    out[rows[q_valid]] = res[q_valid].to(out.dtype)
