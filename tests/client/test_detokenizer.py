"""Incremental detokenization equals a whole decode, at multi-byte and byte-fallback boundaries;
stop strings are found across token boundaries and never shown early."""

from __future__ import annotations

import random

import pytest

from client.detokenizer import Detokenizer
from pagedkv.model.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! 你好，世界 🤖🎉 café naïve — ok",
    "  leading spaces\n\nand\ttabs  ",
    "emoji split: 👩‍👩‍👧‍👦 and 🏳️‍🌈 and ﷽",
    "<|im_start|>assistant\nHi<|im_end|> after the special tokens",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def stream(tok, ids: list[int], stop=()) -> tuple[Detokenizer, list[str]]:
    """Feed ``ids`` one at a time; returns the detokenizer and the visible text after each token."""
    d = Detokenizer(tok, list(stop))
    seen = []
    for i in ids:
        d.step(i)
        seen.append(d.visible(finished=False))
    return d, seen


@pytest.mark.parametrize("text", TEXTS)
def test_equals_whole_decode(tok, text):
    ids = tok.encode(text)
    d, seen = stream(tok, ids)
    assert d.text == tok.decode(ids, skip_special_tokens=True)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # text only grows
    assert "\ufffd" not in "".join(seen)  # nothing shown before a character is complete


def test_byte_fallback_pieces_wait_for_the_whole_character(tok):
    ids = tok.encode("🤖")
    assert len(ids) > 1  # the emoji is several byte-level tokens
    d = Detokenizer(tok)
    for i in ids[:-1]:
        d.step(i)
        assert d.text == ""
    d.step(ids[-1])
    assert d.text == "🤖"


def test_random_token_ids_equal_whole_decode(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
        d, _ = stream(tok, ids)
        # A trailing incomplete character is never emitted; everything before it matches.
        whole = tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith(d.text) and (whole == d.text or whole[len(d.text):].count("\ufffd") > 0)


def test_stop_string_across_tokens_cuts_and_is_never_visible(tok):
    text = "The capital of France is Paris. It is a large city."
    ids = tok.encode(text)
    d, seen = stream(tok, ids, stop=["Paris. It"])
    assert d.stop_hit == "Paris. It" and d.text == "The capital of France is "
    assert all("Paris" not in s for s in seen)
    assert d.visible(finished=True) == "The capital of France is "
    assert d.step(ids[0]) is None and d.text == "The capital of France is "  # nothing after the stop


def test_earliest_stop_string_wins(tok):
    d, _ = stream(tok, tok.encode("one two three four"), stop=["four", "two"])
    assert d.stop_hit == "two" and d.text == "one "


def test_holds_back_what_could_start_a_stop_string(tok):
    d = Detokenizer(tok, ["XYZW"])
    for i in tok.encode("abc def"):
        d.step(i)
    assert d.text == "abc def" and d.visible(finished=False) == "abc " and d.visible(finished=True) == "abc def"
