"""``--tool-call-parser llama3_json``: Llama 3.x's JSON calls, ``{"name": ..., "parameters": {...}}``.

vLLM's ``Llama3JsonToolParser`` (tool_parsers/llama_tool_parser.py, for its
examples/tool_chat_template_llama3.1_json.jinja): the output, optionally after
``<|python_tag|>``, is one call object or several separated by ``;``; the arguments are under
``parameters`` or ``arguments``. Calls are recognised only when the output (after leading
whitespace) starts with the tag or ``{``, as vLLM's stream does, so that the whole-text parse
and the stream agree (vLLM's whole-text parse also finds an object after other text); then
the content is None, and text after the last call (that is not ``;`` and another object) is
ignored, as vLLM's whole-text parse ignores it. A first object that is not a call leaves the
whole output as content.
"""

from __future__ import annotations

from client.serve.tools.call_scanner import call_of
from client.serve.tools.json_stream import WHITESPACE, JsonSyntaxError, raw_decode
from client.serve.tools.parser import CallListStream, ToolParser, ToolStream, register
from client.serve.tools.types import DeltaMessage, ExtractedToolCalls, ToolCall

TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


def _body_start(text: str) -> int | None:
    """Where the first call object starts (after whitespace and the tag), or None for plain text."""
    at = len(text) - len(text.lstrip(WHITESPACE))
    if text.startswith(TAG, at):
        at += len(TAG)
        at += len(text[at:]) - len(text[at:].lstrip(WHITESPACE))
    return at if text.startswith("{", at) else None


@register
class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON calls, separated by ``;``."""

    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        at = _body_start(text)
        if at is None:
            return ExtractedToolCalls(text)
        calls = []
        try:
            while True:
                obj, at = raw_decode(text, at)
                calls.append(ToolCall(*call_of(obj, ARGS_KEYS)))
                rest = text[at:].lstrip(WHITESPACE)
                if not rest.startswith(";") or not rest[1:].lstrip(WHITESPACE).startswith("{"):
                    break  # what follows the calls is not another call: ignored
                at = len(text) - len(rest) + 1
        except JsonSyntaxError:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(None, tuple(calls))

    def stream(self) -> ToolStream:
        return _Llama3Stream()


class _Llama3Stream(CallListStream):
    """Modes: "text" (deciding: calls or plain text?), "call" (inside an object), "next" (after an
    object: whitespace, then ``;`` or the end), "open" (after ``;``: the next object's ``{``)."""

    args_keys = ARGS_KEYS

    def _advance(self, out: DeltaMessage, final: bool) -> None:
        if self._mode == "text":
            head = self._buf.lstrip(WHITESPACE)
            if not final and (not head or TAG.startswith(head) or
                              head.startswith(TAG) and not head[len(TAG):].lstrip(WHITESPACE)):
                return  # not yet known whether calls follow
            at = _body_start(self._buf)
            if at is None:
                self._mode = "plain"
                out.content, self._buf = self._buf, ""
                return
            self._raw, self._buf, self._mode = self._buf[:at], self._buf[at:], "open"
        self._scan(out, final, "a tool call")

    def _other(self, ch: str) -> None:
        if self._mode == "next" and ch == ";":
            self._mode = "open"
        elif self._index >= 0:
            self._mode = "dropped"  # what follows the calls is not another call: ignored
        else:
            raise JsonSyntaxError(f"unexpected {ch!r} before a tool call")

    def _complete(self) -> bool:
        return self._mode in ("next", "dropped") or (self._mode == "open" and self._index >= 0)
