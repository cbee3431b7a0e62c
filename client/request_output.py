"""What a request's outputs look like to a caller: :class:`RequestOutput` (cumulative, one per
update) of :class:`CompletionOutput` (one per sample or beam), built from the engine's request."""

from __future__ import annotations

from dataclasses import dataclass, field

from client.request import Request, Status
from client.tokenizer import Messages

Prompt = str | Messages | list[int]


@dataclass(slots=True)
class CompletionOutput:
    """One output sequence (a sample, or a beam)."""

    #: Sample index (beam rank for beam search).
    index: int
    #: Decoded text (special tokens skipped; cut before a stop string). While the sequence
    #: runs, the last ``max(len(stop)) - 1`` characters are held back (client.detokenizer).
    text: str
    #: Generated token ids.
    token_ids: list[int]
    #: "stop", "length", "abort", or None while running.
    finish_reason: str | None
    #: The stop string or token id that ended it.
    stop_reason: str | int | None = None
    #: Sum of the chosen tokens' logprobs (when logprobs were asked, or the beam's sum).
    cumulative_logprob: float | None = None
    #: Per token, {token_id: logprob} of the top alternatives (when asked).
    logprobs: list[dict[int, float]] | None = None
    #: Beam search: length-normalised score (transformers' sequences_scores).
    score: float | None = None
    #: Per token, the chosen token's logprob (when asked).
    token_logprobs: list[float] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs so far (cumulative) and, once finished, its timings."""

    request_id: str
    prompt: Prompt
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    #: Seconds: ttft (time to first token), tpot (mean per output token), e2e; preemptions (by
    #: recompute or swap) and swaps (those by swap).
    metrics: dict = field(default_factory=dict)
    #: Prompt tokens served from the prefix cache (vLLM's ``num_cached_tokens``); None before the
    #: request got its blocks.
    num_cached_tokens: int | None = None


def build_output(req: Request, tokenizer) -> RequestOutput:
    """Snapshot ``req`` as a :class:`RequestOutput` (called on the engine thread)."""
    def text_of(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True)

    outs: list[CompletionOutput] = []
    if req.beam is not None and req.beam.done:
        for rank, h in enumerate(req.beam.best(req.params.n)):
            outs.append(CompletionOutput(rank, text_of(h.tokens), h.tokens,
                                         "stop" if h.tokens and h.tokens[-1] in req.beam.eos_ids else "length",
                                         cumulative_logprob=h.sum_logprobs, score=h.score))
    else:
        for s in sorted(req.seqs, key=lambda s: (s.index, -s.beam_score)):
            gen = s.generated
            text = s.detok.visible(s.finished) if s.detok is not None else text_of(gen)
            lp = sum(s.token_logprobs) if s.token_logprobs else None
            asked = req.params.logprobs is not None
            outs.append(CompletionOutput(s.index, text, list(gen), s.finish_reason, s.stop_reason, lp,
                                         list(s.top_logprobs) if asked else None,
                                         token_logprobs=list(s.token_logprobs) if asked else None))
    m = req.metrics
    n_tokens = max((len(o.token_ids) for o in outs), default=0)
    metrics = {"ttft": m.ttft, "tpot": m.tpot(n_tokens), "preemptions": m.preemptions, "swaps": m.swaps,
               "e2e": None if m.finished is None else m.finished - m.arrival}
    return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), outs,
                         req.status == Status.FINISHED, metrics, req.num_cached_tokens)


__all__ = ["CompletionOutput", "Prompt", "RequestOutput", "build_output"]
