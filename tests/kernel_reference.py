"""Dense, deliberately slow reference for the paged kernels, and builders of paged test cases.

The reference walks the block table one position at a time, builds each sequence's dense K/V,
repeats KV heads for GQA and takes the softmax in fp64. It shares no code with `kernels/`.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass
class PagedCase:
    """A batch laid out in a block-major pool with scattered blocks and NaN everywhere unused."""

    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int  # layer whose views are used
    query: torch.Tensor  # [total_new_tokens, num_q_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float

    @property
    def key_cache(self) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return self.pool[:, self.layer, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 1]


def make_case(
    seq_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    num_layers: int = 2,
    extra_blocks: int = 3,
) -> PagedCase:
    """Random keys/values in shuffled blocks; unused slots, blocks and table entries hold NaN
    (table entries past a sequence's last block point at an all-NaN block)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 2 * sum(blocks_per_seq) + extra_blocks
    pool = torch.full(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), math.nan, dtype=dtype
    )
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm[sum(blocks_per_seq)]  # an unused (all-NaN) block
    max_blocks = max(blocks_per_seq) + 2
    tables = torch.full((len(seq_lens), max_blocks), spare, dtype=torch.int32)
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = perm[used : used + nb]
        used += nb
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        for p in range(n):
            kv = torch.randn(num_layers, 2, num_kv_heads, head_dim, generator=gen)
            pool[ids[p // block_size], :, :, p % block_size] = kv.to(dtype)
    total_q = sum(q_lens)
    query = torch.randn(total_q, num_q_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return PagedCase(
        pool=pool,
        layer=num_layers - 1,
        query=query,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        scale=head_dim**-0.5,
    )


def gather_dense(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """[n, num_kv_heads, head_dim] fp64: positions 0..n-1 read one at a time via the table."""
    block_size = cache.shape[1]
    rows = [cache[int(table[p // block_size]), p % block_size] for p in range(n)]
    return torch.stack(rows).double()


def ref_attention(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:  # [total_q, num_q_heads, head_dim] fp64
    """Bottom-right aligned causal attention over each sequence's dense context, in fp64."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    for s in range(len(seq_lens)):
        n = int(seq_lens[s])
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if q1 == q0:
            continue
        k = gather_dense(key_cache, block_tables[s], n)  # [n, Hk, D]
        v = gather_dense(value_cache, block_tables[s], n)
        k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        nq = q1 - q0
        q = query[q0:q1].double()  # [nq, Hq, D]
        scores = torch.einsum("qhd,thd->hqt", q, k) * scale  # [Hq, nq, n]
        q_pos = torch.arange(n - nq, n)[:, None]  # [nq, 1] position of each new token
        visible = torch.arange(n)[None, :] <= q_pos  # [nq, n] causal, bottom-right aligned
        scores = scores.masked_fill(~visible, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqt,thd->qhd", probs, v)
    return out


def tolerance(dtype: torch.dtype) -> dict:
    """assert_close tolerances against the fp64 reference, per dtype."""
    return {
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.float16: dict(atol=3e-3, rtol=3e-3),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]
