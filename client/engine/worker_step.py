"""One step on the workers: build each worker's StepRequest, send them in parallel, gather the results.

A sequence contributes its tokens to compute (``tokens[num_computed:num_computed + n]``),
their positions, its block table and its sampling parameters (and, when it samples with a
penalty on, its prompt and generated tokens: the worker keeps no history; under structured
output, its grammar's token bitmask: the worker keeps no grammar); the worker samples
only where the step completes what the sequence knows (not mid chunked prefill,
nor at a compute limit before a fork). Copy-on-write pairs from AppendSlots go to
the worker of the sequence that now holds the destination block; they are the only
copies in a StepRequest's ``copies`` (device to device). The tier copies (offloads to
and reloads from the host tier) travel in the sequences' grants, and the worker does
every copy of every grant of its step before it writes. A sequence whose grant reads blocks of
another node's pool (client.engine.transfers) adds that node's transfer source to its worker's request.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from client.engine.failover import is_worker_failure
from client.engine.scheduler import ScheduledSeq
from client.errors import ServiceError, from_status
from client.request import Request, Seq
from client.services import WorkerClient
from pagedkv.compute.v1 import compute_service_pb2 as cpb


def sampling(req: Request, seq: Seq) -> cpb.SamplingParams:
    """The worker's sampling parameters for ``seq``: greedy unless temperature > 0, the draw seed
    ``seed + sample index``, top-K logprobs for beam search (``BeamState.top_k``) or when asked,
    the penalties that are on, min_p, logit_bias, and min_tokens with the ids it suppresses
    (``req.min_tokens_stop_ids``) while ``seq`` has generated fewer than min_tokens tokens.

    Raises:
        ValueError: ``req.params`` not resolved (the engine applies the model's defaults at admission).
    """
    p = req.params
    if not p.resolved:
        raise ValueError(f"request {req.request_id}: sampling parameters without the model's defaults applied "
                         "(SamplingParams.with_defaults, done by Engine.add)")
    out = cpb.SamplingParams()
    if p.use_beam_search:
        out.num_logprobs = req.beam.top_k
        return out
    if p.temperature > 0:
        out.temperature = p.temperature
        if p.top_k:
            out.top_k = p.top_k
        if p.top_p < 1:
            out.top_p = p.top_p
        if p.seed is not None:
            out.seed = p.seed + seq.index
        if p.min_p:
            out.min_p = p.min_p
    if p.logprobs is not None:
        out.num_logprobs = p.logprobs
    if p.repetition_penalty != 1:
        out.repetition_penalty = p.repetition_penalty
    if p.presence_penalty:
        out.presence_penalty = p.presence_penalty
    if p.frequency_penalty:
        out.frequency_penalty = p.frequency_penalty
    if p.logit_bias:
        out.logit_bias.extend(cpb.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias.items())
    if len(seq.generated) < p.min_tokens and req.min_tokens_stop_ids:
        out.min_tokens = p.min_tokens
        out.min_tokens_stop_ids.extend(req.min_tokens_stop_ids)
    return out


def history(req: Request, seq: Seq) -> dict[str, list[int]]:
    """The token history a sampled step of ``seq`` carries when a penalty is on (the worker keeps
    none): ``output_token_ids``, and ``prompt_token_ids`` with a repetition penalty; {} otherwise."""
    p = req.params
    if not p.has_penalties or p.use_beam_search:
        return {}
    out = {"output_token_ids": seq.generated}
    if p.repetition_penalty != 1:
        out["prompt_token_ids"] = seq.tokens[:seq.prompt_len]
    return out


def build_steps(scheduled: list[ScheduledSeq], copies_by_worker: dict[int, list[tuple[int, int]]],
                pool_generation: int) -> dict[int, cpb.StepRequest]:
    """One StepRequest per worker index that runs a scheduled sequence.

    Args:
        scheduled: the step's sequences, each allocated (``seq_id`` set).
        copies_by_worker: worker index -> copy-on-write ``(src, dst)`` device block ids.
        pool_generation: the pool generation the block ids belong to.
    """
    by_worker: dict[int, cpb.StepRequest] = {}
    for x in scheduled:
        req, seq = x.request, x.seq
        step = by_worker.setdefault(req.worker, cpb.StepRequest(pool_generation=pool_generation))
        start = seq.num_computed
        end = start + x.num_new_tokens
        skip = end < len(seq.tokens) or (seq.compute_limit is not None and end >= seq.compute_limit)
        sampled = {} if skip else history(req, seq)
        if not skip and seq.grammar is not None:  # structured output: the tokens its grammar allows next
            sampled["token_bitmask"] = seq.grammar.bitmask()
        step.sequences.append(cpb.StepSequence(
            seq_id=seq.seq_id, token_ids=x.token_ids, positions=range(start, end),
            block_ids=seq.block_table, sampling=sampling(req, seq), output_index=len(seq.generated),
            skip_sampling=skip, grant=seq.grant, **sampled))
        if seq.transfer_source is not None and seq.transfer_source not in step.transfer_sources:
            step.transfer_sources.append(seq.transfer_source)
    for w, copies in copies_by_worker.items():
        by_worker[w].copies.extend(cpb.BlockCopy(src=s, dst=d) for s, d in copies)
    return by_worker


@dataclass(slots=True)
class StepResults:
    """What the workers returned for one step."""

    #: Each scheduled sequence's sampled token (or none, where sampling was skipped), by seq_id.
    by_seq: dict[int, cpb.StepResult]
    #: Seconds in the slowest worker's forward.
    model_seconds: float
    #: Workers whose Step failed as a worker failure (client.engine.failover), by index.
    failed: dict[int, ServiceError] = field(default_factory=dict)
    #: Sequences a worker refused alone (StepResult.error; not in ``by_seq``), by seq_id: their
    #: requests fail, the step's others stand.
    refused: dict[int, ServiceError] = field(default_factory=dict)


class StepRunner:
    """Sends each worker its Step at once, one thread per worker, and waits for all of them."""

    def __init__(self, workers: list[WorkerClient], pool_generation: int):
        self.workers = workers
        self.pool_generation = pool_generation
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(workers)), thread_name_prefix="pagedkv-step")

    def run(self, scheduled: list[ScheduledSeq], copies_by_worker: dict[int, list[tuple[int, int]]]) -> StepResults:
        """Step every worker that runs a scheduled sequence (:func:`build_steps`); a worker that is
        gone or hung (:func:`client.engine.failover.is_worker_failure`) is reported in ``failed``,
        the others' results are kept.

        Raises:
            client.errors.ServiceError: a worker refused its Step (not a worker failure).
        """
        steps = build_steps(scheduled, copies_by_worker, self.pool_generation)
        futures = {w: self._pool.submit(self.workers[w].step, req) for w, req in steps.items()}
        out = StepResults({}, 0.0)
        refused: ServiceError | None = None
        for w, f in futures.items():
            try:
                resp = f.result()
            except ServiceError as e:
                if is_worker_failure(e):
                    out.failed[w] = e
                else:
                    refused = refused or e
                continue
            out.model_seconds = max(out.model_seconds, resp.model_seconds)
            for r in resp.results:
                if r.HasField("error"):
                    out.refused[r.seq_id] = from_status(r.error)
                else:
                    out.by_seq[r.seq_id] = r
        if refused is not None:
            raise refused
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False)
