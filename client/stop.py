"""Stop checks: append a sampled token to a sequence and decide whether the sequence ends.

vLLM's ``StopChecker`` in small. A sequence stops ("stop") on an end-of-sequence
token (unless ``ignore_eos``), on one of ``stop_token_ids`` (kept in the output),
or when its decoded text contains a ``stop`` string (the text is cut before it);
it ends ("length") at ``max_tokens`` generated tokens or at the context limit.

Every generated token goes through the sequence's :class:`~client.detokenizer.Detokenizer`
(constant work per token), which also finds the stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.detokenizer import Detokenizer
from client.params import SamplingParams
from client.request import Seq


@dataclass(slots=True)
class StopChecker:
    """Stop conditions that do not depend on the request."""

    #: The model's end-of-sequence token ids.
    eos_ids: set[int]
    #: Longest sequence (prompt + generated), tokens: the model's context capped by the pool.
    max_context: int
    #: A transformers fast tokenizer: each sequence's detokenizer decodes with it.
    tokenizer: object

    def append(self, seq: Seq, params: SamplingParams, result) -> None:
        """Append the token of ``result`` (the worker's StepResult: token_id, logprob, top_logprobs)
        to ``seq`` and set ``seq.finish_reason`` / ``stop_reason`` if it ends there."""
        tok = result.token_id
        seq.tokens.append(tok)
        if seq.detok is None:
            seq.detok = Detokenizer(self.tokenizer, params.stop)
        stop_string = seq.detok.step(tok)
        if params.logprobs is not None:
            seq.token_logprobs.append(result.logprob)
            seq.top_logprobs.append({t.token_id: t.logprob for t in result.top_logprobs})
        n_gen = len(seq.generated)
        if not params.ignore_eos and tok in self.eos_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif tok in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        if seq.finish_reason is None and (n_gen >= params.max_tokens or len(seq.tokens) >= self.max_context):
            seq.finish_reason = "length"
