"""Stop checks: append a sampled token to a sequence and decide whether the sequence ends.

vLLM's ``StopChecker`` in small. A sequence stops ("stop") on an end-of-sequence
token (unless ``ignore_eos``), on one of ``stop_token_ids`` (kept in the output),
or when its decoded text contains a ``stop`` string (the text is cut before it);
it ends ("length") at ``max_tokens`` generated tokens or at the context limit.
Before ``min_tokens`` generated tokens none of the first three ends it, and a stop string
must end in text decoded after them (vLLM v1's ``check_stop`` and detokenizer). A sequence under
structured output (``seq.grammar``) feeds each token to its matcher and stops ("stop") once its
grammar is complete.

Every generated token goes through the sequence's :class:`~client.detokenizer.Detokenizer`
(constant work per token), which also finds the stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.detokenizer import Detokenizer
from client.params import SamplingParams
from client.request import Seq


def context_limit(max_context: int, sliding_window: int, pool_tokens: int, max_model_len: int | None) -> int:
    """Longest sequence (prompt + generated) a deployment serves, tokens (vLLM's ``max_model_len``).

    The model's context (``max_context``, 0 = unknown), capped by the pool's ``pool_tokens`` and by
    ``max_model_len`` when given. A model with a sliding window (``sliding_window`` > 0 tokens,
    Mistral v0.1) is served within its window only, where attention is exact without windowing:
    the limit defaults to the window (vLLM's ``disable_sliding_window`` caps it the same way).

    Raises:
        ValueError: ``max_model_len`` exceeds the sliding window (the message names the window).
    """
    if sliding_window and max_model_len is not None and max_model_len > sliding_window:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's sliding window of "
                         f"{sliding_window} tokens; attention past the window is not supported: "
                         f"use --max-model-len {sliding_window} or less")
    limits = [max_context or 1 << 30, pool_tokens, max_model_len or 1 << 30]
    if sliding_window:
        limits.append(sliding_window)
    return min(limits)


#: GetModelInfo fields that must agree between the workers of one engine: the prefix cache's
#: model identity (name, source, revision, KV dtype) and what the engine derives from the model.
SAME_MODEL_FIELDS = ("model_name", "model_source", "revision", "dtype", "architecture", "vocab_size",
                     "eos_token_ids", "sliding_window", "max_context")


def same_model(infos: list, addresses: list[str]):
    """The first of ``infos`` (each worker's GetModelInfoResponse) when every worker runs the same
    model; one engine's requests move between its workers and share their KV.

    Raises:
        ValueError: two workers differ in a :data:`SAME_MODEL_FIELDS` field (both named).
    """
    first = infos[0]
    for info, address in zip(infos[1:], addresses[1:]):
        for f in SAME_MODEL_FIELDS:
            a, b = getattr(first, f), getattr(info, f)
            if a != b:
                raise ValueError(
                    f"workers {addresses[0]} and {address} run different models: {f} "
                    f"{list(a) if f == 'eos_token_ids' else a!r} vs {list(b) if f == 'eos_token_ids' else b!r}"
                )
    return first


@dataclass(slots=True)
class StopChecker:
    """Stop conditions that do not depend on the request."""

    #: The model's end-of-sequence token ids.
    eos_ids: set[int]
    #: Longest sequence (prompt + generated), tokens: the model's context capped by the pool.
    max_context: int
    #: A transformers fast tokenizer: each sequence's detokenizer decodes with it.
    tokenizer: object

    def min_tokens_stop_ids(self, params: SamplingParams, vocab_size: int) -> tuple[int, ...]:
        """The ids ``params.min_tokens`` keeps from being drawn (``Request.min_tokens_stop_ids``):
        the end-of-sequence ids and ``stop_token_ids`` below ``vocab_size``, ascending; () without
        min_tokens. An id past the vocabulary is never drawn, so the worker is not sent it."""
        if not params.min_tokens:
            return ()
        return tuple(sorted(t for t in self.eos_ids | set(params.stop_token_ids) if t < vocab_size))

    def append(self, seq: Seq, params: SamplingParams, result) -> None:
        """Append the token of ``result`` (the worker's StepResult: token_id, logprob, top_logprobs)
        to ``seq`` and set ``seq.finish_reason`` / ``stop_reason`` if it ends there."""
        tok = result.token_id
        seq.tokens.append(tok)
        if seq.detok is None:
            seq.detok = Detokenizer(self.tokenizer, params.stop, min_tokens=params.min_tokens)
        stop_string = seq.detok.step(tok)
        if params.logprobs is not None:
            seq.token_logprobs.append(result.logprob)
            seq.top_logprobs.append({t.token_id: t.logprob for t in result.top_logprobs})
        n_gen = len(seq.generated)
        if seq.grammar is not None and not seq.grammar.accept(tok):  # the worker applied its mask: not expected
            seq.finish_reason, seq.stop_reason = "abort", seq.grammar.error
            return
        if n_gen < params.min_tokens:  # before min_tokens only the length ends it (vLLM's check_stop)
            pass
        elif (not params.ignore_eos and tok in self.eos_ids) or tok in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        elif stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif seq.grammar is not None and seq.grammar.done:  # complete: only end-of-sequence could follow
            seq.finish_reason = "stop"
        if seq.finish_reason is None and (n_gen >= params.max_tokens or len(seq.tokens) >= self.max_context):
            seq.finish_reason = "length"
