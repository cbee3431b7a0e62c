"""One call object, ``{"name": "f", "arguments": {...}}``, read as it streams.

Every JSON tool format here (Hermes' ``<tool_call>`` bodies, Llama 3's bare objects, the array a
``tool_choice: "required"`` grammar forces) writes each call as such an object; only the key of
the arguments differs (``arguments``, or ``parameters``). :class:`CallScanner` reads the object a
character at a time and tells, as soon as it can, the function's name and the canonical text of
the arguments so far (:mod:`.json_stream`), which is what a stream sends; :func:`call_of` is the
same rule on a whole parsed object.
"""

from __future__ import annotations

from client.serve.tools.json_stream import WHITESPACE, JsonStream, JsonSyntaxError, dumps, loads

#: The arguments of a call that gives none.
NO_ARGUMENTS = "{}"


def call_of(obj: object, args_keys: tuple[str, ...]) -> tuple[str, str]:
    """(name, arguments as canonical JSON text) of a parsed call object.

    Raises:
        JsonSyntaxError: not an object, no string ``name``, or more than one of ``args_keys``.
    """
    if not isinstance(obj, dict):
        raise JsonSyntaxError("a tool call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise JsonSyntaxError("a tool call needs a string name")
    present = [k for k in args_keys if k in obj]
    if len(present) > 1:
        raise JsonSyntaxError(f"a tool call gives both {' and '.join(present)}")
    return name, dumps(obj[present[0]]) if present else NO_ARGUMENTS


class CallScanner:
    """Reads one call object a character at a time (:meth:`feed`); the arguments' value is kept
    under the first of ``args_keys`` it meets, other keys are read and ignored.

    :attr:`name` is set once the name's string has ended, :attr:`arguments` grows with the
    arguments' canonical text, :attr:`done` turns true at the closing brace; then
    :meth:`result` equals :func:`call_of` of the whole object parsed at once.

    Raises (from feed):
        JsonSyntaxError: the text cannot be the start of a call object.
    """

    __slots__ = ("_args_keys", "_expect", "_key", "_value", "_value_key", "_keys", "_args", "name", "done")

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",)):
        self._args_keys = args_keys
        #: "open", "first" (a key or "}"), "key", "colon", "value", "next" (a "," or "}").
        self._expect = "open"
        self._key: JsonStream | None = None
        self._value: JsonStream | None = None
        self._value_key = ""
        self._keys: set[str] = set()
        self._args: JsonStream | None = None
        #: The function's name, once its string has ended.
        self.name: str | None = None
        self.done = False

    @property
    def arguments(self) -> str:
        """The canonical text of the arguments read so far ("" before they start)."""
        return self._args.text if self._args is not None else ""

    def result(self) -> tuple[str, str]:
        """(name, arguments) of the complete object.

        Raises:
            JsonSyntaxError: the object is incomplete or has no name.
        """
        if not self.done:
            raise JsonSyntaxError("the tool call's JSON object is incomplete")
        if self.name is None:
            raise JsonSyntaxError("a tool call needs a string name")
        return self.name, self._args.text if self._args is not None else NO_ARGUMENTS

    def feed(self, ch: str) -> bool:
        """Read ``ch``; False when the object has ended before it (``ch`` is not the object's)."""
        if self.done:
            return False
        if self._key is not None:
            self._key.feed(ch)
            if self._key.done:
                self._end_key()
            return True
        if self._value is not None:
            if self._value.feed(ch):
                if self._value.done:
                    self._end_value()
                return True
            self._end_value()  # a number ended at ch
        if ch in WHITESPACE:
            return True
        self._token(ch)
        return True

    def _token(self, ch: str) -> None:
        expect = self._expect
        if expect == "open":
            if ch != "{":
                raise JsonSyntaxError(f"a tool call is a JSON object; got {ch!r}")
            self._expect = "first"
        elif expect in ("first", "key") and ch == '"':
            self._key = JsonStream()
            self._key.feed(ch)
        elif ch == "}" and expect in ("first", "next"):
            self.done = True
        elif expect == "colon" and ch == ":":
            self._expect = "value"
        elif expect == "next" and ch == ",":
            self._expect = "key"
        elif expect == "value":
            self._value = JsonStream()
            if self._value_key in self._args_keys:
                if self._args is not None:
                    raise JsonSyntaxError(f"a tool call gives both {' and '.join(self._args_keys)}")
                self._args = self._value
            self._value.feed(ch)
            if self._value.done:
                self._end_value()
        else:
            raise JsonSyntaxError(f"unexpected {ch!r} in a tool call object")

    def _end_key(self) -> None:
        key = loads(self._key.text)
        self._key = None
        if key in self._keys:
            raise JsonSyntaxError(f"the key {key!r} is given twice in a tool call")
        self._keys.add(key)
        self._value_key, self._expect = key, "colon"

    def _end_value(self) -> None:
        value, self._value = self._value, None
        if not value.done:
            value.finish()
        if self._value_key == "name":
            name = loads(value.text)
            if not isinstance(name, str) or not name:
                raise JsonSyntaxError("a tool call's name must be a non-empty string")
            self.name = name
        self._expect = "next"
