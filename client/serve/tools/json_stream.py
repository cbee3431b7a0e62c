"""JSON read one character at a time and written again as ``json.dumps`` writes it.

A streamed tool call sends its arguments in fragments whose concatenation must equal the
arguments of the whole-text parse, ``json.dumps(json.loads(raw), ensure_ascii=False)``. vLLM
(tool_parsers/utils.py) re-parses the growing text with a partial-JSON parser and sends the common
prefix of successive dumps; here one scanner reads the raw text once and writes the canonical
form as it goes: ``", "`` and ``": "`` between items, no other whitespace, strings re-escaped as
``json.dumps`` does, each number written once it ends (``1.0``, ``1e2`` -> ``100.0``). What it has
written is never taken back, and when the raw text is valid JSON the whole of it equals the dumps
of :func:`loads`.

:func:`loads` is the whole-text side: ``json.loads`` that refuses what the scanner refuses
(``NaN``/``Infinity`` and a key given twice in one object).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

#: JSON's whitespace (RFC 8259; ``json.loads`` skips exactly these).
WHITESPACE = " \t\n\r"
#: Containers open at once (deeper text is refused as malformed).
MAX_DEPTH = 256
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonSyntaxError(ValueError):
    """The text is not JSON (or is JSON this scanner refuses: NaN, Infinity, a repeated key)."""


def _reject_constant(name: str):
    raise JsonSyntaxError(f"{name} is not JSON")


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise JsonSyntaxError("a key is given twice in one object")
    return out


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_no_repeated_keys)


def loads(text: str) -> object:
    """``json.loads(text)`` without NaN/Infinity or repeated keys (what :class:`JsonStream` refuses).

    Raises:
        JsonSyntaxError: the text is not such JSON (or nests too deeply for ``json``).
    """
    value, end = raw_decode(text, 0)
    if text[end:].strip(WHITESPACE):
        raise JsonSyntaxError(f"extra text after the JSON value at character {end}")
    return value


def raw_decode(text: str, start: int) -> tuple[object, int]:
    """One JSON value of ``text`` from ``start`` (whitespace before it skipped): (value, end index).

    Raises:
        JsonSyntaxError: no such JSON value there.
    """
    while start < len(text) and text[start] in WHITESPACE:
        start += 1
    try:
        return _DECODER.raw_decode(text, start)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise JsonSyntaxError(str(e)) from None


def dumps(value: object) -> str:
    """The canonical text: ``json.dumps(value, ensure_ascii=False)``."""
    return json.dumps(value, ensure_ascii=False)


def _escaped(ch: str) -> str:
    """``ch`` inside a string as ``json.dumps(..., ensure_ascii=False)`` writes it."""
    if ch == '"' or ch == "\\" or ord(ch) < 0x20:
        return json.dumps(ch)[1:-1]
    return ch


@dataclass(slots=True)
class _Frame:
    """An open container: its kind and what comes next in it."""

    #: "{" or "[".
    kind: str
    #: "first" (after the bracket), "key" (after a comma in an object), "colon", "value", "next".
    expect: str
    #: The keys seen so far (objects).
    keys: set[str] = field(default_factory=set)


class JsonStream:
    """Scans ONE JSON value, character by character, and writes its canonical text to :attr:`text`.

    ``feed(ch)`` returns whether ``ch`` was read as part of the value (whitespace before or inside
    it included): False for any character after the value ended, among them the one that ends a
    top-level number (a number ends only when something else follows it; :meth:`finish` ends one
    at the end of the input).
    :attr:`done` turns true once the value is complete.

    Raises (from feed/finish):
        JsonSyntaxError: the text cannot be the start of a JSON value (bad character, a trailing
            comma, a repeated key, NaN, nesting past :data:`MAX_DEPTH`, ...).
    """

    __slots__ = ("text", "done", "_stack", "_lexeme", "_buf", "_escape", "_high", "_key_start")

    def __init__(self) -> None:
        #: The canonical text written so far (a prefix of the value's ``dumps``).
        self.text = ""
        self.done = False
        self._stack: list[_Frame] = []
        #: None between tokens; "str", "key", "num" or "lit" inside one.
        self._lexeme: str | None = None
        #: The raw characters of a number or literal in progress, or of an escape (after the backslash).
        self._buf = ""
        self._escape: str | None = None
        #: A high surrogate from a \\u escape, waiting for the low one that may follow.
        self._high: str | None = None
        self._key_start = 0

    @property
    def started(self) -> bool:
        """Whether the value's first character was read."""
        return bool(self.text or self._lexeme or self.done)

    def feed(self, ch: str) -> bool:
        if self.done:
            return False
        if self._lexeme in ("str", "key"):
            self._string_char(ch)
            return True
        if self._lexeme == "num":
            if ch in _NUMBER_CHARS:
                self._buf += ch
                return True
            self._end_number()
            if self.done:
                return False
        elif self._lexeme == "lit":
            self._buf += ch
            if not any(lit.startswith(self._buf) for lit in _LITERALS):
                raise JsonSyntaxError(f"{self._buf!r} is not true, false or null")
            if self._buf in _LITERALS:
                self._lexeme, self.text = None, self.text + self._buf
                self._value_done()
            return True
        if ch not in WHITESPACE:
            self._token(ch)
        return True

    def finish(self) -> None:
        """The input ended: end a number in progress (at the top level).

        Raises:
            JsonSyntaxError: the value is incomplete.
        """
        if self._lexeme == "num" and not self._stack:
            self._end_number()
        if not self.done:
            raise JsonSyntaxError("the JSON value is incomplete")

    # ------------------------------------------------------------------ tokens
    def _expecting(self) -> str:
        return self._stack[-1].expect if self._stack else ("value" if not self.done else "end")

    def _token(self, ch: str) -> None:
        expect = self._expecting()
        frame = self._stack[-1] if self._stack else None
        if expect == "value" or (expect == "first" and frame.kind == "["):
            if ch == "]" and expect == "first":
                self._close("[")
            else:
                self._start_value(ch)
        elif expect in ("first", "key"):  # in an object
            if ch == '"':
                self._lexeme, self._key_start, self.text = "key", len(self.text), self.text + '"'
            elif ch == "}" and expect == "first":
                self._close("{")
            else:
                raise JsonSyntaxError(f"expected a key string, got {ch!r}")
        elif expect == "colon":
            if ch != ":":
                raise JsonSyntaxError(f"expected ':', got {ch!r}")
            frame.expect, self.text = "value", self.text + ": "
        elif expect == "next":
            if ch == ",":
                frame.expect, self.text = ("key" if frame.kind == "{" else "value"), self.text + ", "
            elif ch in "}]":
                self._close("{" if ch == "}" else "[")
            else:
                raise JsonSyntaxError(f"expected ',' or a closing bracket, got {ch!r}")
        else:
            raise JsonSyntaxError(f"unexpected {ch!r} after the JSON value")

    def _start_value(self, ch: str) -> None:
        if ch in "{[":
            if len(self._stack) >= MAX_DEPTH:
                raise JsonSyntaxError(f"JSON nested deeper than {MAX_DEPTH} containers")
            self._stack.append(_Frame(ch, "first"))
            self.text += ch
        elif ch == '"':
            self._lexeme, self.text = "str", self.text + '"'
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self._lexeme, self._buf = "num", ch
        elif ch in "tfn":
            self._lexeme, self._buf = "lit", ch
        else:
            raise JsonSyntaxError(f"expected a JSON value, got {ch!r}")

    def _close(self, kind: str) -> None:
        frame = self._stack.pop()
        if frame.kind != kind:
            raise JsonSyntaxError(f"a {'}' if frame.kind == '{' else ']'} was expected")
        self.text += "}" if kind == "{" else "]"
        self._value_done()

    def _value_done(self) -> None:
        if self._stack:
            self._stack[-1].expect = "next"
        else:
            self.done = True

    def _end_number(self) -> None:
        raw, self._lexeme = self._buf, None
        if not _NUMBER.fullmatch(raw):
            raise JsonSyntaxError(f"{raw!r} is not a JSON number")
        try:
            self.text += dumps(json.loads(raw))
        except ValueError as e:  # an integer past Python's digit limit
            raise JsonSyntaxError(str(e)) from None
        self._value_done()

    # ----------------------------------------------------------------- strings
    def _string_char(self, ch: str) -> None:
        if self._escape is not None:
            self._escape_char(ch)
        elif ch == "\\":
            self._escape = ""
        elif ch == '"':
            self._flush_high()
            self.text += '"'
            key, self._lexeme = self._lexeme == "key", None
            if key:
                frame = self._stack[-1]
                name = json.loads(self.text[self._key_start:])
                if name in frame.keys:
                    raise JsonSyntaxError(f"the key {name!r} is given twice in one object")
                frame.keys.add(name)
                frame.expect = "colon"
            else:
                self._value_done()
        elif ord(ch) < 0x20:
            raise JsonSyntaxError(f"a raw control character {ch!r} inside a string")
        else:
            self._flush_high()
            self.text += _escaped(ch)

    def _escape_char(self, ch: str) -> None:
        if self._escape == "":
            if ch == "u":
                self._escape = "u"
                return
            if ch not in _ESCAPES:
                raise JsonSyntaxError(f"invalid escape \\{ch}")
            self._escape = None
            self._flush_high()
            self.text += _escaped(_ESCAPES[ch])
            return
        if ch not in _HEX:
            raise JsonSyntaxError(f"invalid \\u escape: {self._escape[1:] + ch!r}")
        self._escape += ch
        if len(self._escape) < 5:
            return
        code, self._escape = int(self._escape[1:], 16), None
        if 0xDC00 <= code <= 0xDFFF and self._high is not None:  # json.loads joins a \\u pair
            high, self._high = self._high, None
            self.text += chr(0x10000 + ((ord(high) - 0xD800) << 10) + (code - 0xDC00))
            return
        self._flush_high()
        if 0xD800 <= code <= 0xDBFF:
            self._high = chr(code)
        else:
            self.text += _escaped(chr(code))

    def _flush_high(self) -> None:
        if self._high is not None:
            self.text, self._high = self.text + self._high, None
