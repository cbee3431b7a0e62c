"""A step's request turned into the model's packed inputs: validation, slot mapping, metadata.

The worker is stateless between steps apart from its mapped pool and its model (DESIGN.md;
vLLM's scheduler-output / worker split): every ``StepRequest`` carries each sequence's new
tokens, their positions, its block table and its sampling parameters. From those,
`build_step_inputs` checks the batch once and derives, per new token at position ``p`` of a
sequence with block table ``bt``::

    slot = bt[p // block_size] * block_size + p % block_size        (int64)

plus the packed batch's block tables, ``query_start_loc``, ``seq_lens`` and the rows whose
logits are sampled (vLLM v1's ``InputBatch`` / model-runner inputs), and keeps host copies of the
lengths so that the step's attention plan (`StepInputs.attention_plan`) is built without waiting
on the device. A sampled sequence whose sampling sets a penalty also carries its token history
(``prompt_token_ids``, ``output_token_ids``), and one under structured output its token bitmask,
read by `compute_service.step_sampling` and handed to the sampler as a
`compute_service.penalties.TokenHistory` and a `compute_service.logits_processors.TokenMasks`.
The step's copy-on-write pairs are checked against the pool here and done by the worker from its
grants (`compute_service.grant_check`), never from these inputs. Nothing here touches the pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from compute_service.logits_processors import TokenMasks
from compute_service.penalties import TokenHistory
from compute_service.sampling import SamplingParams
from compute_service.step_sampling import ints, sampling_from_proto, token_bitmask, token_history
from compute_service.step_upload import StepUpload
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.runtime.errors import InvalidArgumentError

#: Most new tokens one step may carry (prefill chunks + decode tokens).
MAX_STEP_TOKENS = 65_536
#: Most sequences one step may carry.
MAX_STEP_SEQUENCES = 4_096


@dataclass(slots=True)
class StepInputs:
    """One step's packed batch: T new tokens of S sequences, S' of them sampled.

    Tensors are on the model's device; build with `build_step_inputs`.
    """

    token_ids: torch.Tensor  # token_ids: [T] int64, new tokens of every sequence, packed in batch order
    positions: torch.Tensor  # positions: [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # slot_mapping: [T] int64, block * block_size + offset of each new token
    block_tables: torch.Tensor  # block_tables: [S, max_blocks] int32, zero-padded past each table
    query_start_loc: torch.Tensor  # query_start_loc: [S + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # seq_lens: [S] int32, tokens in the cache after this step
    host_query_start_loc: torch.Tensor  # [S + 1] int32 on the CPU, the values of query_start_loc
    host_seq_lens: torch.Tensor  # [S] int32 on the CPU, the values of seq_lens
    logits_indices: torch.Tensor  # logits_indices: [S'] int64, packed row of each sampled sequence's last token
    sample_rows: list[int]  # [S'] batch index of each sampled sequence
    sampling: list[SamplingParams]  # [S'] sampling parameters of each sampled sequence
    history: TokenHistory | None = None  # token ids of the sampled sequences that set a penalty; None: none does
    masks: TokenMasks | None = None  # token bitmasks of the sampled sequences that carry one; None: none does

    def __post_init__(self) -> None:
        t, s = self.token_ids.shape[0], self.seq_lens.shape[0]
        assert self.positions.shape == (t,) and self.slot_mapping.shape == (t,), "one position and slot per token"
        assert self.block_tables.shape[0] == s and self.query_start_loc.shape == (s + 1,), "one row per sequence"
        assert self.host_query_start_loc.shape == (s + 1,) and self.host_seq_lens.shape == (s,), "host lengths"
        assert self.host_query_start_loc.device.type == self.host_seq_lens.device.type == "cpu", "host lengths"
        n = self.logits_indices.shape[0]
        assert len(self.sample_rows) == n and len(self.sampling) == n, "one logits row per sampled sequence"

    @property
    def num_tokens(self) -> int:
        """T, new tokens in the step."""
        return int(self.token_ids.shape[0])

    def attention_plan(self, kv_pool: torch.Tensor) -> kernels.AttentionPlan:
        """The step's attention plan over `kv_pool` [num_blocks, L, 2, block_size, Hkv, Dh],
        built from the host copies of the lengths (no device sync); shared by every layer."""
        return kernels.plan_attention(
            self.block_tables, self.query_start_loc, self.seq_lens, kv_pool.shape[3],
            host_query_start_loc=self.host_query_start_loc, host_seq_lens=self.host_seq_lens,
            num_kv_heads=kv_pool.shape[4],
        )  # fmt: skip

    def model_args(self, kv_pool: torch.Tensor, kv_scales=None) -> tuple:
        """Positional arguments of `LlamaForPagedLM.forward` over `kv_pool` (plans the step's
        attention: `attention_plan`), with an fp8 pool's per-layer `kv_scales`."""
        return (
            self.token_ids, self.positions, kv_pool, self.slot_mapping, self.attention_plan(kv_pool),
            self.logits_indices, kv_scales,
        )  # fmt: skip


def _first_violation(request: pb.StepRequest, block_size: int, num_blocks: int, vocab_size: int) -> None:
    """Raise the first violation of the batch, in batch order, per sequence (the checks of
    `build_step_inputs`, one sequence at a time, so the error names the sequence and what is wrong).

    Raises:
        InvalidArgumentError: as `build_step_inputs`.
    """
    bs, vocab = block_size, vocab_size
    seen: set[int] = set()
    slots: list[int] = []
    for i, s in enumerate(request.sequences):
        where = f"Step sequence {s.seq_id} (batch index {i})"
        if s.seq_id in seen:
            raise InvalidArgumentError(f"{where}: seq_id appears twice in the batch")
        seen.add(s.seq_id)
        n = len(s.token_ids)
        if n == 0:
            raise InvalidArgumentError(f"{where}: token_ids is empty; send the prompt chunk or the last token")
        if len(s.positions) != n:
            raise InvalidArgumentError(f"{where}: {len(s.positions)} positions for {n} tokens")
        p0 = s.positions[0]
        if p0 < 0 or list(s.positions) != list(range(p0, p0 + n)):
            raise InvalidArgumentError(
                f"{where}: positions must be consecutive and >= 0 (got {list(s.positions)[:8]}...); "
                "a skipped position would leave a hole in the KV cache")
        if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
            raise InvalidArgumentError(f"{where}: token ids must be in [0, {vocab}) (the vocabulary)")
        table = list(s.block_ids)
        need = (p0 + n + bs - 1) // bs
        if len(table) < need:
            raise InvalidArgumentError(
                f"{where}: block table has {len(table)} blocks but positions up to {p0 + n - 1} need {need} "
                f"(block size {bs}); append slots in the memory service first")
        if table and (max(table) >= num_blocks or min(table) < 0):
            raise InvalidArgumentError(f"{where}: block id {max(table)} is outside the pool (0..{num_blocks - 1})")
        slots.extend(table[p // bs] * bs + p % bs for p in range(p0, p0 + n))
        if not s.skip_sampling:
            if s.output_index < 0:
                raise InvalidArgumentError(f"{where}: output_index must be >= 0")
            params = sampling_from_proto(s.sampling, where, vocab)
            if params.has_penalties:
                token_history(s, params, vocab, where)
            token_bitmask(s, vocab, where)
    if len(slots) > MAX_STEP_TOKENS:
        raise InvalidArgumentError(f"Step: {len(slots)} tokens is more than {MAX_STEP_TOKENS} per step; "
                                   "chunk the prefill")
    if len(set(slots)) != len(slots):
        raise InvalidArgumentError("Step: two tokens of the batch map to the same KV slot; block tables overlap")
    for c in request.copies:
        if c.src >= num_blocks or c.dst >= num_blocks or c.src == c.dst:
            raise InvalidArgumentError(
                f"Step: copy ({c.src} -> {c.dst}) must name two different blocks inside the pool (0..{num_blocks - 1})"
            )


@dataclass(slots=True)
class _BatchCounts:
    """What one pass over a step's sequences reads: per-sequence counts and the sampled ones."""

    lens: list[int]  # [S] new tokens of each sequence
    starts: list[int]  # [S] position of each sequence's first new token
    table_lens: list[int]  # [S] block-table entries each sequence sent
    sampling: list[SamplingParams]  # [S'] parameters of each sampled sequence
    sample_rows: list[int]  # [S'] batch index of each sampled sequence
    history: TokenHistory | None  # token ids of the sampled sequences that set a penalty
    masks: TokenMasks | None  # token bitmasks of the sampled sequences that carry one


@dataclass(slots=True)
class _PackedBatch:
    """The batch's tokens laid out for the model, as numpy arrays (T tokens, S sequences)."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, block * block_size + offset
    block_tables: np.ndarray  # [S, max_blocks] int32, zero past each sequence's need
    seq_lens: np.ndarray  # [S] int64, tokens in the cache after the step


def build_step_inputs(
    request: pb.StepRequest,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    device: torch.device | str,
    upload: StepUpload | None = None,
) -> StepInputs:
    """Validate the batch of `request` and build the model's packed inputs on `device`.

    One pass over the sequences reads each one's counts (`_count_batch`); the token ids,
    positions, block tables and slots of the whole batch are then checked and built with numpy at
    once (`_pack_batch`). On any failed check the sequences are walked again one by one
    (`_first_violation`) to name the first violation. The copy-on-write pairs are only checked
    here: the worker does the copies its grants name (`compute_service.grant_check`).

    Args:
        request: the step (sequences, their block tables, copy-on-write pairs).
        block_size: tokens per block of the mapped pool.
        num_blocks: blocks in the mapped pool; block ids must be below it.
        vocab_size: token ids must be below it.
        device: where the model runs.
        upload: moves the metadata to ``device`` (one packed copy on CUDA,
            compute_service.step_upload); None: a ``.to(device)`` per tensor.

    Raises:
        InvalidArgumentError: empty or oversized batch; a duplicate seq_id; no tokens; a
            token outside the vocabulary; positions negative or not consecutive; a block
            table too short for the positions; a block id outside the pool; two tokens
            writing one slot; a copy naming a block outside the pool; bad sampling values; a
            penalty without the token history it needs (`token_history`); a token bitmask of the
            wrong size or allowing no token (`token_bitmask`; not read on a skip_sampling sequence).
    """
    seqs = request.sequences
    S = len(seqs)
    if not seqs:
        raise InvalidArgumentError("Step: the batch is empty; send at least one sequence")
    if S > MAX_STEP_SEQUENCES:
        raise InvalidArgumentError(f"Step: {S} sequences is more than {MAX_STEP_SEQUENCES} per step")

    def fail():
        _first_violation(request, block_size, num_blocks, vocab_size)
        raise InvalidArgumentError("Step: the batch is malformed")  # not reached: the walk names it

    counts = _count_batch(seqs, vocab_size, fail)
    packed = _pack_batch(seqs, counts, block_size, num_blocks, vocab_size, fail)
    if any(c.src >= num_blocks or c.dst >= num_blocks or c.src == c.dst for c in request.copies):
        fail()
    qsl = torch.zeros(S + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(counts.lens, dtype=torch.int32), 0, out=qsl[1:])
    logits_indices = (qsl[1:].to(torch.int64) - 1)[torch.tensor(counts.sample_rows, dtype=torch.int64)]
    seq_lens_t = torch.from_numpy(packed.seq_lens.astype(np.int32))
    token_ids, positions, slots, tables, qsl_d, lens_d, logits_d = (upload or StepUpload(device, staged=False))([
        packed.token_ids, np.asarray(packed.positions, dtype=np.int64), packed.slot_mapping, packed.block_tables,
        qsl.numpy(), seq_lens_t.numpy(), logits_indices.numpy()])
    return StepInputs(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=tables,
        query_start_loc=qsl_d,
        seq_lens=lens_d,
        host_query_start_loc=qsl,
        host_seq_lens=seq_lens_t,
        logits_indices=logits_d,
        sample_rows=counts.sample_rows,
        sampling=counts.sampling,
        history=counts.history,
        masks=counts.masks,
    )


def _count_batch(seqs, vocab_size: int, fail) -> _BatchCounts:
    """One pass over ``seqs`` (the step's ``StepSequence`` messages): their counts, and the sampling
    parameters, token histories and bitmasks of the sampled ones; calls ``fail`` (which raises) on a
    sequence without tokens, positions that do not match them, or bad sampling values, history or bitmask."""
    lens, starts, table_lens, params, out_idx = [], [], [], [], []
    hist_rows, hist_prompt, hist_output, mask_rows, mask_bits = [], [], [], [], []
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        if n == 0 or len(s.positions) != n:
            fail()
        lens.append(n)
        starts.append(s.positions[0])
        table_lens.append(len(s.block_ids))
        if not s.skip_sampling:
            if s.output_index < 0:
                fail()
            try:
                p = sampling_from_proto(s.sampling, f"Step sequence {s.seq_id} (batch index {i})", vocab_size)
                if p.has_penalties:
                    prompt, output = token_history(s, p, vocab_size, "")
                    hist_rows.append(len(params))
                    hist_prompt.append(prompt)
                    hist_output.append(output)
                mask = token_bitmask(s, vocab_size, "")
                if mask is not None:
                    mask_rows.append(len(params))
                    mask_bits.append(mask)
            except InvalidArgumentError:
                fail()  # names the first violation in batch order (this one unless an earlier one)
            params.append(p)
            out_idx.append(i)
    history = TokenHistory(hist_rows, hist_prompt, hist_output) if hist_rows else None
    masks = TokenMasks(mask_rows, np.stack(mask_bits)) if mask_rows else None
    return _BatchCounts(lens, starts, table_lens, params, out_idx, history, masks)


def _pack_batch(seqs, counts: _BatchCounts, bs: int, num_blocks: int, vocab_size: int, fail) -> _PackedBatch:
    """The whole batch's tokens, positions, block tables and slots, checked at once with numpy;
    calls ``fail`` (which raises) on too many tokens, a duplicate seq_id, a token outside the
    vocabulary, bad positions, a block table too short or naming a block outside the pool, or two
    tokens writing one slot."""
    S = len(seqs)
    T = sum(counts.lens)
    if T > MAX_STEP_TOKENS or len({s.seq_id for s in seqs}) != S:
        fail()
    lens_np = np.array(counts.lens, dtype=np.int64)
    starts_np = np.array(counts.starts, dtype=np.int64)
    tl_np = np.array(counts.table_lens, dtype=np.int64)
    seq_lens_np = starts_np + lens_np
    need = (seq_lens_np + bs - 1) // bs
    tokens = ints(itertools.chain.from_iterable(s.token_ids for s in seqs), T)
    if T == S:  # decode: one token each, its position is the start
        positions = starts_np
        token_seq = np.arange(S)
        bad_positions = bool((starts_np < 0).any())
    else:
        token_seq = np.repeat(np.arange(S), lens_np)
        first = np.cumsum(lens_np) - lens_np
        positions = ints(itertools.chain.from_iterable(s.positions for s in seqs), T)
        expected = starts_np[token_seq] + (np.arange(T) - first[token_seq])
        bad_positions = bool((starts_np < 0).any()) or not np.array_equal(positions, expected)
    if bad_positions or tokens.min() < 0 or tokens.max() >= vocab_size or (tl_np < need).any():
        fail()
    flat = ints(itertools.chain.from_iterable(s.block_ids for s in seqs), int(tl_np.sum()))
    if flat.size and (flat.max() >= num_blocks or flat.min() < 0):
        fail()
    # Block tables [S, max need], zero past each sequence's need; row r of flat starts at tstart[r].
    max_blocks = int(need.max())
    tstart = np.cumsum(tl_np) - tl_np
    cols = np.arange(max_blocks)
    take = cols[None, :] < need[:, None]  # [S, max_blocks]
    idx = np.where(take, tstart[:, None] + cols[None, :], 0)
    block_tables = np.where(take, flat[idx] if flat.size else 0, 0).astype(np.int32)
    slots = block_tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
    if T > 1 and np.unique(slots).size != T:
        fail()
    return _PackedBatch(tokens, positions, slots, block_tables, seq_lens_np)
