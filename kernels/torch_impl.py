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

`kernels.torch_planned.planned_attention` is the fast path the model uses (its grouping and
indices built once per step by `kernels.plan.plan_attention`); `paged_attention` (below) is the
general path, used when a caller forces context chunks or the cache layout has no flat row view.
The cache write and block copies of the torch path are here too.

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

from kernels.fp8 import WIDENED_UNIT, is_fp8, quantize_fp8, widen_to_fp16

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


def _chunk_kv(
    key_cache: torch.Tensor,  # [num_blocks, B, Hk, D] (uint8 bytes for fp8)
    value_cache: torch.Tensor,  # [num_blocks, B, Hk, D] likewise
    tables: torch.Tensor,  # [T, max_blocks] block table row of each tile
    last_block: torch.Tensor,  # [T, 1] table column of each tile's last block
    ctx: torch.Tensor,  # [T] context length of each tile
    b0: int,
    b1: int,
    fp8: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V of table columns [b0, b1) of every tile, fp32 [T, L, Hk, D] (L = (b1 - b0) * B,
    fp8 widened to `WIDENED_UNIT` units), and their positions [L] int64; V rows past a tile's
    context are zero (the caller masks their scores)."""
    dev, block_size = ctx.device, key_cache.shape[1]
    num_tiles, (_, _, num_kv_heads, head_dim) = tables.shape[0], key_cache.shape
    j = torch.arange(b0, b1, device=dev)  # [nb] table columns of this chunk
    # Columns past a tile's last block are clamped to it (its data is masked out by the caller), so
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
    # cache) so that 0 * V stays 0; their scores are masked to -inf by the caller.
    pad_t, pad_l = (kpos[None, :] >= ctx[:, None]).nonzero(as_tuple=True)
    if pad_t.numel():
        v[pad_t, pad_l] = 0.0
    return k, v, kpos


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
        b1 = min(b0 + chunk_blocks, num_blocks_needed)
        k, v, kpos = _chunk_kv(key_cache, value_cache, tables, last_block, ctx, b0, b1, fp8)
        span = kpos.numel()
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
