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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from client.request import Seq

#: transformers' score of an impossible beam.
NEG = -1.0e9


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
                can_add = rank < self.num_beams and self.improvement_possible and not (full_before and self.early_stopping)
                if can_add:
                    norm = score / (gen_len ** self.length_penalty)
                    self.finished.append(Hypothesis([*beams[i].generated, tok], norm, score))
            elif len(running) < self.num_beams:
                running.append((beams[i], tok, score))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.num_beams:]
        # Early-stop heuristic (transformers' _check_early_stop_heuristic; best hypothetical
        # length = current generated length for early_stopping in (True, False)).
        best_running = running[0][2] if running else NEG
        if len(self.finished) >= self.num_beams:
            worst = min(h.score for h in self.finished)
            self.improvement_possible = self.improvement_possible and best_running / (gen_len ** self.length_penalty) > worst
        all_finished = len(self.finished) >= self.num_beams and self.early_stopping
        if not self.improvement_possible or all_finished or hits_all or not running:
            self.done = True
            return []
        return running

    def best(self, n: int = 1) -> list[Hypothesis]:
        """The n best finished hypotheses."""
        return self.finished[:n]
