"""Request bodies of the OpenAI API (``/v1/chat/completions``, ``/v1/completions``) and its errors.

The shapes and names follow the OpenAI API reference (``logit_bias`` included) and vLLM's extras
(``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``cache_salt``,
``stop_token_ids``, ``return_tokens_as_token_ids``, ``return_token_ids``; beam search: ``use_beam_search``,
``length_penalty``, ``early_stopping``, client.serve.beam). ``temperature``, ``top_p``,
``top_k`` and ``repetition_penalty`` left unset (or null) take the model's defaults (its
generation_config.json, else vLLM's), as in vLLM. A parameter this server does not implement is
accepted at its neutral value (any ``user``, ``echo: false``, ...) and refused with 400
naming it otherwise; a parameter the API does not have is refused with OpenAI's own message,
"Unrecognized request argument supplied: NAME".
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedkv.runtime.limits import MAX_LOGPROBS

#: Largest request body, bytes (a full 8192-token prompt is ~40 KB of text or ~50 KB of ids).
MAX_BODY_BYTES = 1 << 20
#: Most stop strings per request, and their longest (each generated token is checked against all).
MAX_STOP = 32
MAX_STOP_CHARS = 512


class APIError(Exception):
    """An error in the OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        #: Response headers besides the body's (Retry-After of a 429).
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def check_model(name: str | None, served: str) -> None:
    """Raises APIError 404 (OpenAI's message) when a request names a model other than the served one."""
    if name is not None and name != served:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Parameters both routes share (strict types: ``"5"`` is not an integer, ``true`` not a number)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0 = off
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP)
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Token id (a decimal string, as OpenAI's) -> bias in [-100, 100] added to its logit (:func:`logit_bias`).
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=0, ge=0)
    min_p: float | None = Field(default=0.0, ge=0, le=1)
    # Accepted at their neutral values only (see NEUTRAL).
    user: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: vLLM's beam search (client.serve.beam): n is the beam width and the number of choices.
    use_beam_search: bool = False
    #: Beam score = sum of logprobs / generated length ** length_penalty (beam search only).
    length_penalty: float = 1.0
    #: Beam search ends once n beams are finished (transformers'; beam search only).
    early_stopping: bool = False
    #: Under --scheduling-policy priority: lower runs first (vLLM's); else only 0.
    priority: int | None = Field(default=0, ge=-(2**31), le=2**31 - 1)
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    #: OpenAI's output format, and vLLM's extra (client.serve.structured_request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Tool calling and the chat template's variables: client.serve.tools, client.serve.chat_template.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None


#: Parameters accepted only at their neutral value: name -> (is it neutral?, what is accepted).
NEUTRAL = {
    "skip_special_tokens": (lambda v: v, "true"),
    "spaces_between_special_tokens": (lambda v: v, "true"),
    "include_stop_str_in_output": (lambda v: not v, "false"),
    "store": (lambda v: not v, "false"),
    "add_generation_prompt": (lambda v: v, "true"),
    "echo": (lambda v: not v, "false"),
    "suffix": (lambda v: not v, "none"),
    "continuous_usage_stats": (lambda v: not v, "false"),
}


def parse(model: type[_Sampling], raw: bytes) -> _Sampling:
    """Validate a JSON body as a completion request ``model``: :func:`parse_body`, then the
    parameters accepted only at their neutral value, stream options and stop strings.

    Raises:
        APIError: 413 for a body over :data:`MAX_BODY_BYTES`; 400 naming the first bad parameter
            (OpenAI's message for an unknown one).
    """
    req = parse_body(model, raw)
    for name in req.model_fields_set:
        if name in NEUTRAL and not NEUTRAL[name][0](getattr(req, name)):
            raise bad_request(f"{name}={getattr(req, name)!r} is not supported; only {NEUTRAL[name][1]} is accepted",
                              name)
    if req.stream_options is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if req.stream_options.continuous_usage_stats:
            raise bad_request("stream_options.continuous_usage_stats=true is not supported", "stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if any(len(x) > MAX_STOP_CHARS for x in stops):
        raise bad_request(f"each stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    if isinstance(req, CompletionRequest) and req.best_of not in (None, req.n):
        raise bad_request(f"best_of={req.best_of} is not supported; only best_of equal to n is accepted", "best_of")
    return req


def logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """A request's ``logit_bias`` as token id -> bias (None when empty or unset): each key a token id
    below ``vocab_size`` written in decimal digits, each bias in [-100, 100] (the range OpenAI
    documents).

    Raises:
        APIError: 400 naming logit_bias.
    """
    if not raw:
        return None
    out = {}
    for key, bias in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}) (the vocabulary) written as "
                              f"decimal strings, got {key!r:.40}", "logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}", "logit_bias")
        out[int(key)] = float(bias)
    return out


def parse_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """Validate a JSON body as ``model`` (any request model of the server's routes).

    Raises:
        APIError: 413 for a body over :data:`MAX_BODY_BYTES`; 400 naming the first bad parameter
            (OpenAI's message for an unknown one).
    """
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()  # a lone UTF-16 surrogate (an escaped \ud800) is not text
    except (json.JSONDecodeError, UnicodeError) as e:
        raise bad_request(f"the request body is not valid JSON text: {e}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {'.'.join(loc)}", loc[0]) from None
        if loc[0] == "prompt":
            raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                              "token-id lists", "prompt") from None
        raise bad_request(f"{'.'.join(loc)}: {err['msg']} (got {err.get('input')!r:.80})", loc[0]) from None
    return req


def prompts_of(prompt: str | list) -> list[str | list[int]]:
    """A completion's ``prompt`` as a list of prompts (strings or token-id lists).

    Raises:
        APIError: 400 for an empty prompt or an empty list.
    """
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts
