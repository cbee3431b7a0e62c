"""The scheduler's data: its limits (:class:`SchedulerConfig`) and what one step runs
(:class:`SchedulerOutput` of :class:`ScheduledSeq`), shared by the scheduler that plans a step
(client.engine.scheduler) and the engine that executes it (client.engine.core, client.engine.slots).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client.engine.reservation import Paged, ReservationPolicy
from client.request import Request, Seq

#: How a running request is preempted when the pool runs out (vLLM's ``preemption_mode``):
#: "recompute" frees its blocks and computes its tokens again; "swap" moves its KV to the
#: memory service's host tier (SwapOutSequences) and back (SwapInSequences), falling back to
#: recompute when the host tier is off or full.
PREEMPTION_MODES = ("recompute", "swap")


#: The order of the waiting queue (vLLM's ``--scheduling-policy``): "fcfs" by arrival, preempted
#: requests first; "priority" by (request priority, arrival), lower first, and preemption takes the
#: running request with the highest (priority, arrival) (vLLM v1's ``Scheduler._preempt_request``).
SCHEDULING_POLICIES = ("fcfs", "priority")

#: Worker roles (``pagedkv serve --node ...,role=``): run prefills, decodes, or both.
ROLES = ("prefill", "decode", "both")


@dataclass(slots=True)
class SchedulerConfig:
    """Scheduler limits (vLLM's ``SchedulerConfig`` names)."""

    #: Most requests running at once.
    max_num_seqs: int = 64
    #: Token budget of one step (chunked prefill splits prompts to fit it).
    max_num_batched_tokens: int = 512
    #: KV reservation policy (:mod:`client.engine.reservation`); the default reserves nothing (blocks on demand).
    reservation: ReservationPolicy = field(default_factory=Paged)
    #: "recompute" (the default) or "swap" (:data:`PREEMPTION_MODES`).
    preemption_mode: str = "recompute"
    #: "fcfs" (the default) or "priority" (:data:`SCHEDULING_POLICIES`).
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not callable(getattr(self.reservation, "reserve", None)):
            raise ValueError(f"reservation must be a client.engine.reservation policy (e.g. Paged(), OrcaMax(2048)), "
                             f"got {self.reservation!r}")


@dataclass(slots=True, eq=False)
class ScheduledSeq:
    """One sequence in this step's batch."""

    #: The request the sequence belongs to.
    request: Request
    #: The sequence.
    seq: Seq
    #: Tokens to compute: ``seq.tokens[seq.num_computed:seq.num_computed + num_new_tokens]`` (>= 1).
    num_new_tokens: int

    @property
    def token_ids(self) -> list[int]:
        """The tokens to compute, from the sequence's current ``num_computed``."""
        start = self.seq.num_computed
        return self.seq.tokens[start:start + self.num_new_tokens]

    def allocated(self, table, grant=None) -> None:
        """The sequence got its blocks: ``table`` is the memory service's SequenceBlockTable (seq_id,
        block_ids, num_tokens allocated, num_cached_tokens found in the prefix cache), ``grant`` its
        StepGrant; cached tokens count as computed and are not computed again. The request's
        first allocation records its cached tokens (``Request.num_cached_tokens``)."""
        s = self.seq
        if self.request.num_cached_tokens is None:
            self.request.num_cached_tokens = table.num_cached_tokens
        s.seq_id, s.block_table, s.grant = table.seq_id, list(table.block_ids), grant
        s.num_computed = table.num_cached_tokens
        self.num_new_tokens = min(self.num_new_tokens, table.num_tokens - table.num_cached_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs: running requests' sequences first, then the admitted ones'."""

    #: Sequences to compute, in batch order.
    scheduled: list[ScheduledSeq]
    #: Requests admitted from ``waiting`` in this step, in admission order.
    admitted: list[Request]
    #: Of ``admitted``, the swapped-out ones (status SWAPPED, admission order): the engine swaps
    #: them in before it grows or allocates anything.
    swapped: list[Request] = field(default_factory=list)

    def drop(self, request: Request) -> None:
        """Take ``request`` out of this step (it was preempted, unadmitted or failed)."""
        self.scheduled = [x for x in self.scheduled if x.request is not request]
        self.admitted = [r for r in self.admitted if r is not request]
        self.swapped = [r for r in self.swapped if r is not request]


__all__ = ["PREEMPTION_MODES", "ROLES", "ScheduledSeq", "SchedulerConfig", "SchedulerOutput"]
