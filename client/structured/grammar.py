"""Grammars compiled once per constraint, with llguidance (guidance-ai/llguidance; vLLM's "guidance" backend).

llguidance was chosen over xgrammar because it is one dependency-free abi3 wheel (xgrammar pulls torch,
transformers, triton and a TVM runtime at pinned floors), it compiles a grammar lazily in milliseconds
(no per-schema precomputation over the vocabulary), and its masks take well under a millisecond per
step on a CPU (a lazy lexer over a token trie). It reads JSON schemas, regular expressions, Lark and
GBNF grammars directly.

JSON is generated compact, one line with ``", "`` and ``": "`` separators (llguidance's
``whitespace_flexible: false``): whitespace inside the JSON is fixed by the grammar, so a small model
cannot spend its tokens on newlines and indentation (vLLM's ``disable_any_whitespace``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import llguidance
import llguidance.hf

from client.structured.matcher import GrammarMatcher
from client.structured.params import StructuredOutputsParams

#: Compact JSON: one line, fixed separators (llguidance's JSON-schema options, docs/json_schema.md).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256
#: llguidance's parser limits, lowered from its defaults so that one grammar cannot take a core for
#: seconds at a step: a grammar past them fails to compile (a 400) or, at a step, ends its sequence.
LIMITS = dict(max_grammar_size=100_000, max_lexer_states=50_000, step_max_items=20_000, initial_lexer_fuel=500_000)


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled constraint: llguidance's grammar text for one :class:`StructuredOutputsParams`."""

    #: :meth:`StructuredOutputsParams.key` of the constraint.
    key: str
    #: llguidance's grammar definition (JSON text).
    source: str
    #: The llguidance tokenizer it was checked against (the model's vocabulary).
    tokenizer: llguidance.LLTokenizer
    #: Words of a bitmask: ceil(vocab_size / 32).
    mask_words: int
    #: The bitmask that allows only end-of-sequence (a matcher that fails ends its sequence with it).
    eos_mask: bytes

    def matcher(self) -> GrammarMatcher:
        """A new matcher at the start of the grammar (one per constrained sequence)."""
        m = llguidance.LLMatcher(self.tokenizer, self.source, limits=llguidance.LLParserLimits(**LIMITS))
        if m.is_error():
            raise ValueError(f"structured output: {m.get_error()}")
        return GrammarMatcher(m, self.mask_words, self.eos_mask)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar definition for ``spec`` (not yet checked against a vocabulary).

    Raises:
        ValueError: a JSON schema that is not JSON, not an object or boolean, or a grammar llguidance cannot read.
    """
    try:
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or a boolean)")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return llguidance.grammar_from("regex", spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError(str(e) or type(e).__name__) from None


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary, each distinct one once (an LRU cache of
    :data:`CACHE_SIZE`). Thread-safe: the serving front compiles in a worker thread, the engine
    looks up at admission.

    Args:
        tokenizer: the model's transformers fast tokenizer.
        vocab_size: the model's vocabulary (its logits' width, GetModelInfo's ``vocab_size``).
        eos_ids: the model's end-of-sequence token ids (the grammar's end allows them).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self._hf, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        words = bytearray(4 * -(-vocab_size // 32))
        for t in self.eos_ids:
            if 0 <= t < vocab_size:
                words[t // 8] |= 1 << (t % 8)
        #: The mask allowing only end-of-sequence (little-endian words: bit t is byte t // 8, bit t % 8).
        self.eos_mask = bytes(words)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        #: Grammars compiled (cache misses) and found in the cache.
        self.compiled = self.hits = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built at first use (about half a second)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_ids or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The grammar of ``spec``, from the cache or compiled now and checked against the vocabulary.

        Raises:
            ValueError: the constraint cannot be compiled: bad syntax, an unsatisfiable or
                unsupported schema, or a grammar over the size limits (llguidance's message).
        """
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        tokenizer = self.tokenizer
        source = grammar_text(spec)
        limits = llguidance.LLParserLimits(**LIMITS)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, tokenizer, limits=limits)
        unsat = [m for m in messages if "nsatisfiable" in m]
        if is_error or unsat:
            raise ValueError(f"the {_what(spec)} cannot be used: {(messages or ['invalid grammar'])[0]}")
        grammar = Grammar(key, source, tokenizer, -(-self.vocab_size // 32), self.eos_mask)
        first = grammar.matcher()  # a grammar llguidance accepts but cannot start fails here
        first.bitmask()
        if first.failed or first.error:  # an empty language ([^\x00-\x{10FFFF}], start: start "a", {"$ref": "#"})
            raise ValueError(f"the {_what(spec)} cannot be used: no output satisfies it (llguidance stops at its "
                             f"start: {first.reason or first.error})")
        with self._lock:
            self._cache[key] = grammar
            self.compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def _what(spec: StructuredOutputsParams) -> str:
    if spec.json is not None:
        return "JSON schema"
    if spec.json_object:
        return "JSON object grammar"
    return "choice list" if spec.choice is not None else "regex" if spec.regex is not None else "grammar"
