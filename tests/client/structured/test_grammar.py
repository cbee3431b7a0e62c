"""client.structured on SmolLM2's real vocabulary: each mask against an independent reference built
from the decoded vocabulary, the compile cache, matchers stepping and forking, and the refusals."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from client.structured.grammar import GrammarCompiler
from client.structured.params import StructuredOutputsParams as Spec

VOCAB = 49152  # SmolLM2's logits width (GetModelInfo's vocab_size)
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def compiler(hf_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer, VOCAB, [EOS])


@pytest.fixture(scope="module")
def pieces(hf_tokenizer) -> list[str]:
    """Each token's own text (the byte-level pieces decoded one by one)."""
    return [hf_tokenizer.decode([t]) for t in range(VOCAB)]


def allowed(mask: bytes) -> set[int]:
    words = np.frombuffer(mask, dtype="<u4")
    assert words.size == -(-VOCAB // 32)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)[:VOCAB]).tolist())


def test_choice_mask_is_the_tokens_that_begin_a_choice(compiler, pieces, hf_tokenizer):
    """The first mask of a choice allows exactly the tokens whose text is a non-empty prefix of one
    of the choices (nothing else, not end-of-sequence); after the whole choice only EOS remains."""
    choices = ["yes", "no", "maybe later"]
    m = compiler.compile(Spec(choice=choices)).matcher()
    expect = {t for t, p in enumerate(pieces) if p and any(c.startswith(p) for c in choices)
              and not hf_tokenizer.convert_ids_to_tokens(t).startswith("<")}
    assert allowed(m.bitmask()) == expect
    ids = hf_tokenizer.encode("maybe later")
    for t in ids:
        assert not m.done
        assert m.accept(t)
    assert m.done and allowed(m.bitmask()) == {EOS}


def test_regex_mask_matches_the_pattern_prefixes(compiler, pieces, hf_tokenizer):
    """``[0-9]{3}``: first tokens are exactly the all-digit pieces of 1 to 3 characters."""
    m = compiler.compile(Spec(regex=r"[0-9]{3}")).matcher()
    expect = {t for t, p in enumerate(pieces) if re.fullmatch(r"[0-9]{1,3}", p)
              and not hf_tokenizer.convert_ids_to_tokens(t).startswith("<")}
    assert allowed(m.bitmask()) == expect
    assert not m.accept(hf_tokenizer.encode("x")[0]) and m.error


def test_json_is_compact_and_complete_json_stops(compiler, hf_tokenizer):
    """A schema's JSON is one line with ", " and ": " separators: a newline or a second space is never
    allowed; the completed object leaves only EOS, and a fork steps independently."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    m = compiler.compile(Spec(json=schema)).matcher()
    newline = {t for t in range(VOCAB) if "\n" in hf_tokenizer.decode([t])}
    assert not allowed(m.bitmask()) & newline
    text = json.dumps({"a": 12, "b": "y"})  # '{"a": 12, "b": "y"}'
    ids = hf_tokenizer.encode(text)
    twin = None
    for i, t in enumerate(ids):
        assert not allowed(m.bitmask()) & newline
        assert m.accept(t), m.error
        if i == 2:
            twin = m.fork()
    assert m.done and allowed(m.bitmask()) == {EOS}
    assert not twin.done
    for t in ids[3:]:
        assert twin.accept(t)
    assert twin.done


def test_compiled_once_per_constraint(hf_tokenizer):
    """Equal constraints (a schema's keys in any order) compile once; another one compiles anew."""
    c = GrammarCompiler(hf_tokenizer, VOCAB, [EOS])
    a = c.compile(Spec(json={"type": "object", "properties": {"k": {"type": "string"}}}))
    b = c.compile(Spec(json={"properties": {"k": {"type": "string"}}, "type": "object"}))
    assert a is b and (c.compiled, c.hits) == (1, 1)
    c.compile(Spec(regex="[ab]+"))
    assert (c.compiled, c.hits) == (2, 1)


@pytest.mark.parametrize(("spec", "words"), [
    (Spec(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}},
                "required": ["a"]}), "nsatisfiable"),
    (Spec(json="{"), "not valid JSON"),
    (Spec(json={"type": 5}), "type"),
    (Spec(regex="(("), "regex"),
    (Spec(grammar="root ::= missing"), "missing"),
])
def test_bad_constraints_are_refused(compiler, spec, words):
    with pytest.raises(ValueError, match=words):
        compiler.compile(spec)


@pytest.mark.parametrize("spec", [
    Spec(regex=r"[^\x00-\x{10FFFF}]"),  # no character at all
    Spec(grammar='start: start "a"'),  # left recursion with no base case
    Spec(json={"$ref": "#"}),
    Spec(json={"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
])
def test_a_constraint_no_output_satisfies_is_refused(compiler, spec):
    """An empty language compiles in llguidance but stops at its first mask (only EOS allowed): the
    request would end at once with "stop" and an output its constraint rejects, so it is refused."""
    with pytest.raises(ValueError, match="no output satisfies it"):
        compiler.compile(spec)


@pytest.mark.parametrize("spec", [Spec(regex="(?:)"), Spec(grammar="start: "), Spec(json={"const": ""})])
def test_a_constraint_only_the_empty_output_satisfies_compiles(compiler, spec):
    """The empty output is an output: its first mask is end-of-sequence alone, and EOS completes it."""
    m = compiler.compile(spec).matcher()
    if spec.json is not None:  # the JSON string "" is two quote characters, then EOS
        assert m.accept(18) and m.accept(18)  # '"'
    assert allowed(m.bitmask()) == {EOS} and not m.failed
    assert m.accept(EOS) and m.done


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        Spec()
    with pytest.raises(ValueError, match="exactly one"):
        Spec(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        Spec(choice=[])
    with pytest.raises(ValueError, match="too large"):
        Spec(regex="a" * 70_000)


def test_a_matcher_that_fails_asks_for_end_of_sequence_and_ends(compiler, hf_tokenizer):
    """A token the grammar refuses (only a misbehaving worker could send one) leaves the matcher in
    error: its next mask is end-of-sequence only and every later token is refused, so the sequence
    ends; a fork taken before is unaffected."""
    m = compiler.compile(Spec(regex="ab")).matcher()
    twin = m.fork()
    assert not m.accept(hf_tokenizer.encode("x")[0]) and m.error
    assert allowed(m.bitmask()) == {EOS}
    assert not m.accept(EOS)
    assert EOS not in allowed(twin.bitmask()) and allowed(twin.bitmask())
