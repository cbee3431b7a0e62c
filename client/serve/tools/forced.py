"""``tool_choice: "required"`` and a named function: the output is constrained to JSON, then read as calls.

As vLLM (vllm/tool_parsers/utils.py ``get_json_schema_from_tools``; serving_chat's full and
streaming generators):

- ``required``: the output is a JSON array of at least one ``{"name": <one of the tools>,
  "parameters": <that tool's parameters>}`` (each tool's item an ``anyOf`` branch; the tools'
  ``$defs`` hoisted to the top; ``maxItems: 1`` with ``parallel_tool_calls: false``). Each item
  is a call, its arguments the canonical JSON of its ``parameters``.
- a named function ``{"type": "function", "function": {"name": F}}``: the output is F's
  parameters object itself; the call is F with the output text as its arguments, as it came.
"""

from __future__ import annotations

import copy

from client.serve.tools.call_scanner import call_of
from client.serve.tools.json_stream import JsonSyntaxError, loads
from client.serve.tools.parser import CallListStream, ToolParser, ToolStream
from client.serve.tools.types import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta, new_call_id

#: A tool without ``parameters`` takes an empty object (vLLM's default).
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
ARGS_KEYS = ("parameters",)


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema of a ``required`` output: ``[{"name": ..., "parameters": ...}, ...]``, minItems 1
    (and maxItems 1 when calls are not ``parallel``, so the model cannot go on past one call).

    Args:
        tools: validated ``{"type": "function", "function": {"name", "parameters"?}}`` entries.
        parallel: the request's ``parallel_tool_calls`` (unset: true).

    Raises:
        ValueError: two tools define one ``$defs`` name differently (vLLM refuses it too).
    """
    defs: dict[str, object] = {}
    branches = []
    for tool in tools:
        fn = tool["function"]
        params = copy.deepcopy(fn.get("parameters") or EMPTY_PARAMETERS)
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"tool definition {name!r} has multiple schemas, which is not supported")
            defs[name] = schema
        branches.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tools: list[dict], name: str) -> dict:
    """The JSON schema of a named function's output: its ``parameters`` (an empty object's when none)."""
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    return fn.get("parameters") or EMPTY_PARAMETERS


class RequiredParser(ToolParser):
    """Reads the JSON array of a ``required`` output."""

    name = "required"

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            items = loads(text)
            if not isinstance(items, list) or not items:
                raise JsonSyntaxError("a required tool call output is a non-empty JSON array")
            calls = tuple(ToolCall(*call_of(item, ARGS_KEYS)) for item in items)
        except JsonSyntaxError:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(None, calls)

    def stream(self) -> ToolStream:
        return _RequiredStream()


class _RequiredStream(CallListStream):
    """Modes: "text" (before ``[``), "open" (a call object expected), "call", "next" (``,`` or
    ``]``), "end" (only whitespace may follow)."""

    args_keys = ARGS_KEYS

    def _advance(self, out: DeltaMessage, final: bool) -> None:
        self._scan(out, final, "the array of tool calls")

    def _other(self, ch: str) -> None:
        if self._mode == "text" and ch == "[":
            self._mode = "open"
        elif self._mode == "next" and ch in ",]":
            self._mode = "open" if ch == "," else "end"
        else:
            raise JsonSyntaxError(f"unexpected {ch!r} in the array of tool calls")

    def _complete(self) -> bool:
        return self._mode == "end"


class NamedParser(ToolParser):
    """A named function's output: the whole text is that function's arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, (ToolCall(self.function, text),))

    def stream(self) -> ToolStream:
        return _NamedStream(self.function)


class _NamedStream(ToolStream):
    """The first piece announces the call (id, name, the text so far); the rest is arguments as it comes."""

    def __init__(self, function: str):
        super().__init__()
        self._function = function

    def _advance(self, out: DeltaMessage, final: bool) -> None:
        text, self._buf = self._buf, ""
        if not self._calls.ids:
            if not text and not final:
                return
            self._calls.ids.append(new_call_id())
            out.tool_calls.append(ToolCallDelta(0, id=self._calls.ids[0], name=self._function, arguments=text))
        elif text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
