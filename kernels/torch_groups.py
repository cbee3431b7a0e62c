"""Gather groups of the torch attention path: sequences packed into padded batches, planned once.

Torch path (CPU): sequences are sorted by (new tokens, context length) and packed into *groups*
of similar shape. For each group the plan holds the padded query rows, the pool row of every
context position (positions past a sequence's length are clamped to its last valid position, so
no byte outside a sequence's context is ever gathered), and, when lengths differ inside the
group, the causal bottom-right aligned visibility mask. A layer then runs, per group, two
`index_select`s (keys, values) into a reused workspace and one batched
`scaled_dot_product_attention` (padded batched SDPA, GQA; `kernels.torch_planned.planned_attention`).
Prefill sequences (at least `EXACT_GROUP_MIN_TOKENS` new tokens: prompts, chunks of chunked
prefill, prefill after a prefix hit) are never padded: each shares a group only with sequences of
exactly its shape, so whole prompts need no mask (`is_causal`) and a chunk after a cached prefix
one [Q, L] bottom-right mask shared by the group; padding pays only for many short rows.
Masked and causal groups gather a context aligned to `CTX_ALIGN` positions (clamped rows,
hidden by the mask or by causality), the shapes torch's bf16 CPU flash attention runs fast.
When the native CPU decode kernel is available (`kernels.cpu.native`), sequences with one new
token are not grouped: the plan lists them (`DecodeRows`) and the kernel reads their blocks in
place; their gather groups are built only if a call cannot use the kernel (a cache dtype or
layout it does not support).

Built by `kernels.plan.plan_attention`; this module holds no policy about which kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Gathered context positions per group (keys of all its sequences, padded): 4096 positions of
# SmolLM2's 3 KV heads x 64 is 3 MiB of keys and values, which stays in the last-level cache
# between the gather and the attention that reads it.
GROUP_TOKENS = 4096
# A sequence joins a group only if padding it to the group's largest shape costs at most this
# factor over the group's smallest member (plus `GROUP_SLACK_TOKENS` positions).
GROUP_PAD_FACTOR = 1.25
GROUP_SLACK_TOKENS = 64
# Sequences with at least this many new tokens are grouped only with sequences of their exact
# (new tokens, length): their SDPA is large enough that padding and masks cost more than calls.
EXACT_GROUP_MIN_TOKENS = 32
# Gathered context length of a masked or causal group is padded to a multiple of this many
# positions (padding hidden by the mask or by causality): torch's bf16 CPU flash attention runs
# 2-4x slower on key lengths that are not a multiple of a small power of two (e.g. 274 vs 288).
CTX_ALIGN = 32


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together as one padded batch [n, heads, q_pad, ctx_pad]."""

    num_seqs: int  # n, sequences in the group
    q_pad: int  # padded new tokens per sequence (1 for decode)
    ctx_pad: int  # padded context positions per sequence (aligned to CTX_ALIGN unless unmasked)
    q_rows: torch.Tensor  # [n * q_pad] int64 packed query rows; padding repeats a real row
    # q_rows == range(q_start, q_start + n * q_pad) and out_sel is None: queries are read and
    # results written as one slice of the packed rows (no index_select / index_copy); else None.
    q_start: int | None
    out_rows: torch.Tensor  # [m] int64 packed rows this group writes (its real queries)
    out_sel: torch.Tensor | None  # [m] int64 rows of the padded result to keep; None: all
    blocks: torch.Tensor  # [n * ctx_pad] int64 block id of each gathered position (clamped)
    offsets: torch.Tensor  # [n * ctx_pad] int64 offset inside the block of each position
    # [n or 1, 1, q_pad, ctx_pad] bool visibility (1: every member has the same); None: see
    # is_causal
    mask: torch.Tensor | None
    # no mask and top-left causal (whole prompts of one length: q_pad == their length <= ctx_pad)
    is_causal: bool
    # NOTE: rows of the per-layer flat cache view depend only on the pool's block stride,
    # which is the same for every layer, and the additive mask only on the compute dtype:
    # both are computed by the first layer, reused by the others.
    _rows: dict[int, torch.Tensor] = field(default_factory=dict)
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def rows(self, rows_per_block: int) -> torch.Tensor:
        """[n * ctx_pad] int64 row of each position in a cache view flattened to rows."""
        r = self._rows.get(rows_per_block)
        if r is None:
            r = self._rows[rows_per_block] = self.blocks * rows_per_block + self.offsets
        return r

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as an additive SDPA mask of `dtype` (0 visible, -inf hidden), or None."""
        if self.mask is None:
            return None
        m = self._masks.get(dtype)
        if m is None:
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            m = self._masks[dtype] = zero.masked_fill(~self.mask, float("-inf"))
        return m


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


def make_groups(
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
    """Cut sequences sorted by (new tokens, length) into groups of similar shape; sequences with
    `EXACT_GROUP_MIN_TOKENS` new tokens or more only into groups of their exact shape."""
    members: list[list[int]] = []
    for s in active:
        if members:
            grp = members[-1]
            first, q_pad, ctx_pad = grp[0], q_list[s], len_list[s]  # sorted: s is the largest
            if q_pad >= EXACT_GROUP_MIN_TOKENS:
                similar = q_pad == q_list[first] and ctx_pad == len_list[first]
            else:
                similar = (
                    q_pad <= GROUP_PAD_FACTOR * q_list[first]
                    and ctx_pad <= GROUP_PAD_FACTOR * len_list[first] + GROUP_SLACK_TOKENS
                )
            fits = similar and (len(grp) + 1) * ctx_pad <= GROUP_TOKENS
            if fits:
                grp.append(s)
                continue
        members.append([s])
    return members


def _group(tables, qsl, q_lens, lens, block_size: int, members: list[int], dev) -> AttentionGroup:
    sel = torch.tensor(members, dtype=torch.int64)
    n, qn, ln, q0 = len(members), q_lens[sel], lens[sel], qsl[sel]  # [n] each
    q_pad, ctx_len = int(qn.max()), int(ln.max())
    uniform_q, uniform_len = bool((qn == q_pad).all()), bool((ln == ctx_len).all())
    ctx_pad = ctx_len
    if q_pad > 1 or not uniform_len:  # masked or causal: padding costs nothing
        ctx_pad = -(-ctx_len // CTX_ALIGN) * CTX_ALIGN
    # Queries: row i of a sequence is new token min(i, qn - 1) (padding repeats the last one).
    qi = torch.arange(q_pad)
    qi_c = torch.minimum(qi[None, :], (qn - 1)[:, None])  # [n, Q]
    q_rows = (q0[:, None] + qi_c).flatten()
    q_pos = (ln - qn)[:, None] + qi_c  # [n, Q] position of each (clamped) query
    # Context: position p of a sequence reads min(p, len - 1), never a slot past its length.
    p = torch.minimum(torch.arange(ctx_pad)[None, :], (ln - 1)[:, None])  # [n, L]
    blocks = torch.gather(tables[sel], 1, p // block_size).flatten()
    offsets = (p % block_size).flatten()
    out_rows, out_sel = q_rows, None
    if not uniform_q:
        keep = (qi[None, :] < qn[:, None]).flatten().nonzero().flatten()
        out_rows, out_sel = q_rows[keep], keep
    mask, is_causal = None, False
    if q_pad == 1 and uniform_len:
        pass  # decode, equal lengths: every position is visible
    elif uniform_q and uniform_len and q_pad == ctx_len:
        # whole prompts of one length: top-left causal, which also hides the aligned padding
        is_causal = True
    else:
        if uniform_q and uniform_len:
            q_pos = q_pos[:1]  # one shape: one mask for every member
        kpos = torch.arange(ctx_pad)
        mask = (kpos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [n or 1, 1, Q, L]
    q_start = None
    if out_sel is None and bool((q_rows[1:] - q_rows[:-1] == 1).all()):
        q_start = int(q_rows[0])
    return AttentionGroup(
        n, q_pad, ctx_pad, q_rows.to(dev), q_start, out_rows.to(dev),
        None if out_sel is None else out_sel.to(dev),
        blocks.to(dev), offsets.to(dev), None if mask is None else mask.to(dev), is_causal,
    )  # fmt: skip
