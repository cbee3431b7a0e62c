"""Attention plan: the per-step host work of paged attention, done once and reused by every layer.

After FlashInfer's `plan()` / `run()` split: a model step calls `plan_attention` once with the
step's block tables, query_start_loc and seq_lens, then passes the plan to the attention op of
each layer, which then does no host-side work, no device-to-host sync and no value validation.

Torch path (CPU): sequences are sorted by (new tokens, context length) and packed into *groups*
of similar shape. For each group the plan holds the padded query rows, the pool row of every
context position (positions past a sequence's length are clamped to its last valid position, so
no byte outside a sequence's context is ever gathered), and, when lengths differ inside the
group, the causal bottom-right aligned visibility mask. A layer then runs, per group, two
`index_select`s (keys, values) into a reused workspace and one batched
`scaled_dot_product_attention` (padded batched SDPA, GQA). When the native CPU decode kernel is
available (`kernels.cpu_native`), sequences with one new token are not grouped: the plan lists
them (`decode`) and the kernel reads their blocks in place; their gather groups are built only
if a call cannot use the kernel (a non-fp32 cache).

Triton path (CUDA): the plan holds int32 contiguous copies of the metadata and max(seq_lens),
so the per-layer launch needs no conversion and no sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import cpu_native
from kernels._common import check_host_lengths, check_int_vector, choose_backend

# Gathered context positions per group (keys of all its sequences, padded): 4096 positions of
# SmolLM2's 3 KV heads x 64 is 3 MiB of keys and values, which stays in the last-level cache
# between the gather and the attention that reads it.
GROUP_TOKENS = 4096
# A sequence joins a group only if padding it to the group's largest shape costs at most this
# factor over the group's smallest member (plus `GROUP_SLACK_TOKENS` positions).
GROUP_PAD_FACTOR = 1.25
GROUP_SLACK_TOKENS = 64


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together as one padded batch [n, heads, q_pad, ctx_pad]."""

    num_seqs: int  # n, sequences in the group
    q_pad: int  # padded new tokens per sequence (1 for decode)
    ctx_pad: int  # padded context positions per sequence
    q_rows: torch.Tensor  # [n * q_pad] int64 packed query rows; padding repeats a real row
    out_rows: torch.Tensor  # [m] int64 packed rows this group writes (its real queries)
    out_sel: torch.Tensor | None  # [m] int64 rows of the padded result to keep; None: all
    blocks: torch.Tensor  # [n * ctx_pad] int64 block id of each gathered position (clamped)
    offsets: torch.Tensor  # [n * ctx_pad] int64 offset inside the block of each position
    mask: torch.Tensor | None  # [n, 1, q_pad, ctx_pad] bool visibility; None: see is_causal
    is_causal: bool  # no mask and top-left causal (a whole prompt: q_pad == ctx_pad)
    # NOTE: rows of the per-layer flat cache view depend only on the pool's block stride,
    # which is the same for every layer: computed by the first layer, reused by the others.
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def rows(self, rows_per_block: int) -> torch.Tensor:
        """[n * ctx_pad] int64 row of each position in a cache view flattened to rows."""
        r = self._rows.get(rows_per_block)
        if r is None:
            r = self._rows[rows_per_block] = self.blocks * rows_per_block + self.offsets
        return r


@dataclass(slots=True)
class DecodeRows:
    """Sequences with one new token each, attended in place by the native CPU decode kernel."""

    seq_index: torch.Tensor  # [n] int64 sequence (row of block_tables / seq_lens)
    q_index: torch.Tensor  # [n] int64 packed query row of each
    _build_groups: Callable[[], list[AttentionGroup]]  # their gather groups (torch path)
    _groups: list[AttentionGroup] | None = None

    def gather_groups(self) -> list[AttentionGroup]:
        """The same rows as gather groups, for a call the native kernel cannot serve (built once)."""
        if self._groups is None:
            self._groups = self._build_groups()
        return self._groups


@dataclass(slots=True)
class AttentionPlan:
    """Metadata of one step's batch, shared by every layer's attention call.

    Build with `plan_attention`; pass as `plan=` to `paged_prefill_attention` (or
    `paged_decode_attention` for a batch of one new token per sequence).
    """

    backend: str  # "torch" or "triton"
    num_seqs: int  # S
    total_q: int  # packed new tokens of the batch
    block_size: int  # tokens per block
    max_seq_len: int | None  # max(seq_lens) (triton decode); None if not computed
    decode_only: bool | None  # every sequence has exactly one new token; None: not computed
    source_ptrs: tuple[int, int, int]  # data_ptr of block_tables, query_start_loc, seq_lens
    groups: list[AttentionGroup]  # torch path: padded batches covering every query row not in decode
    max_group_tokens: int  # torch path: largest n * ctx_pad of `groups` (workspace rows)
    block_tables: torch.Tensor  # [S, max_blocks] int32 contiguous
    query_start_loc: torch.Tensor  # [S + 1] int32 contiguous
    seq_lens: torch.Tensor  # [S] int32 contiguous
    # Torch path with the native CPU decode kernel: the one-new-token sequences; else None.
    decode: DecodeRows | None = None
    # Gather buffers reused by every layer, keyed by (dtype, num_kv_heads, head_dim).
    workspace: dict = field(default_factory=dict)

    def check_source(self, block_tables, query_start_loc, seq_lens, total_q: int) -> None:
        """Raise ValueError unless the plan was built from these tensors for this query.

        `query_start_loc` None (decode) skips that tensor's check.
        """
        qsl_ptr = self.source_ptrs[1] if query_start_loc is None else query_start_loc.data_ptr()
        ptrs = (block_tables.data_ptr(), qsl_ptr, seq_lens.data_ptr())
        if ptrs != self.source_ptrs or total_q != self.total_q:
            raise ValueError(
                "the attention plan was built for other block_tables/query_start_loc/seq_lens "
                "or another number of query tokens; call plan_attention once per step with the "
                "tensors passed to the attention op"
            )


def plan_attention(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    backend: str | None = None,
) -> AttentionPlan:
    """Plan one step's paged attention (host work, once per step; FlashInfer's `plan()`).

    Args:
        block_tables: [num_seqs, max_blocks] int32 block ids; entries past a sequence's last
            block are never read.
        query_start_loc: [num_seqs + 1] int32, cumulative new-token counts.
        seq_lens: [num_seqs] int32, tokens in the cache after this step (cached + new).
        block_size: tokens per cache block.
        backend: None (Triton for CUDA tensors, torch otherwise), "triton" or "torch"; must be
            the backend of the attention calls that use the plan.

    Returns:
        An `AttentionPlan`; reuse it for every layer of the step with the same tensors.

    Raises:
        ValueError: bad shapes/dtypes/devices; on the torch path also new tokens > seq_len,
            query_start_loc not starting at 0, a seq_len past the block table, or an int64
            block id to be read that does not fit in int32.
    """
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "block_tables must be [num_seqs, max_blocks] int32, got "
            f"{tuple(block_tables.shape)} {block_tables.dtype}"
        )
    num_seqs = block_tables.shape[0]
    ints = (torch.int32, torch.int64)
    check_int_vector("seq_lens", seq_lens, num_seqs, ints)
    check_int_vector("query_start_loc", query_start_loc, num_seqs + 1, ints)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    backend = choose_backend(backend, block_tables, query_start_loc, seq_lens)
    ptrs = (block_tables.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr())
    bt32 = block_tables.to(torch.int32).contiguous()
    qsl32 = query_start_loc.to(torch.int32).contiguous()
    sl32 = seq_lens.to(torch.int32).contiguous()
    if backend == "triton":
        # One sync per step (not per layer) for the decode kernel's grid.
        max_len = int(seq_lens.max()) if num_seqs else 0
        total_q = int(query_start_loc[-1])
        return AttentionPlan(
            "triton", num_seqs, total_q, block_size, max_len, None, ptrs, [], 0,
            bt32, qsl32, sl32,
        )  # fmt: skip
    qsl = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(qsl[0])}")
    q_lens = qsl[1:] - qsl[:-1]
    check_host_lengths(lens, q_lens, block_size, block_tables.shape[1])
    if block_tables.dtype == torch.int64 and block_tables.numel():
        # The int32 copy must not wrap an id that will be read into another, valid one.
        read = torch.arange(block_tables.shape[1])[None, :] < ((lens + block_size - 1) // block_size)[:, None]
        ids = block_tables.to("cpu")[read]
        if ids.numel() and (int(ids.min()) < -(2**31) or int(ids.max()) >= 2**31):
            raise ValueError("block ids must fit in int32")
    # The plan keeps its own copies: a caller changing its tensors in place cannot desync it.
    bt32, qsl32, sl32 = (
        t.clone() if t.data_ptr() == src.data_ptr() else t
        for t, src in ((bt32, block_tables), (qsl32, query_start_loc), (sl32, seq_lens))
    )
    native = block_tables.device.type == "cpu" and cpu_native.available()
    groups, decode = _make_groups(block_tables, qsl, q_lens, lens, block_size, native)
    max_tokens = max((g.num_seqs * g.ctx_pad for g in groups), default=0)
    max_len = int(lens.max()) if num_seqs else 0
    decode_only = bool((q_lens == 1).all())
    return AttentionPlan(
        "torch", num_seqs, int(qsl[-1]), block_size, max_len, decode_only, ptrs, groups,
        max_tokens, bt32, qsl32, sl32, decode,
    )  # fmt: skip


def _make_groups(
    block_tables: torch.Tensor,  # [S, max_blocks]
    qsl: torch.Tensor,  # [S + 1] int64
    q_lens: torch.Tensor,  # [S] int64
    lens: torch.Tensor,  # [S] int64
    block_size: int,
    native_decode: bool,
) -> tuple[list[AttentionGroup], DecodeRows | None]:
    """Gather groups of the sequences with new tokens; with `native_decode`, the one-token ones
    are left out of them and returned as DecodeRows instead."""
    q_list, len_list = q_lens.tolist(), lens.tolist()
    active = [s for s in range(len(q_list)) if q_list[s] > 0]
    active.sort(key=lambda s: (q_list[s], len_list[s]))
    tables = block_tables.to("cpu", torch.int64)
    dev = block_tables.device

    def build(seqs: list[int]) -> list[AttentionGroup]:
        return [
            _group(tables, qsl, q_lens, lens, block_size, m, dev)
            for m in _pack(seqs, q_list, len_list)
        ]

    decode = None
    if native_decode:
        ones = [s for s in active if q_list[s] == 1]
        if ones:
            active = [s for s in active if q_list[s] != 1]
            sel = torch.tensor(ones, dtype=torch.int64)
            decode = DecodeRows(sel.to(dev), qsl[sel].to(dev), lambda: build(ones))
    return build(active), decode


def _pack(active: list[int], q_list: list[int], len_list: list[int]) -> list[list[int]]:
    """Cut sequences sorted by (new tokens, length) into groups of similar shape."""
    members: list[list[int]] = []
    for s in active:
        if members:
            grp = members[-1]
            first, q_pad, ctx_pad = grp[0], q_list[s], len_list[s]  # sorted: s is the largest
            fits = (
                (len(grp) + 1) * ctx_pad <= GROUP_TOKENS
                and q_pad <= GROUP_PAD_FACTOR * q_list[first]
                and ctx_pad <= GROUP_PAD_FACTOR * len_list[first] + GROUP_SLACK_TOKENS
            )
            if fits:
                grp.append(s)
                continue
        members.append([s])
    return members


def _group(tables, qsl, q_lens, lens, block_size: int, members: list[int], dev) -> AttentionGroup:
    sel = torch.tensor(members, dtype=torch.int64)
    n, qn, ln, q0 = len(members), q_lens[sel], lens[sel], qsl[sel]  # [n] each
    q_pad, ctx_pad = int(qn.max()), int(ln.max())
    # Queries: row i of a sequence is new token min(i, qn - 1) (padding repeats the last one).
    qi = torch.arange(q_pad)
    qi_c = torch.minimum(qi[None, :], (qn - 1)[:, None])  # [n, Q]
    q_rows = (q0[:, None] + qi_c).flatten()
    q_pos = (ln - qn)[:, None] + qi_c  # [n, Q] position of each (clamped) query
    # Context: position p of a sequence reads min(p, len - 1), never a slot past its length.
    p = torch.minimum(torch.arange(ctx_pad)[None, :], (ln - 1)[:, None])  # [n, L]
    blocks = torch.gather(tables[sel], 1, p // block_size).flatten()
    offsets = (p % block_size).flatten()
    uniform_q, uniform_len = bool((qn == q_pad).all()), bool((ln == ctx_pad).all())
    out_rows, out_sel = q_rows, None
    if not uniform_q:
        keep = (qi[None, :] < qn[:, None]).flatten().nonzero().flatten()
        out_rows, out_sel = q_rows[keep], keep
    mask, is_causal = None, False
    if q_pad == 1 and uniform_len:
        pass  # decode, equal lengths: every position is visible
    elif n == 1 and q_pad == ctx_pad:
        is_causal = True  # a whole prompt: plain causal
    else:
        kpos = torch.arange(ctx_pad)
        mask = (kpos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [n, 1, Q, L]
    return AttentionGroup(
        n, q_pad, ctx_pad, q_rows.to(dev), out_rows.to(dev),
        None if out_sel is None else out_sel.to(dev),
        blocks.to(dev), offsets.to(dev), None if mask is None else mask.to(dev), is_causal,
    )  # fmt: skip
