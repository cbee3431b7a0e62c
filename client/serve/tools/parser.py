"""What every tool parser is, and the registry of them by vLLM's names.

vLLM's ``ToolParser`` (vllm/entrypoints/openai/tool_parsers/abstract_tool_parser.py) has two
entry points: ``extract_tool_calls`` over a whole output, and ``extract_tool_calls_streaming``
called with each new piece of text. Here a parser's :meth:`ToolParser.extract` is the first and
:meth:`ToolParser.stream` makes one :class:`ToolStream` per output sequence for the second. The
contract both keep: the content pieces of a stream joined are the whole-text ``content`` ("" for
None), and each call's argument pieces joined are its whole-text ``arguments`` (canonical JSON,
:mod:`.json_stream`), whenever the text is well formed. A stream cannot take back what it sent: a
call whose JSON breaks after its name went out stays in the stream (vLLM's streams keep it
too), while the whole-text parse then gives the whole output as content.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from client.serve.tools.call_scanner import NO_ARGUMENTS, CallScanner
from client.serve.tools.json_stream import WHITESPACE, JsonSyntaxError
from client.serve.tools.types import DeltaMessage, ExtractedToolCalls, ToolCallDelta, new_call_id


class ToolParser(abc.ABC):
    """Splits a model's output into text and function calls (stateless; one per server)."""

    #: The name ``--tool-call-parser`` takes (vLLM's).
    name: ClassVar[str]

    @abc.abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output's content and calls; malformed calls leave the whole text as content."""

    @abc.abstractmethod
    def stream(self) -> ToolStream:
        """A new stream state for one output sequence."""


class CallEmitter:
    """The calls one stream has announced: their ids and how much of each one's arguments went out."""

    __slots__ = ("ids", "_sent")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def update(self, index: int, scanner: CallScanner) -> list[ToolCallDelta]:
        """What call ``index`` has to send now: its id and name (and the arguments read so far)
        once the name is known, then the arguments' new characters."""
        if scanner.name is None:
            return []
        args = scanner.arguments
        if index == len(self.ids):
            self.ids.append(new_call_id())
            self._sent.append(len(args))
            return [ToolCallDelta(index, id=self.ids[index], name=scanner.name, arguments=args or None)]
        new = args[self._sent[index]:]
        if not new:
            return []
        self._sent[index] = len(args)
        return [ToolCallDelta(index, arguments=new)]

    def close(self, index: int, scanner: CallScanner) -> list[ToolCallDelta]:
        """Call ``index``'s object ended: what is left to send (``{}`` for a call without arguments).

        Raises:
            JsonSyntaxError: the object has no name.
        """
        name, args = scanner.result()
        out = self.update(index, scanner)
        if args == NO_ARGUMENTS and not scanner.arguments:
            out.append(ToolCallDelta(index, arguments=NO_ARGUMENTS))
            self._sent[index] = len(NO_ARGUMENTS)
        return out


class ToolStream(abc.ABC):
    """One output sequence's stream parse: :meth:`feed` each new piece of text, then :meth:`finish`.

    Subclasses read :attr:`_buf` in :meth:`_advance`, moving text to the delta they return and
    keeping back only what may still turn out to be markup (a partial ``<tool_call>``).
    """

    def __init__(self) -> None:
        self._buf = ""
        #: Raw text read since the first call began (the content, should that call prove malformed).
        self._raw = ""
        #: "text", "plain" (everything is content), "dropped" (the rest is ignored), or the parser's own.
        self._mode = "text"
        self._calls = CallEmitter()

    @property
    def called(self) -> bool:
        """Whether a call went out."""
        return self._calls.called

    def feed(self, text: str) -> DeltaMessage:
        """The delta for ``text``, the output's next characters."""
        self._buf += text
        return self._step(final=False)

    def finish(self) -> DeltaMessage:
        """The delta of what was kept back, at the end of the output."""
        return self._step(final=True)

    def _step(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        if self._mode == "plain":
            out.content, self._buf = self._buf, ""
        elif self._mode == "dropped":
            self._buf = ""
        else:
            self._advance(out, final)
        return out

    @abc.abstractmethod
    def _advance(self, out: DeltaMessage, final: bool) -> None:
        """Move what :attr:`_buf` settles into ``out``."""

    def _malformed(self, out: DeltaMessage) -> None:
        """A call's JSON broke: before any call went out, the whole text is content (as the
        whole-text parse says); after, the rest is dropped (nothing sent can be taken back)."""
        if self._calls.called:
            self._mode, self._buf = "dropped", ""
        else:
            out.tool_calls.clear()
            out.content += self._raw + self._buf
            self._mode, self._buf, self._raw = "plain", "", ""


class CallListStream(ToolStream):
    """A stream of JSON call objects with separators between them (a JSON array's ``,``, Llama 3's
    ``;``). Modes: "open" (a call's ``{`` expected), "call" (inside one), "next" (after one), and the
    subclass's own, read by :meth:`_other`; :meth:`_complete` says where the output may end.
    Whitespace between the objects is skipped."""

    #: The keys that hold a call's arguments.
    args_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self._scanner: CallScanner | None = None
        self._index = -1

    def _scan(self, out: DeltaMessage, final: bool, inside: str) -> None:
        """Read :attr:`_buf` a character at a time into ``out``; malformed JSON, or an output that
        ends where :meth:`_complete` says it may not ("the output ends inside ``inside``"), goes to
        :meth:`_malformed`."""
        buf, self._buf = self._buf, ""
        try:
            for i, ch in enumerate(buf):
                self._raw += ch
                try:
                    self._read(ch, out)
                except JsonSyntaxError:
                    self._buf = buf[i + 1:]
                    raise
                if self._mode == "dropped":
                    return
            if self._mode == "call":
                out.tool_calls.extend(self._calls.update(self._index, self._scanner))
            if final and not self._complete():
                raise JsonSyntaxError(f"the output ends inside {inside}")
        except JsonSyntaxError:
            self._malformed(out)

    def _read(self, ch: str, out: DeltaMessage) -> None:
        if self._mode == "call":
            self._scanner.feed(ch)
            if self._scanner.done:
                out.tool_calls.extend(self._calls.close(self._index, self._scanner))
                self._mode = "next"
        elif ch in WHITESPACE:
            pass
        elif self._mode == "open" and ch == "{":
            self._scanner, self._index, self._mode = CallScanner(self.args_keys), self._index + 1, "call"
            self._scanner.feed(ch)
        else:
            self._other(ch)

    @abc.abstractmethod
    def _other(self, ch: str) -> None:
        """Read a character outside a call that is neither whitespace nor an expected ``{``.

        Raises:
            JsonSyntaxError: it may not stand there.
        """

    @abc.abstractmethod
    def _complete(self) -> bool:
        """Whether the output may end in the current mode."""


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker`` (kept back in a
    stream: the next piece may complete the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_REGISTRY: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: make ``cls`` available to ``--tool-call-parser cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def parser_names() -> tuple[str, ...]:
    """The names ``--tool-call-parser`` takes."""
    _load()
    return tuple(sorted(_REGISTRY))


def get_parser(name: str) -> ToolParser:
    """The parser registered as ``name``.

    Raises:
        KeyError: no such parser (the message lists the names).
    """
    _load()
    if name not in _REGISTRY:
        raise KeyError(f"invalid tool call parser: {name} (choose from {{ {', '.join(parser_names())} }})")
    return _REGISTRY[name]()


def _load() -> None:
    """Import the parser modules (each registers itself)."""
    from client.serve.tools import hermes, llama3_json  # noqa: F401
