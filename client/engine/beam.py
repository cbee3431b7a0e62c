"""Beam search over paged KV: beams share blocks through fork, dropped beams are freed.

Scoring and stopping follow Hugging Face transformers' ``_beam_search``
(generation/utils.py, 2025 rewrite) so that the best beam and its score match
it: per step, every live beam's top-K next tokens (K = 2 * num_beams, from the
worker's log-softmax of the raw logits) are scored ``beam_score + logprob``;
the best K over all beams are walked in order: a candidate that ends (EOS or
the length limit) and sits among the first ``num_beams`` becomes a finished
hypothesis scored ``sum_logprobs / generated_len ** length_penalty``; the best
``num_beams`` that do not end continue. Search stops when ``early_stopping``
is True and num_beams hypotheses are finished, when no running beam can beat
the worst finished one, or at the length limit.

Memory (vLLM paper, section 4.4): a new beam that continues parent p reuses
p's sequence for the first such child and forks p for each other one (the
blocks are shared, refcount + 1; the next append copies a shared partial last
block); a parent no new beam continues is freed.

:class:`Branching` keeps that bookkeeping between steps, for beams and for
parallel sampling (n samples share one prefill of the prompt, then fork): it
records what the last step asked for and turns it into a :class:`ForkPlan`,
the memory-service work of the next step as data (sequences to free, parents
to fork); the engine makes the calls and hands the children back to
:meth:`ForkPlan.apply`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from client.params import SamplingParams
from client.request import Request, Seq

#: transformers' score of an impossible beam.
NEG = -1.0e9


def normalised(score: float, gen_len: int, length_penalty: float) -> float:
    """``score / gen_len ** length_penalty`` in IEEE float64, as transformers' tensors compute it:
    a power past the float range is inf (the score becomes -0.0) and one below it 0 (the score
    becomes -inf), where Python's float power would raise OverflowError or ZeroDivisionError
    (any finite ``length_penalty`` is accepted, as vLLM accepts it)."""
    try:
        denom = float(gen_len) ** length_penalty
    except OverflowError:
        denom = math.inf
    if denom == 0.0:
        return -math.inf if score < 0 else math.inf if score > 0 else math.nan
    return score / denom


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    #: Generated tokens (including the EOS token that ended it, if any).
    tokens: list[int]
    #: Length-normalised score.
    score: float
    #: Sum of token logprobs.
    sum_logprobs: float


@dataclass(slots=True)
class BeamState:
    """Beam search state of one request."""

    num_beams: int
    length_penalty: float
    early_stopping: bool
    max_tokens: int
    eos_ids: set[int]
    finished: list[Hypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False
    #: Top-K candidates of live beams that have run this step: id(seq) -> [(token, logprob)].
    pending: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    @classmethod
    def of(cls, params: SamplingParams, max_tokens: int, eos_ids: set[int]) -> BeamState:
        """The search state of a request with ``params``, generating at most ``max_tokens`` tokens."""
        return cls(params.num_beams, params.length_penalty, params.early_stopping, max_tokens, eos_ids)

    @property
    def top_k(self) -> int:
        """Candidates to request per beam: (1 + number of EOS tokens) * num_beams, at least 2 *."""
        return max(2, 1 + len(self.eos_ids)) * self.num_beams

    def step(self, beams: list[Seq], top: list[list[tuple[int, float]]]) -> list[tuple[Seq, int, float]]:
        """Advance one step.

        Args:
            beams: the live beams (same generated length), best first.
            top: per beam, its top-K (token_id, logprob) pairs.

        Returns:
            The next beams as (parent seq, token, new beam score), best first; empty when done.
        """
        k = self.top_k
        cands = sorted(
            ((b.beam_score + lp, i, tok) for i, b in enumerate(beams) for tok, lp in top[i]),
            key=lambda c: -c[0],
        )[:k]
        gen_len = len(beams[0].generated) + 1  # generated tokens including the candidate
        at_limit = gen_len >= self.max_tokens
        full_before = len(self.finished) >= self.num_beams
        running: list[tuple[Seq, int, float]] = []
        hits_all = True
        for rank, (score, i, tok) in enumerate(cands):
            hit = at_limit or tok in self.eos_ids
            hits_all &= hit
            if hit:
                can_add = (
                    rank < self.num_beams and self.improvement_possible and not (full_before and self.early_stopping)
                )
                if can_add:
                    norm = normalised(score, gen_len, self.length_penalty)
                    self.finished.append(Hypothesis([*beams[i].generated, tok], norm, score))
            elif len(running) < self.num_beams:
                running.append((beams[i], tok, score))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.num_beams :]
        # Early-stop heuristic (transformers' _check_early_stop_heuristic; best hypothetical
        # length = current generated length for early_stopping in (True, False)).
        best_running = running[0][2] if running else NEG
        if len(self.finished) >= self.num_beams:
            worst = min(h.score for h in self.finished)
            self.improvement_possible = (
                self.improvement_possible and normalised(best_running, gen_len, self.length_penalty) > worst
            )
        all_finished = len(self.finished) >= self.num_beams and self.early_stopping
        if not self.improvement_possible or all_finished or hits_all or not running:
            self.done = True
            return []
        return running

    def best(self, n: int = 1) -> list[Hypothesis]:
        """The n best finished hypotheses."""
        return self.finished[:n]


@dataclass(slots=True, eq=False)
class Branch:
    """A sequence to create from ``parent``: a parallel sample, or a beam that branches."""

    #: The request it joins.
    request: Request
    #: The sequence whose tokens (and blocks, when it holds any) it starts from.
    parent: Seq
    #: A beam's next token (the parent's own next token is already appended); None: a parallel sample.
    token: int | None
    #: A beam's score, sum of logprobs (0.0 for a parallel sample).
    score: float
    #: Parallel sample: its index - 1; beam: its rank among the request's new beams.
    slot: int

    def child(self) -> Seq:
        """The new sequence, without blocks."""
        p = self.parent
        if self.token is None:
            grammar = None if p.grammar is None else p.grammar.fork()  # at the fork nothing is generated yet
            return Seq(self.slot + 1, list(p.tokens), p.prompt_len, grammar=grammar)
        return Seq(0, [*p.tokens[:-1], self.token], p.prompt_len, beam_score=self.score)


@dataclass(slots=True)
class ForkPlan:
    """One step's forks as data: free ``drop`` first (FreeSequences, reason ABORTED), then fork
    ``parents`` (ForkSequences) and :meth:`apply` the children's block tables."""

    #: Sequence ids of beams that no new beam continues.
    drop: list[int]
    #: Sequences to create, in order.
    branches: list[Branch]
    #: Per request id, the request and its new beams best first (None where a branch goes until :meth:`apply`).
    new_beams: dict[str, tuple[Request, list[Seq | None]]]

    @property
    def forkable(self) -> list[Branch]:
        """The branches whose parent holds blocks (the others start without any), in order."""
        return [b for b in self.branches if b.parent.seq_id is not None]

    @property
    def parents(self) -> list[int]:
        """Sequence ids to fork: one per :attr:`forkable` branch, same order."""
        return [b.parent.seq_id for b in self.forkable]

    def apply(self, children, grants=()) -> None:
        """Create the branches' sequences.

        Args:
            children: the forked block tables (``seq_id``, ``block_ids``), one per :attr:`parents`
                entry, same order; None where the fork was refused: that branch starts without blocks.
            grants: the children's StepGrants, same order.
        """
        child_of = {id(b): c for b, c in zip(self.forkable, children)}
        grant_of = {id(b): g for b, g in zip(self.forkable, grants)}
        for b in self.branches:
            seq = b.child()
            c = child_of.get(id(b))
            if c is not None:
                seq.seq_id, seq.block_table, seq.num_computed = c.seq_id, list(c.block_ids), b.parent.num_computed
                seq.grant = grant_of.get(id(b))
            if b.token is None:
                b.request.seqs.append(seq)
            else:
                self.new_beams[b.request.request_id][1][b.slot] = seq
        for req, beams in self.new_beams.values():
            req.seqs = beams
        for req in {id(b.request): b.request for b in self.branches}.values():
            for s in req.seqs:
                s.compute_limit = None


class Branching:
    """Forks pending between steps: parallel samples after their shared prefill, branching beams."""

    def __init__(self) -> None:
        #: (request, prefilled sequence, samples to fork from it).
        self._samples: list[tuple[Request, Seq, int]] = []
        #: (request, its next beams as BeamState.step returned them).
        self._beams: list[tuple[Request, list[tuple[Seq, int, float]]]] = []

    def reached_fork(self, req: Request, seq: Seq) -> bool:
        """After a step computed ``seq``: if it reached its compute limit (the prompt less its last
        token), queue the request's other n - 1 samples for the next step's fork; True if so."""
        if seq.compute_limit is None or seq.num_computed < seq.compute_limit:
            return False
        self._samples.append((req, seq, req.params.n - 1))
        return True

    @staticmethod
    def add_candidates(req: Request, seq: Seq, top_logprobs) -> None:
        """Record a beam's top-K next tokens (the worker's ``TokenLogprob`` list: token_id, logprob)."""
        req.beam.pending[id(seq)] = [(t.token_id, t.logprob) for t in top_logprobs]

    def advance(self, req: Request) -> list[int]:
        """Advance ``req``'s beam search once every live beam has its candidates (after a preemption
        they may arrive over several steps); returns the sequence ids to free when the search ends."""
        beam = req.beam
        if beam is None or not beam.pending or len(beam.pending) != len(req.seqs):
            return []
        nxt = beam.step(req.seqs, [beam.pending[id(s)] for s in req.seqs])
        beam.pending.clear()
        if nxt:
            self._beams.append((req, nxt))
            return []
        ids = [s.seq_id for s in req.seqs if s.seq_id is not None]
        for s in req.seqs:
            s.seq_id = None
        return ids

    def plan(self) -> ForkPlan:
        """Turn what is pending into this step's :class:`ForkPlan`.

        A new beam continuing parent p takes p's sequence (appending its token) if it is the
        first to; every other one is a branch; a live beam no new beam continues is dropped.
        """
        branches = [Branch(req, parent, None, 0.0, i) for req, parent, copies in self._samples for i in range(copies)]
        self._samples = []
        drop: list[int] = []
        new_beams: dict[str, tuple[Request, list[Seq | None]]] = {}
        for req, nxt in self._beams:
            used: set[int] = set()
            beams: list[Seq | None] = []
            for parent, tok, score in nxt:
                if id(parent) not in used:  # the first child continues in the parent's sequence
                    used.add(id(parent))
                    parent.tokens.append(tok)
                    parent.beam_score = score
                    beams.append(parent)
                else:  # every other child forks it
                    branches.append(Branch(req, parent, tok, score, len(beams)))
                    beams.append(None)
            drop.extend(s.seq_id for s in req.seqs if id(s) not in used and s.seq_id is not None)
            new_beams[req.request_id] = (req, beams)
        self._beams = []
        return ForkPlan(drop, branches, new_beams)
