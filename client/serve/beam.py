"""vLLM's beam search on the OpenAI routes: ``use_beam_search``, ``length_penalty``, ``early_stopping``.

vLLM (entrypoints/openai/completion/protocol.py ``to_beam_search_params`` and the beam-search
branch of serving.py): ``n`` is the beam width and the number of choices each prompt returns,
best first (index 0 the best); ``best_of``, where sent, must equal ``n`` here as for sampling. A
request maps onto the client's :class:`~client.params.SamplingParams` with ``num_beams = n``
and ``n = n``, ``length_penalty``, ``early_stopping`` and ``ignore_eos``; the search itself
(scores, stopping, blocks shared through fork) is client.engine.beam's, which follows
transformers' ``_beam_search``. ``n = 1`` is transformers' ``num_beams=1``: greedy.

Both routes take it, as in vLLM; ``/v1/completions`` refuses ``stream`` with it (vLLM's refusal),
and chat completions streams the finished beams only (one chunk per choice at the end, as vLLM's
chat does, since beams are ranked only once the search ends).

``temperature``, ``top_p``, ``top_k`` and ``seed`` are accepted and do nothing: the search is
deterministic, as vLLM's is. What vLLM's beam search would ignore but this one cannot honour is
refused with 400 naming the field: ``logprobs``/``top_logprobs`` (no per-token logprobs are kept
for beams), the repetition, presence and frequency penalties, ``min_p``, ``min_tokens``,
``logit_bias``, ``stop`` and ``stop_token_ids``
(beams end at the model's end-of-sequence token or ``max_tokens`` only), structured outputs (a
``"required"`` or named ``tool_choice`` among them), and
``n`` above :data:`MAX_BEAMS`. ``early_stopping`` is not among vLLM 0.32's request fields (it was in
earlier releases; 0.32 ignores it): here it is transformers' (stop once ``n`` beams are finished).
"""

from __future__ import annotations

from client.serve.protocol import APIError, bad_request
from pagedkv.runtime.limits import MAX_LOGPROBS

#: Widest beam (the client's ``num_beams`` limit: each beam asks the worker for 2 x width candidates).
MAX_BEAMS = MAX_LOGPROBS // 2


def check(req, chat: bool, tools=None) -> None:
    """Refuse what cannot combine with ``use_beam_search`` in a parsed request ``req`` (``tools``: a
    chat request's :class:`~client.serve.tools.plan.ToolPlan`, whose ``"required"`` or named
    ``tool_choice`` is a structured output too).

    Raises:
        APIError: 400 naming the first such field (see the module docstring).
    """
    if not chat and req.stream:
        raise _refuse("stream", "Streaming is not currently supported with beam search on /v1/completions "
                                "(nor in vLLM); send stream: false")
    if req.n > MAX_BEAMS:
        raise _refuse("n", f"n={req.n} beams: beam search takes at most {MAX_BEAMS} (n is the beam width)")
    if req.logprobs is not None and req.logprobs is not False:  # completions: an int (0 included); chat: a bool
        raise _refuse("logprobs", "logprobs are not returned with beam search; leave logprobs unset")
    for name, off in (("repetition_penalty", 1), ("presence_penalty", 0), ("frequency_penalty", 0)):
        value = getattr(req, name)
        if value is not None and value != off:
            raise _refuse(name, f"{name}={value} cannot combine with beam search (it takes no penalty); leave it unset")
    for name, off in (("min_p", 0), ("min_tokens", 0)):
        value = getattr(req, name)
        if value is not None and value != off:
            raise _refuse(name, f"{name}={value} cannot combine with beam search; leave it unset")
    if req.logit_bias:
        raise _refuse("logit_bias", "logit_bias cannot combine with beam search; leave it unset")
    if req.stop:
        raise _refuse("stop", "stop strings cannot combine with beam search (beams end at the model's "
                              "end-of-sequence token or max_tokens); leave stop unset")
    if req.stop_token_ids:
        raise _refuse("stop_token_ids", "stop_token_ids cannot combine with beam search (beams end at the "
                                        "model's end-of-sequence token or max_tokens); leave them unset")
    if req.structured_outputs is not None:
        raise _refuse("structured_outputs", "structured outputs cannot combine with beam search")
    if req.response_format not in (None, {"type": "text"}):
        raise _refuse("response_format", "a response_format other than text cannot combine with beam search")
    if tools is not None and tools.schema is not None:
        what = 'tool_choice "required"' if tools.mode == "required" else "a named tool_choice"
        raise _refuse("tool_choice", f"{what} constrains the output (a structured output) and cannot combine with "
                                     'beam search; use tool_choice "auto" or "none"')


def fields(req) -> dict:
    """The :class:`~client.params.SamplingParams` fields of beam search request ``req`` (checked by
    :func:`check`): ``n`` beams returning ``n`` choices; ``n = 1`` is greedy."""
    if req.n == 1:
        return dict(num_beams=1, n=1, temperature=0.0, top_p=1.0, top_k=0, seed=None)
    return dict(num_beams=req.n, n=req.n, early_stopping=req.early_stopping)


def _refuse(param: str, message: str) -> APIError:
    return bad_request(f"use_beam_search: {message}", param)
