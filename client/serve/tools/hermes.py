"""``--tool-call-parser hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes 2 Pro, Qwen 2.5/3 and the shipped tool template
(client/serve/tools/tool_chat_template_hermes.jinja). vLLM's ``Hermes2ProToolParser``
(tool_parsers/hermes_tool_parser.py): the body of each ``<tool_call>...</tool_call>`` (or of a
last ``<tool_call>`` left open to the end) is one JSON object; the content is the text before the
first ``<tool_call>`` (None when empty), text after or between calls is dropped; if any body is
not a call object the whole output is content and there are no calls.
"""

from __future__ import annotations

from client.serve.tools.call_scanner import CallScanner, call_of
from client.serve.tools.json_stream import WHITESPACE, JsonSyntaxError, loads
from client.serve.tools.parser import ToolParser, ToolStream, held_prefix, register
from client.serve.tools.types import DeltaMessage, ExtractedToolCalls, ToolCall

START, END = "<tool_call>", "</tool_call>"
ARGS_KEYS = ("arguments",)


@register
class HermesToolParser(ToolParser):
    """Hermes' ``<tool_call>`` JSON calls."""

    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(START)
        if first < 0:
            return ExtractedToolCalls(text)
        calls, at = [], first
        try:
            while at >= 0:
                body_start = at + len(START)
                end = text.find(END, body_start)
                body = text[body_start:] if end < 0 else text[body_start:end]
                calls.append(ToolCall(*call_of(loads(body), ARGS_KEYS)))
                at = -1 if end < 0 else text.find(START, end + len(END))
        except JsonSyntaxError:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(text[:first] or None, tuple(calls))

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    """Modes: "text" (before the first call: content), "call" (inside a body), "between" (after a
    body: text dropped until the next ``<tool_call>``), and the base's "plain"/"dropped"."""

    def __init__(self) -> None:
        super().__init__()
        self._scanner: CallScanner | None = None
        self._index = -1

    def _advance(self, out: DeltaMessage, final: bool) -> None:
        while self._buf or (final and self._mode == "call"):
            if self._mode in ("text", "between"):
                at = self._buf.find(START)
                keep = 0 if at >= 0 or final else held_prefix(self._buf, START)
                settled = self._buf[:at] if at >= 0 else self._buf[:len(self._buf) - keep]
                if self._mode == "text":
                    out.content += settled
                else:
                    self._raw += settled
                if at < 0:
                    self._buf = self._buf[len(settled):]
                    return
                self._raw += START
                self._buf = self._buf[at + len(START):]
                self._mode, self._scanner, self._index = "call", CallScanner(ARGS_KEYS), self._index + 1
            elif self._mode == "call":
                end = self._buf.find(END)
                keep = 0 if end >= 0 or final else held_prefix(self._buf, END)
                body = self._buf[:end] if end >= 0 else self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(body):]
                self._raw += body
                try:
                    for ch in body:
                        if not self._scanner.feed(ch) and ch not in WHITESPACE:
                            raise JsonSyntaxError(f"unexpected {ch!r} after a tool call object")
                    out.tool_calls.extend(self._calls.update(self._index, self._scanner))
                    if end < 0 and not final:
                        return
                    # the body ended (at </tool_call>, or at the end of the output)
                    out.tool_calls.extend(self._calls.close(self._index, self._scanner))
                except JsonSyntaxError:
                    self._malformed(out)
                    return
                if end < 0:
                    return
                self._raw += END
                self._buf = self._buf[len(END):]
                self._mode = "between"
            else:
                return
