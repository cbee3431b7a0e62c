"""What a tool parser returns: whole-text calls and stream deltas, in the OpenAI API's shapes.

vLLM's ``ToolCall``/``FunctionCall``, ``ExtractedToolCallInformation`` and ``DeltaMessage``/
``DeltaToolCall`` (vllm/entrypoints/openai/protocol.py), as small dataclasses that render
themselves as the reply's JSON.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    """A tool call's id, ``call_`` and 24 random hex digits (OpenAI's shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made."""

    #: The function's name.
    name: str
    #: Its arguments as JSON text (``json.dumps`` of the object the model wrote, ``ensure_ascii=False``).
    arguments: str
    #: ``call_...``.
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A whole output split into text and calls: ``content`` is None when nothing but calls was said."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call ``index`` in a stream: the first piece of a call carries its id and name,
    later pieces fragments of its arguments, whose concatenation is the call's ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict:
        """vLLM's ``DeltaToolCall``: ``{"index", "id", "type", "function": {"name", "arguments"}}``
        with only the fields this piece has."""
        function = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}
        out: dict = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        out["function"] = function
        return out


@dataclass(slots=True)
class DeltaMessage:
    """What one stream step adds to a choice: text and pieces of calls (either may be empty)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: DeltaMessage) -> None:
        """Append ``other``'s text and call pieces to this one."""
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)
