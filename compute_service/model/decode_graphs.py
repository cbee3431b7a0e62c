"""Decode steps in CUDA graphs: one captured forward per batch-size bucket.

A decode step of a small model on a GPU is bound by its launches, not by the GPU: SmolLM2 runs
~10 kernels a layer over 30 layers, each a few microseconds of work behind ~5 us of Python and
driver launch cost. Replaying a captured CUDA graph launches them all at once (vLLM's CUDA graph
mode for decode; PyTorch's ``torch.cuda.graph``).

A graph replays fixed kernels on fixed addresses, so each bucket owns static inputs, and a step is
copied into them:

- **Buckets** (vLLM's capture sizes): batch sizes 1, 2, 4, then every multiple of 8 up to
  ``--max-cudagraph-capture-size``. A decode step of S sequences runs in the smallest bucket
  B >= S; its rows S..B-1 are padding.
- **Padding rows** write nothing and read nothing: slot -1 (the cache write skips it,
  `kernels.reshape_and_cache`), sequence length 0 (attention over an empty range gives 0, never
  NaN). Their logits are dropped.
- **Block tables** are padded to one width, the longest context the model takes (its
  ``max_position_embeddings``, at most the pool); a step whose tables are wider runs eagerly.
- **Split-KV** (`kernels.plan.default_num_splits`) changes with the context. The captured grid has
  the most splits any batch of the bucket may use, and the count and size the step needs are
  written into a device tensor that the kernels read at run time (`AttentionPlan.split_args`).
  They are the eager path's, so a replay splits the context as an eager step does.
- **The plan** is built once per bucket, outside the capture. The forward's host-side checks
  read shapes only, so the captured region has no host synchronization.
- **The LM head** runs after the replay, on the sampled rows only (vLLM's split of
  ``forward`` and ``compute_logits``): a graph's output is [B, hidden], not [B, vocabulary].

Captured only over a mapped pool (the graphs hold its addresses): `Worker.set_pool` drops them
with the pool and captures anew over the next. Prefill, mixed batches and wide tables run
eagerly, and ``--enforce-eager`` turns the graphs off.

The capture runs each bucket's forward on padding only, so it writes nothing to the pool. Off
CUDA (``capture=False``: tests under ``TRITON_INTERPRET=1``) nothing is captured, and `run`
runs the same padded forward eagerly on the bucket's static inputs.

Differences from an eager step: the decode kernel takes the first tuning candidate
(`kernels.triton.tuning`; an autotuner cannot time inside a capture), and one split of a grid of
several still goes through the merge kernel (the same values). With the eager path on that candidate too, the logits
are bit-identical (tests/compute_service/test_decode_graphs.py).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

import kernels
from kernels.plan import AttentionPlan, default_num_splits, num_sms, split_size


def capture_sizes(max_size: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, then every multiple of 8 up to ``max_size`` (vLLM's
    default capture sizes), ascending. Empty for ``max_size`` < 1.

    Raises:
        ValueError: ``max_size`` above 4096 (a step's most sequences, compute_service.step_inputs).
    """
    if max_size > 4096:
        raise ValueError(f"the largest captured batch must be at most 4096 sequences, got {max_size}")
    return [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``num_seqs`` sequences, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) and num_seqs >= 1 else None


@dataclass(slots=True)
class _Bucket:
    """One batch size's static inputs, its plan and (on CUDA) its captured graph.

    Every tensor is on the pool's device; the plan's block tables, lengths and split arguments
    are its own (written before each replay)."""

    size: int  # B, sequences the graph computes (padding included)
    token_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64, -1 on padding rows
    logits_indices: torch.Tensor  # [B] int64, 0..B-1: every row's logits
    plan: AttentionPlan  # triton_decode over block_tables [B, W] int32 and seq_lens [B] int32, split_args [2]
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # [B, D], the captured forward's output (final-normed hidden states)


class DecodeGraphs:
    """The decode forward of ``model`` over ``pool``, in one CUDA graph per batch bucket.

    Args:
        model: a `compute_service.model.llama.LlamaForPagedLM` on the pool's device.
        pool: the mapped pool, [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
        kv_scales: an fp8 pool's per-layer (k_scale, v_scale), else None.
        max_size: the largest batch captured (``--max-cudagraph-capture-size``).
        max_blocks: block-table width of every bucket: the most blocks a sequence may hold.
        capture: capture graphs (default: on a CUDA pool); False runs the padded forward eagerly.

    Raises:
        ValueError: ``max_size`` < 1 or > 4096, or ``max_blocks`` < 1.
    """

    def __init__(self, model, pool: torch.Tensor, kv_scales=None, *, max_size: int, max_blocks: int,
                 capture: bool | None = None):
        if max_size < 1 or max_blocks < 1:
            raise ValueError(f"CUDA graphs need a largest batch >= 1 and a table width >= 1, got {max_size} and "
                             f"{max_blocks}")
        self.model, self.pool, self.kv_scales = model, pool, kv_scales
        self.sizes = capture_sizes(max_size)
        self.max_blocks = max_blocks
        self.capture = pool.is_cuda if capture is None else capture
        self.block_size, self.num_kv_heads = pool.shape[3], pool.shape[4]
        self.device = pool.device
        self._sms = num_sms(pool.device)
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        # The step's (num_splits, tokens_per_split), staged page-locked and copied before each replay.
        self._host_args = torch.empty(2, dtype=torch.int32, pin_memory=pool.is_cuda)
        self.buckets: dict[int, _Bucket] = {}
        #: Decode steps run here so far (replays, or padded eager runs when not capturing).
        self.replays = 0

    def capture_all(self) -> float:
        """Build every bucket's inputs and plan and, when capturing, capture its graph, largest
        first (the graphs share one memory pool, as vLLM's). Writes nothing to the pool.

        Returns:
            seconds taken.
        """
        t = time.perf_counter()
        for size in reversed(self.sizes):
            b = self._bucket(size)
            if self.capture:
                self._capture(b)
            self.buckets[size] = b
        if self.capture:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t

    def applies(self, num_tokens: int, num_seqs: int, table_width: int) -> bool:
        """Whether a step of ``num_tokens`` new tokens for ``num_seqs`` sequences, block tables
        ``table_width`` wide, runs in a graph: decode only (one token each), a captured size, and
        tables no wider than the buckets'."""
        return (num_tokens == num_seqs and bucket_for(num_seqs, self.sizes) is not None
                and table_width <= self.max_blocks and bool(self.buckets))

    def run(self, inputs) -> torch.Tensor:
        """The logits of a decode step (`applies` holds): the step copied into its bucket, the
        graph replayed (or the padded forward run eagerly when not capturing).

        Args:
            inputs: the step's `compute_service.step_inputs.StepInputs`, on the pool's device.

        Returns:
            [S', vocab] float32, row r the logits of sampled sequence ``inputs.sample_rows[r]``.
        """
        b = self.buckets[bucket_for(inputs.num_tokens, self.sizes)]
        self._fill(b, inputs)
        if b.graph is not None:
            b.graph.replay()
            hidden = b.hidden
        else:
            hidden = self._forward(b)
        self.replays += 1
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def split_args(self, num_seqs: int, max_seq_len: int, grid_splits: int) -> tuple[int, int]:
        """(num_splits, tokens_per_split) of a decode step, as the eager path chooses them
        (`kernels.plan.default_num_splits` on this device's SMs), at most ``grid_splits``."""
        splits = min(grid_splits, default_num_splits(num_seqs, self.num_kv_heads, max_seq_len, self._sms))
        return splits, split_size(max_seq_len, splits)

    def _bucket(self, size: int) -> _Bucket:
        dev, w = self.device, self.max_blocks
        # The grid holds the most splits any batch of this bucket uses: its fewest sequences, the longest context.
        smaller = self.sizes[self.sizes.index(size) - 1] if size != self.sizes[0] else 0
        grid = default_num_splits(smaller + 1, self.num_kv_heads, w * self.block_size, self._sms)
        tables = torch.zeros(size, w, dtype=torch.int32, device=dev)
        qsl = torch.arange(size + 1, dtype=torch.int32, device=dev)
        lens = torch.zeros(size, dtype=torch.int32, device=dev)
        # Planned as if every row were as long as the table allows (the checks read the host copies only).
        plan = kernels.plan_attention(tables, qsl, lens, self.block_size, backend="triton",
                                      host_query_start_loc=torch.arange(size + 1),
                                      host_seq_lens=torch.full((size,), w * self.block_size), num_splits=grid)
        plan.split_args = torch.tensor([1, split_size(1, 1)], dtype=torch.int32, device=dev)
        return _Bucket(size, torch.zeros(size, dtype=torch.int64, device=dev),
                       torch.zeros(size, dtype=torch.int64, device=dev),
                       torch.full((size,), -1, dtype=torch.int64, device=dev),
                       torch.arange(size, dtype=torch.int64, device=dev), plan)

    def _forward(self, b: _Bucket) -> torch.Tensor:
        return self.model.hidden_states(b.token_ids, b.positions, self.pool, b.slot_mapping, b.plan, b.logits_indices,
                          self.kv_scales)

    def _capture(self, b: _Bucket) -> None:
        """Warm the bucket's forward up on a side stream (compiles its kernels, lets cuBLAS pick
        its algorithms), then capture it. Every row is padding: nothing is read or written."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        b.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graph, pool=self._mempool):
            b.hidden = self._forward(b)

    def _fill(self, b: _Bucket, inputs) -> None:
        """Copy a step's inputs into bucket ``b`` (queued on the current stream, before the replay):
        rows 0..S-1 the step's, the rest padding (token 0, position 0, slot -1, length 0, table
        zeros); the split count and size of the step. Host values only: nothing is read back."""
        s, w = inputs.num_tokens, inputs.block_tables.shape[1]
        b.token_ids[:s].copy_(inputs.token_ids)
        b.positions[:s].copy_(inputs.positions)
        b.slot_mapping[:s].copy_(inputs.slot_mapping)
        tables, lens = b.plan.block_tables, b.plan.seq_lens
        tables[:s, :w].copy_(inputs.block_tables)
        lens[:s].copy_(inputs.seq_lens)
        if s < b.size:
            b.token_ids[s:].zero_()
            b.positions[s:].zero_()
            b.slot_mapping[s:].fill_(-1)
            lens[s:].zero_()
            tables[s:].zero_()
        if w < self.max_blocks:
            tables[:s, w:].zero_()
        max_len = int(inputs.host_seq_lens.max())
        self._host_args[0], self._host_args[1] = self.split_args(s, max_len, b.plan.num_splits)
        # Safe to reuse the page-locked buffer: the worker fences every step before the next.
        b.plan.split_args.copy_(self._host_args, non_blocking=True)


__all__ = ["DecodeGraphs", "bucket_for", "capture_sizes"]
