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
on the device. Nothing here touches the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from compute_service.sampling import SamplingParams
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.errors import InvalidArgumentError

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
    block_copies: torch.Tensor  # block_copies: [C, 2] int64 (src, dst) copy-on-write pairs, done before the forward
    sample_rows: list[int]  # [S'] batch index of each sampled sequence
    sampling: list[SamplingParams]  # [S'] sampling parameters of each sampled sequence

    def __post_init__(self) -> None:
        t, s = self.token_ids.shape[0], self.seq_lens.shape[0]
        assert self.positions.shape == (t,) and self.slot_mapping.shape == (t,), "one position and slot per token"
        assert self.block_tables.shape[0] == s and self.query_start_loc.shape == (s + 1,), "one row per sequence"
        assert self.host_query_start_loc.shape == (s + 1,) and self.host_seq_lens.shape == (s,), "host lengths"
        assert self.host_query_start_loc.device.type == self.host_seq_lens.device.type == "cpu", "host lengths"
        n = self.logits_indices.shape[0]
        assert len(self.sample_rows) == n and len(self.sampling) == n, "one logits row per sampled sequence"
        assert self.block_copies.dim() == 2 and self.block_copies.shape[1] == 2, "copies are (src, dst) rows"

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

    def model_args(self, kv_pool: torch.Tensor) -> tuple:
        """Positional arguments of `LlamaForPagedLM.forward` over `kv_pool` (plans the step's
        attention: `attention_plan`)."""
        return (
            self.token_ids, self.positions, kv_pool, self.slot_mapping, self.attention_plan(kv_pool),
            self.logits_indices,
        )  # fmt: skip


def sampling_from_proto(sp: pb.SamplingParams, where: str) -> SamplingParams:
    """Worker-side sampling parameters; unset fields mean greedy / off.

    Raises:
        InvalidArgumentError: a value out of range.
    """
    try:
        return SamplingParams(
            temperature=sp.temperature if sp.HasField("temperature") else 0.0,
            top_k=sp.top_k if sp.HasField("top_k") else 0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            seed=sp.seed if sp.HasField("seed") else None,
            logprobs=sp.num_logprobs if sp.HasField("num_logprobs") else None,
        )
    except ValueError as e:
        raise InvalidArgumentError(f"{where}: bad sampling parameters: {e}") from e


def build_step_inputs(
    request: pb.StepRequest,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    device: torch.device | str,
) -> StepInputs:
    """Validate the batch of `request` and build the model's packed inputs on `device`.

    Args:
        request: the step (sequences, their block tables, copy-on-write pairs).
        block_size: tokens per block of the mapped pool.
        num_blocks: blocks in the mapped pool; block ids must be below it.
        vocab_size: token ids must be below it.
        device: where the model runs.

    Raises:
        InvalidArgumentError: empty or oversized batch; a duplicate seq_id; no tokens; a
            token outside the vocabulary; positions negative or not consecutive; a block
            table too short for the positions; a block id outside the pool; two tokens
            writing one slot; a copy naming a block outside the pool; bad sampling values.
    """
    seqs = request.sequences
    bs, vocab = block_size, vocab_size
    if not seqs:
        raise InvalidArgumentError("Step: the batch is empty; send at least one sequence")
    if len(seqs) > MAX_STEP_SEQUENCES:
        raise InvalidArgumentError(f"Step: {len(seqs)} sequences is more than {MAX_STEP_SEQUENCES} per step")
    seen: set[int] = set()
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    lens, seq_lens, tables, params, out_idx = [], [], [], [], []
    for i, s in enumerate(seqs):
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
        if p0 < 0 or s.positions[-1] != p0 + n - 1 or (n > 1 and list(s.positions) != list(range(p0, p0 + n))):
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
        if table and max(table) >= num_blocks:
            raise InvalidArgumentError(f"{where}: block id {max(table)} is outside the pool (0..{num_blocks - 1})")
        for p in range(p0, p0 + n):
            slots.append(table[p // bs] * bs + p % bs)
        tokens.extend(s.token_ids)
        positions.extend(s.positions)
        lens.append(n)
        seq_lens.append(p0 + n)
        tables.append(table[:need])
        if not s.skip_sampling:
            if s.output_index < 0:
                raise InvalidArgumentError(f"{where}: output_index must be >= 0")
            params.append(sampling_from_proto(s.sampling, where))
            out_idx.append(i)
    if len(tokens) > MAX_STEP_TOKENS:
        raise InvalidArgumentError(f"Step: {len(tokens)} tokens is more than {MAX_STEP_TOKENS} per step; chunk the prefill")
    if len(set(slots)) != len(slots):
        raise InvalidArgumentError("Step: two tokens of the batch map to the same KV slot; block tables overlap")
    for c in request.copies:
        if c.src >= num_blocks or c.dst >= num_blocks or c.src == c.dst:
            raise InvalidArgumentError(
                f"Step: copy ({c.src} -> {c.dst}) must name two different blocks inside the pool (0..{num_blocks - 1})")
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    torch.cumsum(lens_t, 0, out=qsl[1:])
    logits_indices = (qsl[1:].to(torch.int64) - 1)[torch.tensor(out_idx, dtype=torch.int64)]
    copies = torch.tensor([[c.src, c.dst] for c in request.copies], dtype=torch.int64).view(-1, 2)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return StepInputs(
        token_ids=torch.tensor(tokens, dtype=torch.int64).to(device),
        positions=torch.tensor(positions, dtype=torch.int64).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        block_tables=block_tables.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens_t.to(device),
        host_query_start_loc=qsl,
        host_seq_lens=seq_lens_t,
        logits_indices=logits_indices.to(device),
        block_copies=copies.to(device),
        sample_rows=out_idx,
        sampling=params,
    )
