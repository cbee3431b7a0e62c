"""The OpenAI request's output constraint: ``response_format`` and vLLM's ``structured_outputs`` extra.

``response_format`` is OpenAI's: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` or
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.
``structured_outputs`` is vLLM's (vllm/sampling_params.py ``StructuredOutputsParams``): exactly one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object``. Both become one
:class:`client.structured.StructuredOutputsParams`; compiling it is the engine's
(``GrammarCompiler``), which the route runs in a thread so that the event loop never waits on it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.serve.protocol import bad_request
from client.structured.params import MAX_CHOICES, StructuredOutputsParams


class _JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _StructuredOutputs(BaseModel):
    """vLLM's extra; its whitespace and fallback options are accepted at the values this server implements."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None


def structured_outputs_of(response_format: dict | None,
                          structured_outputs: dict | None) -> StructuredOutputsParams | None:
    """The request's constraint, or None for free text.

    Raises:
        APIError: 400 naming ``response_format`` or ``structured_outputs``: both set, an unknown
            type or key, a json_schema without a schema, not exactly one constraint.
    """
    if response_format is not None and structured_outputs is not None and response_format.get("type") != "text":
        raise bad_request("set either response_format or structured_outputs, not both", "response_format")
    if structured_outputs is not None:
        return _from_extra(structured_outputs)
    if response_format is None:
        return None
    kind = response_format.get("type")
    rest = {k: v for k, v in response_format.items() if k != "type"}
    if kind == "text" and not rest:
        return None
    if kind == "json_object" and not rest:
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema" and set(rest) == {"json_schema"}:
        try:
            spec = _JsonSchema.model_validate(rest["json_schema"])
        except ValidationError as e:
            raise bad_request(f"response_format.json_schema: {_first(e)}", "response_format") from None
        if spec.json_schema is None:
            raise bad_request("response_format.json_schema.schema is required (the JSON schema to follow)",
                              "response_format")
        return _params("response_format", json=spec.json_schema)
    raise bad_request("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                      "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': ...}}; "
                      f"got {response_format!r:.120}", "response_format")


def _from_extra(raw: dict) -> StructuredOutputsParams:
    try:
        so = _StructuredOutputs.model_validate(raw)
    except ValidationError as e:
        raise bad_request(f"structured_outputs: {_first(e)}", "structured_outputs") from None
    if so.disable_fallback is False or so.disable_additional_properties:
        raise bad_request("structured_outputs: only disable_fallback true (one grammar engine, no fallback) and "
                          "disable_additional_properties false are supported", "structured_outputs")
    return _params("structured_outputs", json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                   json_object=so.json_object or None)


def _params(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def _first(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "extra_forbidden":
        return f"unknown field {loc}"
    return f"{loc}: {err['msg']}"
