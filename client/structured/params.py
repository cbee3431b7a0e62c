"""What a request constrains its output to: vLLM's ``StructuredOutputsParams`` (vllm/sampling_params.py).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (a list
of strings), ``grammar`` (a Lark grammar, or GBNF/EBNF as llama.cpp writes it) or ``json_object``
(any JSON object) is set. The OpenAI routes build it from ``response_format`` and from vLLM's
``structured_outputs`` extra.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

#: Longest grammar source accepted (a schema's JSON text, a regex, a grammar, the choices joined), characters.
MAX_GRAMMAR_CHARS = 64 * 1024
#: Most alternatives of a ``choice``.
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One output constraint. Raises ValueError unless exactly one field is set, with the right type
    and within :data:`MAX_GRAMMAR_CHARS` / :data:`MAX_CHOICES`."""

    #: A JSON schema (a dict, or its JSON text).
    json: dict | str | None = None
    #: A regular expression the whole output matches.
    regex: str | None = None
    #: The output is exactly one of these strings.
    choice: tuple[str, ...] | None = None
    #: A context-free grammar: Lark syntax, or GBNF (``root ::= ...``).
    grammar: str | None = None
    #: Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                      if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                             f"got {set_fields or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs json must be a JSON schema object or its JSON text, "
                             f"got {self.json!r:.80}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None:
            choices = self.choice
            if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"structured_outputs choice must be 1 to {MAX_CHOICES} non-empty strings")
        if self.json_object not in (None, True):
            raise ValueError("structured_outputs json_object must be true when set")
        if len(self.key()) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the output constraint is too large: {len(self.key())} characters of schema, regex, "
                             f"choices or grammar; at most {MAX_GRAMMAR_CHARS} are accepted")

    def key(self) -> str:
        """A canonical text of the constraint (the grammar cache's key): equal constraints, equal keys."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
            return "json:" + schema
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + _json.dumps(list(self.choice))
        if self.grammar is not None:
            return "grammar:" + self.grammar
        return "json_object:"
