"""A chat request's ``tools``/``tool_choice``, checked, and what they make of its outputs.

vLLM's rules (vllm/entrypoints/openai/protocol.py ``check_tool_usage``; serving_chat):

- ``tool_choice`` defaults to ``"auto"`` when ``tools`` are given, else ``"none"``; any choice
  but ``"none"`` needs ``tools``; ``"required"`` with an empty ``tools`` is ``"none"``.
- ``"none"``: the tools are rendered into the prompt, the output is plain text.
- ``"auto"``: needs ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (else 400 with
  vLLM's message); the parser splits the output into text and calls.
- ``"required"`` / a named function: the output is constrained by a JSON schema
  (:mod:`.forced`) through ``SamplingParams.structured_outputs``, then read as calls.
- ``finish_reason`` is ``"tool_calls"`` when an ``auto`` or ``required`` output made calls and
  stopped by itself (a ``"length"`` stays ``"length"``); a named function's is the engine's
  (``"stop"``), as OpenAI's. ``parallel_tool_calls: false`` keeps only the first call.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from client.params import SamplingParams
from client.serve.protocol import bad_request
from client.serve.tools.forced import NamedParser, RequiredParser, named_schema, required_schema
from client.serve.tools.parser import ToolParser, ToolStream, get_parser
from client.serve.tools.types import DeltaMessage, ExtractedToolCalls
from client.structured.params import StructuredOutputsParams

#: Most tools one request may declare (OpenAI's limit).
MAX_TOOLS = 128
#: A function name: OpenAI's characters (and ``.``), 1 to 64 of them.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class ToolRequestError(ValueError):
    """A request's tools or tool_choice cannot be served (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolSettings:
    """The server's tool flags (vLLM's names)."""

    #: ``--enable-auto-tool-choice``: ``tool_choice: "auto"`` parses calls out of the text.
    enable_auto_tool_choice: bool = False
    #: ``--tool-call-parser``: the parser ``auto`` uses (client.serve.tools.parser's registry).
    tool_call_parser: str | None = None


def check_tools(tools: Any) -> list[dict]:
    """The request's ``tools`` as given, each checked: ``{"type": "function", "function": {"name",
    "description"?, "parameters"? (an object), "strict"?}}``, names unique.

    Raises:
        ToolRequestError: the first bad entry, named.
    """
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolRequestError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
        if extra := set(tool) - {"type", "function"}:
            raise ToolRequestError(f"{where} has unknown fields {sorted(extra)}", "tools")
        fn = tool["function"]
        if extra := set(fn) - {"name", "description", "parameters", "strict"}:
            raise ToolRequestError(f"{where}.function has unknown fields {sorted(extra)}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', "
                                   f"got {name!r:.80}", "tools")
        if name in names:
            raise ToolRequestError(f"{where}.function.name {name!r} is declared twice", "tools")
        names.add(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolRequestError(f"{where}.function.description must be a string", "tools")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolRequestError(f"{where}.function.strict must be a boolean", "tools")
    return tools


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               settings: ToolSettings) -> ToolPlan | None:
    """What the request's tool fields make of its outputs; None: plain text (no tools, or ``"none"``).

    Raises:
        ToolRequestError: a choice that needs tools without them, an unknown choice or function,
            ``auto`` on a server without ``--enable-auto-tool-choice``/``--tool-call-parser``.
    """
    if tools is not None:
        check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if tool_choice == "required" and tools == []:
        return None  # OpenAI's behaviour, as vLLM's
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "required"):
        raise ToolRequestError(f'Invalid value for `tool_choice`: {tool_choice}! Only named tools, "none", "auto" '
                               'or "required" are supported.', "tool_choice")
    if not tools:
        raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    parallel = parallel_tool_calls is not False
    if tool_choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise ToolRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                   "to be set", "tool_choice")
        return ToolPlan("auto", get_parser(settings.tool_call_parser), None, parallel)
    if tool_choice == "required":
        try:
            schema = required_schema(tools, parallel)
        except ValueError as e:
            raise ToolRequestError(str(e), "tools") from None
        return ToolPlan("required", RequiredParser(), schema, parallel)
    name = _named_function(tool_choice)
    if name not in {t["function"]["name"] for t in tools}:
        raise ToolRequestError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                               "tool_choice")
    return ToolPlan("named", NamedParser(name), named_schema(tools, name), parallel)


def _named_function(tool_choice: Any) -> str:
    """The name of a named ``tool_choice`` (vLLM's messages)."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ToolRequestError(f"Invalid value for `tool_choice`: {tool_choice!r:.80}! {_USAGE}", "tool_choice")
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ToolRequestError(f"Invalid value for `function`: `{function!r:.80}` in `tool_choice`! {_USAGE}",
                               "tool_choice")
    if "name" not in function:
        raise ToolRequestError(f"Expected field `name` in `function` in `tool_choice`! {_USAGE}", "tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ToolRequestError(f"Invalid `name` in `function`: `{name!r:.80}` in `tool_choice`! {_USAGE}",
                               "tool_choice")
    return name


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's outputs become calls: ``mode`` "auto", "required" or "named"."""

    mode: str
    parser: ToolParser
    #: The JSON schema the output is constrained to ("required" and "named"); None for "auto".
    schema: dict | None
    #: False: only the first call is kept (``parallel_tool_calls: false``).
    parallel: bool = True

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the output constrained to :attr:`schema` (unchanged for ``auto``).

        Raises:
            ToolRequestError: the request already constrains its output otherwise (vLLM refuses both).
        """
        if self.schema is None:
            return params
        if params.structured_outputs is not None:
            raise ToolRequestError("You can only either use constraints for structured outputs or tools, not both.",
                                   "tool_choice")
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=self.schema))

    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole output's content and calls."""
        found = self.parser.extract(text)
        if not self.parallel and len(found.tool_calls) > 1:
            return ExtractedToolCalls(found.content, found.tool_calls[:1])
        return found

    def message(self, text: str) -> tuple[dict, bool]:
        """The reply's ``message`` for a whole output, and whether it made calls."""
        found = self.extract(text)
        message: dict = {"role": "assistant", "content": found.content}
        if found.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in found.tool_calls]
        return message, bool(found.tool_calls)

    def stream(self) -> ChoiceStream:
        """A new stream state for one choice."""
        return ChoiceStream(self.parser.stream(), self.parallel)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """The choice's ``finish_reason`` given the engine's ``reason`` and whether it made calls."""
        if reason == "stop" and called and self.mode != "named":
            return "tool_calls"
        return reason


class ChoiceStream:
    """One choice's stream: the parser's deltas, only the first call's when calls are not parallel."""

    __slots__ = ("_stream", "_parallel")

    def __init__(self, stream: ToolStream, parallel: bool):
        self._stream, self._parallel = stream, parallel

    @property
    def called(self) -> bool:
        return self._stream.called

    def feed(self, text: str) -> DeltaMessage:
        return self._keep(self._stream.feed(text))

    def finish(self) -> DeltaMessage:
        return self._keep(self._stream.finish())

    def _keep(self, delta: DeltaMessage) -> DeltaMessage:
        if not self._parallel:
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0]
        return delta


def constrain(plan: ToolPlan, params: list[SamplingParams]) -> list[SamplingParams]:
    """Each prompt's sampling parameters under ``plan`` (:meth:`ToolPlan.constrain`).

    Raises:
        APIError: 400 when the request already constrains its output otherwise.
    """
    try:
        return [plan.constrain(p) for p in params]
    except ToolRequestError as e:
        raise bad_request(str(e), e.param) from None
