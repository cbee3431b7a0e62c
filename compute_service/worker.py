"""One batched model step over the mapped pool: validate, copy, forward, sample.

The worker is stateless between steps apart from its mapped pool and its model
(DESIGN.md; vLLM's scheduler-output / worker split). Per step it turns the request
into the model's packed inputs (`compute_service.step_inputs`: validation, slot
mapping, block tables), checks the grants (`compute_service.grant_check`), does every
copy of the step's grants in the order DESIGN.md's "Tiers and transfers" fixes
(offloads device -> host tier, reloads host tier -> device, with
``kernels.copy_blocks_between``, and node transfers in, read over NIXL from another
node's pool by ``compute_service.transfer_agent``; then copy-on-write,
``kernels.copy_blocks``), runs
the packed batch (prefill chunks and decode tokens together) through the model,
which writes K/V into the slots and runs paged attention, and samples one token per
sequence on the worker (the step's token bitmask, min_tokens and logit_bias first:
``compute_service.logits_processors``; then penalties, from the token history the step carries:
``compute_service.penalties``). Logits never leave it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn

import kernels
from compute_service.device_sync import StepFence, bind_compute_thread, is_fatal_device_error
from compute_service.disk_copier import DiskCopier
from compute_service.grant_check import CopyPlan, check_grants, sign_receipts
from compute_service.metrics import WorkerMetrics
from compute_service.model.decode_graphs import DecodeGraphs
from compute_service.model.llama import LlamaForPagedLM
from compute_service.pool_map import MappedPool
from compute_service.sampling import sample
from compute_service.step_inputs import StepInputs, build_step_inputs
from compute_service.step_upload import StepUpload
from compute_service.timing import AttentionClock
from compute_service.weights.source import ModelConfig
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.runtime import test_hooks
from pagedkv.runtime.errors import (
    PAST_SLIDING_WINDOW,
    POOL_GENERATION_MISMATCH,
    POOL_NOT_MAPPED,
    TRANSFERS_OFF,
    FailedPreconditionError,
    InvalidArgumentError,
    TransferFailedError,
    UnavailableError,
)
from pagedkv.runtime.logs import get_logger
from pagedkv.runtime.service import status_proto

log = get_logger("compute_service")


class Worker:
    """Runs steps of ``model`` over ``pool``. Thread-safe: one step at a time.

    Args:
        model: the decoder, on its device.
        config: its shape.
        pool: the mapped pool, or None until one is mapped.
        model_source: where the model came from (calibrates an fp8 pool's scales).
        max_capture_size: decode steps of up to this many sequences over a CUDA pool run in CUDA
            graphs (compute_service.model.decode_graphs), captured when a pool is mapped; 0: every
            step eager (``--enforce-eager``). A CPU pool is never captured.
    """

    def __init__(self, model: LlamaForPagedLM, config: ModelConfig, pool: MappedPool | None, model_source: str = "",
                 max_capture_size: int = 0):
        self.model = model
        #: Where the model came from ("smollm2", a directory, a .gguf): its tokenizer calibrates fp8 scales.
        self.model_source = model_source
        self.config = config
        self.device = model.device
        self._lock = threading.Lock()
        self.pool = pool
        # Timed on the CPU only (see AttentionClock); a stand-in model (not an nn.Module) is not timed.
        timed = isinstance(model, nn.Module) and self.device.type == "cpu"
        self.attention_clock = AttentionClock(model) if timed else None
        #: Set when the memory service went away during a step: its results are dropped.
        self.pool_lost = threading.Event()
        #: The NIXL agent over the mapped pool (node transfers), or None: steps with node transfers are refused.
        self.transfer_agent = None
        #: Fences each step's device work before its receipts are signed (compute_service.device_sync).
        self.fence = StepFence(self.device)
        #: The step's metadata to the device in one copy (reuses its host buffer: safe behind the fence).
        self.upload = StepUpload(self.device)
        #: Called once with the error when a step meets a sticky device error (the process's CUDA
        #: context is gone): the server reports NOT_SERVING and exits (compute_service.main).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal: BaseException | None = None
        self.max_capture_size = max_capture_size
        #: Decode steps in CUDA graphs over the mapped pool, or None: every step eager.
        self.graphs: DecodeGraphs | None = self._capture(pool)
        #: Disk-tier copies over the mapped pool (compute_service.disk_copier), or None: no disk tier.
        self.disk: DiskCopier | None = _disk_copier(pool)
        #: Step metrics observed once per step (``pagedkv compute --metrics-port``), or None: none kept.
        self.metrics: WorkerMetrics | None = None

    def set_pool(self, pool: MappedPool | None) -> None:
        """Swap the mapped pool (None drops it); waits for an in-flight step."""
        self.pool_lost.set()
        with self._lock:
            self.graphs = None  # they hold the old pool's addresses
            if self.disk is not None:  # waits for a batch of disk copies in flight over the old pool
                self.disk.close()
                self.disk = None
            old, self.pool = self.pool, pool
            if self.transfer_agent is not None:  # it registered the old pool's memory
                self.transfer_agent.close()
                self.transfer_agent = None
            if old is not None:
                old.close()
            self.graphs = self._capture(pool)
            self.disk = _disk_copier(pool)
            self.pool_lost.clear()

    def _capture(self, pool: MappedPool | None) -> DecodeGraphs | None:
        """The decode graphs over ``pool`` (a CUDA pool, graphs on), captured; else None."""
        if pool is None or self.max_capture_size < 1 or not pool.tensor.is_cuda:
            return None
        bind_compute_thread(pool.tensor.device)
        lay = pool.descriptor.layout
        widest = min(-(-self.config.max_position_embeddings // lay.block_size), lay.num_blocks)
        graphs = DecodeGraphs(self.model, pool.tensor, pool.kv_scales, max_size=self.max_capture_size,
                              max_blocks=widest)
        log.info("cuda_graphs_captured", sizes=len(graphs.sizes), largest=graphs.sizes[-1] if graphs.sizes else 0,
                 max_blocks=widest, seconds=round(graphs.capture_all(), 2))
        return graphs

    def step(self, request: pb.StepRequest) -> pb.StepResponse:
        """Run one step.

        A sequence refused alone (outside its grant, `check_grants`; a position at or past the model's
        sliding window, `_past_window`) gets a result whose ``error`` says why, and nothing of it is
        read, written or sampled; the others are computed.

        Raises:
            FailedPreconditionError: no pool mapped, or the request names another generation.
            InvalidArgumentError: a malformed batch (see `build_step_inputs`); nothing is written.
            PermissionDeniedError: a request copy no grant names, or copies that race (`check_grants`);
                nothing is read or written.
            UnavailableError: the device failed (a sticky CUDA error, `device_sync.is_fatal_device_error`),
                in this step or an earlier one; ``on_fatal`` was called once and the process is exiting.
        """
        with self._lock:
            if self.fatal is not None:
                raise UnavailableError(f"this worker's device failed ({self.fatal}); it is exiting: send the step to "
                                       "another worker")
            try:
                return self._step(request)
            except Exception as e:
                if not is_fatal_device_error(e):
                    raise
                self.fatal = e
                if self.on_fatal is not None:
                    self.on_fatal(e)
                raise UnavailableError(f"this worker's device failed during the step ({e}); it is exiting: send the "
                                       "step to another worker") from e

    def _step(self, request: pb.StepRequest) -> pb.StepResponse:
        pool = self.pool
        if pool is None:
            raise FailedPreconditionError(
                "the worker has no pool mapped (the memory service is restarting or gone); retry shortly",
                reason=POOL_NOT_MAPPED)
        if request.pool_generation != pool.generation:
            raise FailedPreconditionError(
                f"the request's pool generation {request.pool_generation} is not the mapped pool's "
                f"{pool.generation}; the memory service restarted: re-read the pool descriptor, "
                "allocate the sequences again and recompute them", reason=POOL_GENERATION_MISMATCH)
        t0 = time.perf_counter()
        bind_compute_thread(pool.tensor.device)  # Triton launches on the thread's current device
        test_hooks.call("worker.step_begin", request=request)
        lay = pool.descriptor.layout
        inputs = build_step_inputs(request, block_size=lay.block_size, num_blocks=lay.num_blocks,
                                   vocab_size=self.config.vocab_size, device=self.device, upload=self.upload)
        checked = check_grants(request, pool.plane_key, pool.generation, pool.epochs,
                               host_epochs=getattr(pool, "host_epochs", None),  # None: no host tier
                               refused=self._past_window(request))
        plan = checked.plan
        test_hooks.call("worker.step_checked", request=request)
        run, kept = request, checked
        if checked.refused:  # computed without them: nothing of theirs is read or written
            run = pb.StepRequest()
            run.CopyFrom(request)
            del run.sequences[:]
            run.sequences.extend(s for i, s in enumerate(request.sequences) if i not in checked.refused)
            kept = [c for c in checked if c is not None]
            if run.sequences:
                inputs = build_step_inputs(run, block_size=lay.block_size, num_blocks=lay.num_blocks,
                                           vocab_size=self.config.vocab_size, device=self.device, upload=self.upload)
        if plan.has_tier_copies or plan.copy_on_write or plan.transfers:
            do_copies(pool, plan, self.transfer_agent)
        fence = self.fence
        fence.begin()
        results = []
        if run.sequences:
            graphs = self.graphs
            if graphs is not None and graphs.applies(inputs.num_tokens, len(run.sequences),
                                                     inputs.block_tables.shape[1]):
                logits = graphs.run(inputs)  # a decode step: its bucket's graph replayed
            else:
                logits = self.model(*inputs.model_args(pool.tensor, pool.kv_scales))
            fence.end()
            if self.pool_lost.is_set():
                raise FailedPreconditionError("the memory service went away during this step; its results are "
                                              "void", reason=POOL_NOT_MAPPED)
            results = self._sample(run, inputs, logits)
        else:
            fence.end()
        # Every copy and write of the step complete before a receipt proves them: the forward and
        # the tier copies (asynchronous DMA) are queued on the stream before the fence's end.
        model_seconds = fence.wait()
        sign_receipts(run, results, pool.plane_key, lay.block_size, kept)
        if checked.refused:
            results = _with_refusals(request, results, checked.refused)
        response = pb.StepResponse(
            results=results,
            model_seconds=model_seconds,
            attention_seconds=self.attention_clock.seconds if self.attention_clock and run.sequences else 0.0,
            step_seconds=time.perf_counter() - t0,
            num_tokens=inputs.num_tokens if run.sequences else 0,
        )
        if self.metrics is not None:
            self.metrics.observe_step(
                step_seconds=response.step_seconds, model_seconds=model_seconds, batch_size=len(run.sequences),
                attention_seconds=response.attention_seconds if self.attention_clock else None,
                num_tokens=response.num_tokens, offloads=len(plan.offloads), reloads=len(plan.reloads),
                transfers=sum(map(len, plan.transfers.values())), copy_on_write=len(plan.copy_on_write))
        test_hooks.call("worker.step_end", request=request, response=response)
        return response

    def _past_window(self, request: pb.StepRequest) -> dict[int, InvalidArgumentError]:
        """The sequences of ``request`` that reach a position at or past the model's sliding window,
        by batch index: refused alone, before any write.

        The model's attention is full causal, which equals the windowed attention of Mistral
        (and of Qwen2 with `use_sliding_window`) exactly while a query's position p < W: it then
        sees positions [0, p], all inside its window (transformers' and vLLM's windows are the
        W positions (p - W, p], the query's own included). From p = W on, keys leave the window.
        """
        window = self.config.sliding_window
        if window is None:
            return {}
        return {i: InvalidArgumentError(
            f"sequence {s.seq_id} reaches position {s.positions[-1]}, past this model's sliding window of {window} "
            f"tokens (positions 0-{window - 1}); sequences of this model may hold at most {window} tokens "
            f"(--max-model-len {window}); nothing of it was written", reason=PAST_SLIDING_WINDOW)
            for i, s in enumerate(request.sequences) if s.positions[-1] >= window}

    def _sample(self, request: pb.StepRequest, inputs: StepInputs, logits: torch.Tensor) -> list[pb.StepResult]:
        """One result per sequence of the batch; a token (and logprobs) for each sampled one.

        logits: [S', vocab] float32, row r for sequence `inputs.sample_rows[r]`.
        """
        seqs = request.sequences
        results = [pb.StepResult(seq_id=s.seq_id) for s in seqs]
        if not inputs.sample_rows:
            return results
        out = sample(logits, inputs.sampling, [seqs[i].output_index for i in inputs.sample_rows], inputs.history,
                     inputs.masks)
        token_ids = out.token_ids.tolist()
        chosen = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for r, i in enumerate(inputs.sample_rows):
            res = results[i]
            res.token_id = token_ids[r]
            k = inputs.sampling[r].logprobs
            if chosen is not None and k is not None:
                res.logprob = chosen[r]
                res.top_logprobs.extend(pb.TokenLogprob(token_id=t, logprob=lp) for t,
                                        lp in zip(top_ids[r][:k], top_lp[r][:k]))
        return results


def _disk_copier(pool: MappedPool | None) -> DiskCopier | None:
    """A copier over ``pool``'s host and disk tiers, or None when it has no disk tier."""
    if pool is None or not pool.descriptor.HasField("disk_tier") or pool.host_tensor is None:
        return None
    return DiskCopier(pool)


def _with_refusals(request: pb.StepRequest, results: list[pb.StepResult],
                   refused: dict[int, Exception]) -> list[pb.StepResult]:
    """The results of every sequence of ``request`` in batch order: the computed ``results`` (of the
    others, in order) and, for each refused one, a result carrying its error (google.rpc.Status)."""
    computed = iter(results)
    out = []
    for i, s in enumerate(request.sequences):
        if i in refused:
            e = refused[i]
            out.append(pb.StepResult(seq_id=s.seq_id, error=status_proto(e.code, e.message, e.reason, e.metadata)))
        else:
            out.append(next(computed))
    return out


def do_copies(pool: MappedPool, plan: CopyPlan, agent=None) -> None:
    """Do a checked step's copies on ``pool``, in order: offloads (``host[h] <- pool[b]``), reloads
    (``pool[b] <- host[h]``), node transfers in (``pool[b] <- another node's block``, read over NIXL
    by ``agent``, a :class:`compute_service.transfer_agent.TransferAgent` over ``pool``),
    copy-on-write (``pool[dst] <- pool[src]``).

    On CUDA everything is queued on the current stream, before the step's kernels (node transfers
    wait for the stream first, and complete before the copies after them are queued).

    Raises:
        ValueError: a tier copy with no host tier mapped (``check_grants`` refuses that first).
        FailedPreconditionError: node transfers on a worker without node transfers on.
        TransferFailedError: a node transfer failed (ABORTED, reason TRANSFER_FAILED); the step's own
            writes and copies-on-write have not run.
    """
    if plan.has_tier_copies:
        if pool.host_tensor is None:
            raise ValueError("the step has host-tier copies but no host tier is mapped")
        kernels.copy_blocks_between(pool.tensor, pool.host_tensor, plan.offloads)
        kernels.copy_blocks_between(pool.host_tensor, pool.tensor, plan.reloads)
    if plan.transfers:
        _transfer_in(pool, plan, agent)
    if plan.copy_on_write:
        kernels.copy_blocks(pool.tensor, torch.tensor(plan.copy_on_write, dtype=torch.int64,
                                                      device=pool.tensor.device))


def _transfer_in(pool: MappedPool, plan: CopyPlan, agent) -> None:
    """Read every node transfer of ``plan`` into ``pool``, source by source (one NIXL request each)."""
    from compute_service.transfer_agent import TransferError, TransferSource

    if agent is None:
        raise FailedPreconditionError("the step reads blocks of another node's pool, and this worker has no NIXL "
                                      "agent (start it with --node-transfers)", reason=TRANSFERS_OFF)
    if pool.tensor.is_cuda:
        torch.cuda.current_stream(pool.tensor.device).synchronize()  # the offloads above read those blocks first
    for digest, pairs in plan.transfers.items():
        s = plan.sources[digest]
        try:
            agent.read_blocks(TransferSource.from_proto(s), pairs)
        except ValueError as e:  # a source no agent can read (malformed, or metadata of another agent)
            raise TransferFailedError(f"the step's transfer source {s.agent_name[:64]!r} cannot be read ({e}); no KV "
                                      "of this step was written: recompute the sequences that read from it",
                                      metadata={"blocks_done": "0", "agent": s.agent_name[:64]}) from e
        except TransferError as e:
            raise TransferFailedError(f"a node transfer from {s.agent_name!r} failed after {e.blocks_done} of "
                                      f"{len(pairs)} blocks ({e}); no KV of this step was written: free the "
                                      "sequences that read from that node and recompute them",
                                      metadata={"blocks_done": str(e.blocks_done), "agent": s.agent_name}) from e
