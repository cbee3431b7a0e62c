"""Attention plan: one step's paged-attention metadata, checked once, and the kernel that will run.

After FlashInfer's `plan()` / `run()` split: a model step calls `plan_attention` once with the
step's block tables, query_start_loc and seq_lens (plus host copies of the lengths), then passes
the plan to `kernels.paged_attention` in every layer, which takes no metadata, does no host work,
no device-to-host sync and no value validation.

The plan picks the kernel (`AttentionPlan.kernel`):

- "triton_decode": Triton backend, every sequence has exactly one new token. The split-KV
  decode kernel (flash-decoding: `kernels.triton.decode`) with its number of context splits
  fixed here from the batch's shape (`default_num_splits`).
- "triton_prefill": Triton backend, any other batch (prompts, chunked prefill, prefix hits and
  decode tokens mixed): `kernels.triton.prefill`.
- "torch": the torch backend (the CPU production path): decode rows to the native CPU kernel
  when it is built (`plan.decode`), every other row in padded gather groups (`plan.groups`;
  `kernels.torch_groups`).

Planning never waits on the device: lengths are read from host copies (`host_query_start_loc`,
`host_seq_lens`; CPU metadata tensors are their own host copies), and only device-side
conversions of the metadata tensors are queued.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kernels._common import BACKENDS, check_host_lengths, check_int_vector
from kernels.cpu import native as cpu_native
from kernels.torch_groups import AttentionGroup, DecodeRows, make_groups
from pagedkv.config import env

KERNELS = ("triton_decode", "triton_prefill", "torch")

# Split-KV policy of the Triton decode kernel (flash-decoding): one program per (sequence, KV head)
# leaves most of a GPU idle at small batches (3 programs for SmolLM2 at batch 1 on 132 SMs), so the
# context is split until the programs fill the SMs this many times over.
SPLIT_KV_WAVES = 2
# A split covers at least this many context positions (4 tiles of 32): below, the per-split cost
# (loading the query rows, the partial result and the reduce) outweighs what it spreads.
SPLIT_KV_MIN_TOKENS_PER_SPLIT = 128
# Upper bound on splits; a power of two (the reduce kernel's width, kernels.triton.decode).
SPLIT_KV_MAX_SPLITS = 64
# Split sizes are multiples of this many context positions (the decode kernel's smallest tile).
SPLIT_KV_GRANULE = 32
# SMs assumed when the plan does not know the device (a CPU plan, or a GPU not yet asked): an H100/H200's.
DEFAULT_NUM_SMS = 132


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS) -> int:
    """Split-KV ranges of the Triton decode kernel for a batch of this shape (host arithmetic).

    By occupancy: no split once ``num_seqs * num_kv_heads`` programs reach ``SPLIT_KV_WAVES *
    num_sms``; below, enough splits to get there, but no more than one per
    `SPLIT_KV_MIN_TOKENS_PER_SPLIT` context positions of the longest sequence, and at most
    `SPLIT_KV_MAX_SPLITS`. The split count is a runtime argument of the kernels: a value never
    seen costs no compilation.
    """
    programs = max(1, num_seqs * num_kv_heads)
    target = SPLIT_KV_WAVES * max(1, num_sms)
    if programs >= target:
        return 1
    by_occupancy = -(-target // programs)
    by_length = max(1, max_seq_len // SPLIT_KV_MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, SPLIT_KV_MAX_SPLITS))


def split_size(max_seq_len: int, num_splits: int) -> int:
    """Context positions per split of the Triton decode kernel: ``max_seq_len`` over ``num_splits``,
    rounded up to a multiple of `SPLIT_KV_GRANULE` (at least one granule)."""
    per = -(-max(max_seq_len, 1) // num_splits)
    return -(-per // SPLIT_KV_GRANULE) * SPLIT_KV_GRANULE


@dataclass(slots=True)
class AttentionPlan:
    """One step's batch for every layer's `kernels.paged_attention`; build with `plan_attention`.

    NOTE: invariants (checked by `plan_attention`, trusted by `paged_attention`):
    - 0 = query_start_loc[0] <= ... <= query_start_loc[S] = total_q, and for every sequence
      0 <= new tokens <= seq_len <= block_size * block_tables.shape[1], seq_len >= 1 if it
      has new tokens.
    - kernel "triton_decode" iff backend "triton" and every sequence has one new token
      (`decode_only`); then `num_splits` (if set) >= 1 and `max_seq_len` = max(seq_lens).
    - groups/decode/max_group_tokens are set only for kernel "torch".
    - sliding_window is None (not implemented yet, see `plan_attention`).
    """

    backend: str  # "torch" or "triton"
    kernel: str  # one of KERNELS: what `paged_attention` runs
    num_seqs: int  # S
    total_q: int  # packed new tokens of the batch (query rows)
    block_size: int  # tokens per cache block
    max_seq_len: int  # max(seq_lens), 0 for an empty batch (from the host copy)
    decode_only: bool  # every sequence has exactly one new token
    block_tables: torch.Tensor  # [S, max_blocks] int32 contiguous, on the metadata's device
    query_start_loc: torch.Tensor  # [S + 1] int32 contiguous
    seq_lens: torch.Tensor  # [S] int32 contiguous
    # triton_decode: split-KV ranges per sequence, fixed at plan time when num_kv_heads is known;
    # None: chosen by `default_num_splits` from the cache's KV heads at the first call.
    num_splits: int | None = None
    # torch: padded batches covering every query row not in `decode`.
    groups: list[AttentionGroup] = field(default_factory=list)
    max_group_tokens: int = 0  # torch: largest n * ctx_pad of `groups` (workspace rows)
    # torch with the native CPU decode kernel: the one-new-token sequences; else None.
    decode: DecodeRows | None = None
    # Room for a later feature; None only for now (a set value is refused by plan_attention).
    sliding_window: int | None = None  # tokens a query sees back from itself (incl. itself)
    # Gather buffers reused by every layer, keyed by (dtype, num_kv_heads, head_dim) (torch).
    workspace: dict = field(default_factory=dict)
    # triton_decode in a CUDA graph (compute_service.model.decode_graphs): [2] int32 on the metadata's
    # device, (num_splits, tokens_per_split) of the replay, written before each replay and read by the
    # kernels at run time; `num_splits` is then the grid's count, the most a replay may use. None: eager.
    split_args: torch.Tensor | None = None

    def splits_for(self, num_kv_heads: int) -> int:
        """Split-KV ranges of the decode kernel for a cache with `num_kv_heads` heads, on the SMs of
        the metadata's GPU."""
        if self.num_splits is None:
            self.num_splits = default_num_splits(self.num_seqs, num_kv_heads, self.max_seq_len,
                                                 num_sms(self.block_tables.device))
        return self.num_splits


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; `DEFAULT_NUM_SMS` for any other."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_attention(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    *,
    host_query_start_loc: torch.Tensor | list[int] | None = None,
    host_seq_lens: torch.Tensor | list[int] | None = None,
    num_kv_heads: int | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    backend: str | None = None,
) -> AttentionPlan:
    """Check one step's attention metadata and pick its kernel (host work, once per step).

    Args:
        block_tables: [num_seqs, max_blocks] int32 block ids (int64 accepted on the CPU when
            every id to be read fits in int32); entries past a sequence's last block are never
            read.
        query_start_loc: [num_seqs + 1] int32, cumulative new-token counts (0 first).
        seq_lens: [num_seqs] int32, tokens in the cache after this step (cached + new).
        block_size: tokens per cache block.
        host_query_start_loc, host_seq_lens: the same values on the host (CPU int tensors or
            lists), read instead of the metadata tensors, which are never read back. Required
            when the metadata is not on the CPU; CPU metadata tensors are their own host copies.
        num_kv_heads: KV heads of the cache; lets the Triton decode split policy be fixed here
            (else at the first `paged_attention` call, from the cache's shape).
        num_splits: force this many split-KV ranges (>= 1) on the Triton decode kernel (tests,
            benchmarks); only for a plan whose kernel is "triton_decode".
        sliding_window: not implemented yet; must be None. (fp8 KV scales are no plan
            metadata: static per layer, they go to each op; see `kernels.fp8`.)
        backend: None (Triton for CUDA tensors, torch otherwise), "triton" or "torch"; planning
            for "triton" needs no GPU and launches nothing. "torch" with CUDA metadata (a
            reference path there, not production) copies the block table to the host.

    Returns:
        An `AttentionPlan` for every layer of the step; it keeps its own int32 copies of the
        metadata, so later in-place changes to the caller's tensors do not reach it.

    Raises:
        ValueError: bad shapes/dtypes/devices, a missing or misshapen host copy, query_start_loc
            not starting at 0 or decreasing, new tokens > seq_len, a seq_len past the block
            table, an int64 block id to be read that does not fit in int32 (or int64 block
            tables off the CPU), num_splits outside [1, SPLIT_KV_MAX_SPLITS] or given for another kernel, a malformed
            sliding_window.
        NotImplementedError: a sliding_window that is set.
    """
    backend = _check_arguments(block_tables, query_start_loc, seq_lens, block_size, num_kv_heads, num_splits,
                               sliding_window, backend)
    num_seqs, max_blocks = block_tables.shape
    on_host = block_tables.device.type == "cpu"
    qsl = _host_copy("query_start_loc", host_query_start_loc, query_start_loc, on_host)
    lens = _host_copy("seq_lens", host_seq_lens, seq_lens, on_host)
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(qsl[0])}")
    q_lens = qsl[1:] - qsl[:-1]
    check_host_lengths(lens, q_lens, block_size, max_blocks)
    if block_tables.dtype == torch.int64:
        _check_int32_ids(block_tables, lens, block_size)
    decode_only = bool((q_lens == 1).all())
    kernel = ("triton_decode" if decode_only else "triton_prefill") if backend == "triton" else "torch"
    if num_splits is not None and kernel != "triton_decode":
        raise ValueError(f"num_splits applies to the triton decode kernel only; this plan runs {kernel!r}")
    # The plan keeps its own int32 copies (device-side conversions: no sync).
    bt32, qsl32, sl32 = (_own_int32(t) for t in (block_tables, query_start_loc, seq_lens))
    max_len = int(lens.max()) if num_seqs else 0
    plan = AttentionPlan(
        backend, kernel, num_seqs, int(qsl[-1]), block_size, max_len, decode_only, bt32, qsl32, sl32,
    )  # fmt: skip
    if kernel == "triton_decode":
        plan.num_splits = num_splits
        if num_splits is None and num_kv_heads is not None:
            plan.splits_for(num_kv_heads)
    elif kernel == "torch":
        native = on_host and cpu_native.available()
        plan.groups, plan.decode = make_groups(block_tables, qsl, q_lens, lens, block_size, native)
        plan.max_group_tokens = max((g.num_seqs * g.ctx_pad for g in plan.groups), default=0)
    return plan


def _check_arguments(block_tables, query_start_loc, seq_lens, block_size: int, num_kv_heads, num_splits,
                     sliding_window, backend: str | None) -> str:
    """`plan_attention`'s checks of its tensors' shapes, dtypes and device and of its sizes (no
    host copy read yet); returns the backend (None resolved by the device)."""
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "block_tables must be [num_seqs, max_blocks] int32, got "
            f"{tuple(block_tables.shape)} {block_tables.dtype}"
        )
    num_seqs, max_blocks = block_tables.shape
    ints = (torch.int32, torch.int64)
    check_int_vector("seq_lens", seq_lens, num_seqs, ints)
    check_int_vector("query_start_loc", query_start_loc, num_seqs + 1, ints)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_kv_heads is not None and num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be >= 1 or None, got {num_kv_heads}")
    if num_splits is not None and not 1 <= num_splits <= SPLIT_KV_MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {SPLIT_KV_MAX_SPLITS}] or None, got {num_splits}")
    _check_unimplemented(sliding_window)
    devices = {t.device for t in (block_tables, query_start_loc, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if backend is None:
        return "triton" if block_tables.device.type == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return backend


def triton_ready(query: torch.Tensor) -> None:
    """Raise ValueError unless a Triton kernel can run on `query`'s device (CUDA, or CPU under
    `TRITON_INTERPRET=1`)."""
    if query.device.type != "cuda" and not env("TRITON_INTERPRET"):
        raise ValueError(
            "a triton plan needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            f"imported); got tensors on {query.device}"
        )


def _host_copy(name: str, host, tensor: torch.Tensor, on_host: bool) -> torch.Tensor:
    """[n] int64 CPU values of `tensor`, from `host` (or the tensor itself when on the CPU)."""
    if host is None:
        if not on_host:
            raise ValueError(
                f"{name} is on {tensor.device}: pass host_{name} (its values on the CPU, a tensor "
                "or a list) so that planning does not wait on the device"
            )
        host = tensor
    elif not isinstance(host, torch.Tensor):
        host = torch.tensor(list(host), dtype=torch.int64)
    if host.device.type != "cpu" or host.dim() != 1 or host.shape[0] != tensor.shape[0]:
        raise ValueError(
            f"host_{name} must be a 1-D CPU sequence of {tensor.shape[0]} ints, got "
            f"{tuple(host.shape)} on {host.device}"
        )
    if host.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"host_{name} must hold ints, got {host.dtype}")
    return host.to(torch.int64)


def _own_int32(t: torch.Tensor) -> torch.Tensor:
    """An int32 contiguous copy of `t` that shares no memory with it (queued on its device)."""
    c = t.to(torch.int32).contiguous()
    return c.clone() if c is t else c


def _check_int32_ids(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> None:
    """An int64 table's ids that will be read must fit in int32 (the kernels' copy must not wrap
    one onto another, valid block); checked on the host only."""
    if block_tables.device.type != "cpu":
        raise ValueError(
            "block_tables off the CPU must be int32 (checking int64 ids would read the device)"
        )
    if not block_tables.numel():
        return
    used = (lens + block_size - 1) // block_size  # [S] blocks read per sequence
    read = torch.arange(block_tables.shape[1])[None, :] < used[:, None]
    ids = block_tables[read]
    if ids.numel() and (int(ids.min()) < -(2**31) or int(ids.max()) >= 2**31):
        raise ValueError("block ids must fit in int32")


def _check_unimplemented(sliding_window) -> None:
    """The plan's room for sliding-window attention: checked, then refused."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        raise NotImplementedError("sliding-window attention is not implemented yet; pass sliding_window=None")
