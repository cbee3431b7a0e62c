"""One batched model step over the mapped pool: validate, copy-on-write, forward, sample.

The worker is stateless between steps apart from its mapped pool and its model
(DESIGN.md; vLLM's scheduler-output / worker split): every ``StepRequest``
carries each sequence's new tokens, their positions, its block table and its
sampling parameters. From those the worker derives, per new token at position
``p`` of a sequence with block table ``bt``::

    slot = bt[p // block_size] * block_size + p % block_size        (int64)

then does the request's copy-on-write copies (``kernels.copy_blocks``), runs
the packed batch (prefill chunks and decode tokens together) through the model,
which writes K/V into the slots and runs paged attention, and samples one token
per sequence on the worker. Logits never leave it.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

import kernels
from compute_service.model import LlamaForPagedLM
from compute_service.pool_map import MappedPool
from compute_service.sampling import SamplingParams, sample
from compute_service.timing import AttentionClock
from compute_service.weights import ModelConfig
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.errors import FailedPreconditionError, InvalidArgumentError

#: Most new tokens one step may carry (prefill chunks + decode tokens).
MAX_STEP_TOKENS = 65_536
#: Most sequences one step may carry.
MAX_STEP_SEQUENCES = 4_096


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


class Worker:
    """Runs steps of ``model`` over ``pool``. Thread-safe: one step at a time.

    Args:
        model: the decoder, on its device.
        config: its shape.
        pool: the mapped pool, or None until one is mapped.
    """

    def __init__(self, model: LlamaForPagedLM, config: ModelConfig, pool: MappedPool | None):
        self.model = model
        self.config = config
        self.device = model.device
        self._lock = threading.Lock()
        self.pool = pool
        # A stand-in model (not an nn.Module) is not timed: its attention_seconds is 0.
        self.attention_clock = AttentionClock(model) if isinstance(model, nn.Module) else None
        #: Set when the memory service went away during a step: its results are dropped.
        self.pool_lost = threading.Event()

    def set_pool(self, pool: MappedPool | None) -> None:
        """Swap the mapped pool (None drops it); waits for an in-flight step."""
        self.pool_lost.set()
        with self._lock:
            old, self.pool = self.pool, pool
            if old is not None:
                old.close()
            self.pool_lost.clear()

    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        """Run one step.

        Raises:
            FailedPreconditionError: no pool mapped, or the request names another generation.
            InvalidArgumentError: a malformed batch (see :meth:`_prepare`); nothing is written.
        """
        with self._lock:
            pool = self.pool
            if pool is None:
                raise FailedPreconditionError(
                    "the worker has no pool mapped (the memory service is restarting or gone); retry shortly")
            if request.pool_generation != pool.generation:
                raise FailedPreconditionError(
                    f"the request's pool generation {request.pool_generation} is not the mapped pool's "
                    f"{pool.generation}; the memory service restarted: re-read the pool descriptor, "
                    "allocate the sequences again and recompute them")
            t0 = time.perf_counter()
            batch = self._prepare(request, pool)
            if request.copies:
                pairs = torch.tensor([[c.src, c.dst] for c in request.copies], dtype=torch.int64, device=self.device)
                kernels.copy_blocks(pool.tensor, pairs)
            t1 = time.perf_counter()
            logits = self.model(
                batch["input_ids"], batch["positions"], pool.tensor, batch["slot_mapping"], batch["block_tables"],
                batch["query_start_loc"], batch["seq_lens"], batch["logits_indices"],
            )
            t2 = time.perf_counter()
            if self.pool_lost.is_set():
                raise FailedPreconditionError("the memory service went away during this step; its results are void")
            results = self._sample(request, batch, logits)
            return pb.StepResponse(
                results=results,
                model_seconds=t2 - t1,
                attention_seconds=self.attention_clock.seconds if self.attention_clock else 0.0,
                step_seconds=time.perf_counter() - t0,
                num_tokens=int(batch["input_ids"].shape[0]),
            )

    def _prepare(self, request: pb.StepRequest, pool: MappedPool) -> dict:
        """Validate the batch and build the model's packed inputs.

        Raises:
            InvalidArgumentError: empty or oversized batch; a duplicate seq_id; no tokens; a
                token outside the vocabulary; positions negative or not consecutive; a block
                table too short for the positions; a block id outside the pool; two tokens
                writing one slot; a copy naming a block outside the pool; bad sampling values.
        """
        seqs = request.sequences
        lay = pool.descriptor.layout
        bs, num_blocks, vocab = lay.block_size, lay.num_blocks, self.config.vocab_size
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
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(lens_t, 0, out=qsl[1:])
        logits_indices = (qsl[1:].to(torch.int64) - 1)[torch.tensor(out_idx, dtype=torch.int64)]
        return {
            "input_ids": torch.tensor(tokens, dtype=torch.int64).to(dev),
            "positions": torch.tensor(positions, dtype=torch.int64).to(dev),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64).to(dev),
            "block_tables": block_tables.to(dev),
            "query_start_loc": qsl.to(dev),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            "logits_indices": logits_indices.to(dev),
            "params": params,
            "out_idx": out_idx,
        }

    def _sample(self, request: pb.StepRequest, batch: dict, logits: torch.Tensor) -> list[pb.StepResult]:
        seqs = request.sequences
        results = [pb.StepResult(seq_id=s.seq_id) for s in seqs]
        if not batch["out_idx"]:
            return results
        out = sample(logits, batch["params"], [seqs[i].output_index for i in batch["out_idx"]])
        token_ids = out.token_ids.tolist()
        chosen = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for r, i in enumerate(batch["out_idx"]):
            res = results[i]
            res.token_id = token_ids[r]
            k = batch["params"][r].logprobs
            if chosen is not None and k is not None:
                res.logprob = chosen[r]
                res.top_logprobs.extend(pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(top_ids[r][:k], top_lp[r][:k]))
        return results

