"""Request and sequence state on the client (vLLM's ``Request`` / ``SequenceGroup`` in small).

A :class:`Request` holds one prompt and its output sequences (n samples or
the live beams). A :class:`Seq` knows its tokens (prompt + generated), how
many of them have KV in the cache (``num_computed``), its memory-service id and
block table. What a step must compute for a sequence is always
``tokens[num_computed:]`` (capped by a chunk budget): a prompt or the rest of
one in chunked prefill, the last sampled token in decode, everything again
after a preemption by recompute. A request preempted by swap (status SWAPPED) keeps its
sequences' ids, block tables and ``num_computed``: its KV waits in the host tier.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from client.params import SamplingParams

_request_ids = itertools.count()


class Status(enum.Enum):
    """Where a request is (vLLM's names): WAITING and SWAPPED requests are in the scheduler's
    ``waiting`` queue, RUNNING ones in ``running``."""

    WAITING = "waiting"
    RUNNING = "running"
    #: Preempted by swap: its sequences live on in the memory service, swapped out to the host
    #: tier (SwapOutSequences), until it is readmitted and swapped in.
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Seq:
    """One output sequence of a request."""

    #: Sample index: the draw seed is params.seed + index.
    index: int
    #: Prompt followed by generated tokens.
    tokens: list[int]
    #: Prompt tokens at the front of ``tokens``.
    prompt_len: int
    #: Memory-service sequence id; None while not allocated (new, or preempted by recompute); kept
    #: while swapped out.
    seq_id: int | None = None
    #: Physical block ids (logical order) as the memory service last reported them.
    block_table: list[int] = field(default_factory=list)
    #: Tokens whose K/V are in the cache.
    num_computed: int = 0
    #: Compute at most this many tokens before the request forks (parallel sampling); None = all.
    compute_limit: int | None = None
    #: Log-probability of each generated token (when asked or for beams).
    token_logprobs: list[float] = field(default_factory=list)
    #: Top log-probabilities per generated token, {token_id: logprob}.
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    #: Beam score (sum of logprobs) for beam search.
    beam_score: float = 0.0
    #: Why it finished ("stop", "length", "abort"); None while running.
    finish_reason: str | None = None
    #: The stop string or token that ended it.
    stop_reason: str | int | None = None
    #: Incremental decoder of the generated tokens (client.detokenizer.Detokenizer), made at
    #: the first token; None for beams, whose text is decoded once at the end.
    detok: object = None
    #: The memory service's latest grant for it (pagedkv.grant.v1.StepGrant: what its next step
    #: may touch), handed to the worker unchanged; None while not allocated.
    grant: object = None
    #: The other node's TransferSource its next step reads blocks from (client.engine.transfers), or None.
    transfer_source: object = None
    #: The sequence's structured-output matcher (client.structured.matcher.GrammarMatcher), None =
    #: unconstrained; a step that samples it sends ``grammar.bitmask()`` (StepSequence.token_bitmask).
    grammar: object = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending(self) -> int:
        """Tokens the next step may compute (0 when waiting for a fork)."""
        end = len(self.tokens) if self.compute_limit is None else self.compute_limit
        return max(0, end - self.num_computed)

    def reset(self) -> None:
        """Forget the cache (preemption by recompute): everything is computed again."""
        self.seq_id = None
        self.block_table = []
        self.num_computed = 0
        self.grant = None


@dataclass(slots=True)
class Metrics:
    """Per-request timings, seconds since the epoch (time.time())."""

    arrival: float = field(default_factory=time.time)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    #: Times this request was preempted (by recompute or by swap).
    preemptions: int = 0
    #: Of ``preemptions``, those by swap (its KV went to the host tier and came back).
    swaps: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot(self, num_tokens: int) -> float | None:
        """Mean time per output token after the first, seconds."""
        if self.finished is None or self.first_token is None or num_tokens < 2:
            return None
        return (self.finished - self.first_token) / (num_tokens - 1)


@dataclass(slots=True, eq=False)
class Request:
    """One prompt being generated."""

    prompt: object
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")
    seqs: list[Seq] = field(default_factory=list)
    status: Status = Status.WAITING
    #: Index of the worker every sequence of this request runs on.
    worker: int | None = None
    metrics: Metrics = field(default_factory=Metrics)
    #: Beam search state (client.engine.beam.BeamState) when params.num_beams > 1.
    beam: object = None
    #: Error that failed the request, if any.
    error: Exception | None = None
    #: Prefix-cache isolation: only requests with equal salts share cached blocks.
    cache_salt: str = ""
    #: Prompt tokens found in the prefix cache at the request's first allocation (the memory
    #: service's ``num_cached_tokens``); None until then. A preempted or recovered request keeps
    #: its first figure: it is what the request was served from the cache, as vLLM reports it.
    num_cached_tokens: int | None = None
    #: A request whose node transfer failed, or whose ticket was refused, computes everything here
    #: from then on (client.engine.transfers).
    no_pull: bool = False
    #: Scheduling priority under the "priority" policy (vLLM's): lower runs first; 0 by default.
    priority: int = 0
    #: The token ids ``params.min_tokens`` keeps from being drawn: the model's end-of-sequence ids and
    #: ``params.stop_token_ids`` inside the vocabulary (vLLM's all_stop_token_ids); set by Engine.add.
    min_tokens_stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.seqs:
            p = self.params
            prompt = list(self.prompt_token_ids)
            fork_later = p.n > 1 and not p.use_beam_search and len(prompt) > 1
            if fork_later:
                # Parallel sampling: prefill all but the last prompt token once, then fork n ways.
                self.seqs = [Seq(0, prompt, len(prompt), compute_limit=len(prompt) - 1)]
            elif p.use_beam_search:
                self.seqs = [Seq(0, prompt, len(prompt))]
            else:
                self.seqs = [Seq(i, list(prompt), len(prompt)) for i in range(p.n)]

    def live_seqs(self) -> list[Seq]:
        return [s for s in self.seqs if not s.finished]

    def seq_ids(self) -> list[int]:
        """Memory-service ids of the sequences that hold blocks (swapped-out ones included)."""
        return [s.seq_id for s in self.seqs if s.seq_id is not None]

    def abort(self) -> None:
        """End as cancelled (the caller freed :meth:`seq_ids`): live sequences finish with "abort"."""
        for s in self.seqs:
            s.seq_id = None
            if not s.finished:
                s.finish_reason = "abort"
        if self.beam is not None:
            self.beam.done = True
        self.status = Status.FINISHED
        self.metrics.finished = time.time()

    def fail(self, error: Exception) -> None:
        """End with ``error`` (the caller freed :meth:`seq_ids`): every sequence forgets its cache."""
        for s in self.seqs:
            s.reset()
        self.error = error
        self.status = Status.FINISHED

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        if self.beam is not None:
            return self.beam.done
        return bool(self.seqs) and all(s.finished for s in self.seqs) and len(self.seqs) >= self.params.n
