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
(``prompt_token_ids``, ``output_token_ids``), checked here and handed to the sampler as a
`compute_service.penalties.TokenHistory`. Nothing here touches the pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from compute_service.penalties import TokenHistory
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
    history: TokenHistory | None = None  # token ids of the sampled sequences that set a penalty; None: none does

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

    def model_args(self, kv_pool: torch.Tensor, kv_scales=None) -> tuple:
        """Positional arguments of `LlamaForPagedLM.forward` over `kv_pool` (plans the step's
        attention: `attention_plan`), with an fp8 pool's per-layer `kv_scales`."""
        return (
            self.token_ids, self.positions, kv_pool, self.slot_mapping, self.attention_plan(kv_pool),
            self.logits_indices, kv_scales,
        )  # fmt: skip


#: Parsed sampling parameters by their message's bytes (a batch mostly repeats a few settings).
_SAMPLING_CACHE: dict[bytes, SamplingParams] = {}
_SAMPLING_CACHE_SIZE = 1024


def sampling_from_proto(sp: pb.SamplingParams, where: str) -> SamplingParams:
    """Worker-side sampling parameters; unset fields mean greedy / off (penalties: 1, 0, 0).

    Equal messages give one shared instance (cached by their bytes): read it, never change it.

    Raises:
        InvalidArgumentError: a value out of range.
    """
    key = sp.SerializeToString(deterministic=True)
    params = _SAMPLING_CACHE.get(key)
    if params is None:
        params = _sampling_from_proto(sp, where)
        if len(_SAMPLING_CACHE) >= _SAMPLING_CACHE_SIZE:
            _SAMPLING_CACHE.clear()
        _SAMPLING_CACHE[key] = params
    return params


def _sampling_from_proto(sp: pb.SamplingParams, where: str) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=sp.temperature if sp.HasField("temperature") else 0.0,
            top_k=sp.top_k if sp.HasField("top_k") else 0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            seed=sp.seed if sp.HasField("seed") else None,
            logprobs=sp.num_logprobs if sp.HasField("num_logprobs") else None,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
            frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
        )
    except ValueError as e:
        raise InvalidArgumentError(f"{where}: bad sampling parameters: {e}") from e


def token_history(s: pb.StepSequence, params: SamplingParams, vocab_size: int,
                  where: str) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, generated ids), int64, of a sampled sequence whose ``params`` set a penalty.

    The prompt is read only with a repetition penalty (else an empty array). The step must carry
    exactly ``output_index`` generated ids and, with a repetition penalty, a non-empty prompt whose
    length plus ``output_index`` is the sequence's length after the step (its last position + 1):
    the history of exactly the tokens in its KV cache.

    Raises:
        InvalidArgumentError: a history that is missing, of the wrong length, or has an id outside
            [0, vocab_size).
    """
    n_out = len(s.output_token_ids)
    if n_out != s.output_index:
        raise InvalidArgumentError(
            f"{where}: sampling sets a penalty, so output_token_ids must hold the {s.output_index} tokens "
            f"generated so far (output_index); got {n_out}")
    seq_len = s.positions[-1] + 1
    prompt = np.zeros(0, dtype=np.int64)
    if params.repetition_penalty != 1.0:
        n_prompt = len(s.prompt_token_ids)
        if n_prompt == 0 or n_prompt + n_out != seq_len:
            raise InvalidArgumentError(
                f"{where}: sampling sets a repetition penalty, so prompt_token_ids and output_token_ids must "
                f"hold the sequence's {seq_len} tokens (positions 0..{seq_len - 1}); got {n_prompt} + {n_out}")
        prompt = _ints(s.prompt_token_ids, n_prompt)
    elif n_out >= seq_len:
        raise InvalidArgumentError(
            f"{where}: {n_out} generated tokens but the sequence has only {seq_len} tokens after this step")
    output = _ints(s.output_token_ids, n_out)
    for name, ids in (("prompt_token_ids", prompt), ("output_token_ids", output)):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise InvalidArgumentError(f"{where}: {name} must be in [0, {vocab_size}) (the vocabulary)")
    return prompt, output


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
            params = sampling_from_proto(s.sampling, where)
            if params.has_penalties:
                token_history(s, params, vocab, where)
    if len(slots) > MAX_STEP_TOKENS:
        raise InvalidArgumentError(f"Step: {len(slots)} tokens is more than {MAX_STEP_TOKENS} per step; chunk the prefill")
    if len(set(slots)) != len(slots):
        raise InvalidArgumentError("Step: two tokens of the batch map to the same KV slot; block tables overlap")
    for c in request.copies:
        if c.src >= num_blocks or c.dst >= num_blocks or c.src == c.dst:
            raise InvalidArgumentError(
                f"Step: copy ({c.src} -> {c.dst}) must name two different blocks inside the pool (0..{num_blocks - 1})")


def _ints(values, count: int) -> np.ndarray:
    """``count`` ints from an iterable as int64 (raises InvalidArgumentError past int64)."""
    try:
        return np.fromiter(values, dtype=np.int64, count=count)
    except (OverflowError, ValueError) as e:
        raise InvalidArgumentError(f"Step: a value is outside int64: {e}") from e


def build_step_inputs(
    request: pb.StepRequest,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    device: torch.device | str,
) -> StepInputs:
    """Validate the batch of `request` and build the model's packed inputs on `device`.

    One pass over the sequences reads each one's counts; the token ids, positions, block
    tables and slots of the whole batch are then checked and built with numpy at once. On any
    failed check the sequences are walked again one by one (`_first_violation`) to name the
    first violation.

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
            writing one slot; a copy naming a block outside the pool; bad sampling values; a
            penalty without the token history it needs (`token_history`).
    """
    seqs = request.sequences
    bs = block_size
    S = len(seqs)
    if not seqs:
        raise InvalidArgumentError("Step: the batch is empty; send at least one sequence")
    if S > MAX_STEP_SEQUENCES:
        raise InvalidArgumentError(f"Step: {S} sequences is more than {MAX_STEP_SEQUENCES} per step")

    def fail():
        _first_violation(request, bs, num_blocks, vocab_size)
        raise InvalidArgumentError("Step: the batch is malformed")  # not reached: the walk names it

    lens, starts, table_lens, params, out_idx = [], [], [], [], []
    hist_rows, hist_prompt, hist_output = [], [], []
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
                p = sampling_from_proto(s.sampling, f"Step sequence {s.seq_id} (batch index {i})")
                if p.has_penalties:
                    prompt, output = token_history(s, p, vocab_size, "")
                    hist_rows.append(len(params))
                    hist_prompt.append(prompt)
                    hist_output.append(output)
            except InvalidArgumentError:
                fail()  # names the first violation in batch order (this one unless an earlier one)
            params.append(p)
            out_idx.append(i)
    T = sum(lens)
    if T > MAX_STEP_TOKENS or len({s.seq_id for s in seqs}) != S:
        fail()
    lens_np = np.array(lens, dtype=np.int64)
    starts_np = np.array(starts, dtype=np.int64)
    tl_np = np.array(table_lens, dtype=np.int64)
    seq_lens_np = starts_np + lens_np
    need = (seq_lens_np + bs - 1) // bs
    tokens = _ints(itertools.chain.from_iterable(s.token_ids for s in seqs), T)
    if T == S:  # decode: one token each, its position is the start
        positions = starts_np
        token_seq = np.arange(S)
        bad_positions = bool((starts_np < 0).any())
    else:
        token_seq = np.repeat(np.arange(S), lens_np)
        first = np.cumsum(lens_np) - lens_np
        positions = _ints(itertools.chain.from_iterable(s.positions for s in seqs), T)
        expected = starts_np[token_seq] + (np.arange(T) - first[token_seq])
        bad_positions = bool((starts_np < 0).any()) or not np.array_equal(positions, expected)
    if bad_positions or tokens.min() < 0 or tokens.max() >= vocab_size or (tl_np < need).any():
        fail()
    flat = _ints(itertools.chain.from_iterable(s.block_ids for s in seqs), int(tl_np.sum()))
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
    copies = [(c.src, c.dst) for c in request.copies]
    if any(src >= num_blocks or dst >= num_blocks or src == dst for src, dst in copies):
        fail()
    qsl = torch.zeros(S + 1, dtype=torch.int32)
    torch.cumsum(torch.from_numpy(lens_np.astype(np.int32)), 0, out=qsl[1:])
    logits_indices = (qsl[1:].to(torch.int64) - 1)[torch.tensor(out_idx, dtype=torch.int64)]
    seq_lens_t = torch.from_numpy(seq_lens_np.astype(np.int32))
    return StepInputs(
        token_ids=torch.from_numpy(tokens).to(device),
        positions=torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens_t.to(device),
        host_query_start_loc=qsl,
        host_seq_lens=seq_lens_t,
        logits_indices=logits_indices.to(device),
        block_copies=torch.tensor(copies, dtype=torch.int64).view(-1, 2).to(device),
        sample_rows=out_idx,
        sampling=params,
        history=TokenHistory(hist_rows, hist_prompt, hist_output) if hist_rows else None,
    )
