"""The tool parsers (client/serve/tools) on model text in each format: the whole-text parse gives
the expected content and calls, and the stream, fed character by character, token by token
(SmolLM2's tokenizer, decoded as the detokenizer streams) or all at once, sends deltas that
join to the same content and calls (the first delta of a call carries its id and name, later
ones fragments of its arguments). Plus the canonical JSON writer the streams rely on, against
``json.dumps(json.loads(...))`` over random JSON in several layouts."""

from __future__ import annotations

import json
import random

import pytest

from client.serve.tools.forced import NamedParser, RequiredParser
from client.serve.tools.json_stream import JsonStream, JsonSyntaxError, dumps, loads
from client.serve.tools.parser import ToolParser, get_parser, parser_names
from pagedkv.model.tokenizer import load_tokenizer

WEATHER = ("get_weather", '{"location": "Paris, France", "unit": "celsius"}')
TIME = ("get_time", '{"timezone": "Europe/Paris"}')

#: (parser, model text, content of the whole-text parse, its calls as (name, arguments)).
CASES = [
    # Hermes 2 Pro / Qwen 2.5 layout: text before the call, the object on its own line
    ("hermes", "I'll check the weather for you.\n<tool_call>\n"
               '{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n</tool_call>',
     "I'll check the weather for you.\n", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n'
               '</tool_call>',
     None, [WEATHER, TIME]),
    # compact JSON, escapes, arguments before the name, a float written two ways: the canonical arguments
    ("hermes", '<tool_call>{"arguments":{"city":"Z\\u00fcrich","note":"a \\"b\\"\\n","t":21.50,"n":[1,2E1]},'
               '"name":"get_weather"}</tool_call>',
     None, [("get_weather", '{"city": "Zürich", "note": "a \\"b\\"\\n", "t": 21.5, "n": [1, 20.0]}')]),
    # malformed JSON (unquoted keys, as small models write): the whole text is content
    ("hermes", "Sure. <tool_call>\n{name: get_weather, arguments: {location: Paris}}\n</tool_call>",
     "Sure. <tool_call>\n{name: get_weather, arguments: {location: Paris}}\n</tool_call>", []),
    ("hermes", "Use <b>bold</b> or a < b; no <tool> here.", "Use <b>bold</b> or a < b; no <tool> here.", []),
    # a call left open at the end of the output, complete JSON: still a call
    ("hermes", 'Checking. <tool_call>{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
     "Checking. ", [TIME]),
    # Llama 3.1's JSON calls: "parameters", the python tag, ';' between calls
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}',
     None, [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": '
                    '"celsius"}}; {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
     None, [WEATHER, TIME]),
    ("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3_json", '{"name": get_weather, "parameters": {}}', '{"name": get_weather, "parameters": {}}', []),
    # tool_choice "required": the JSON array its grammar forces
    ("required", '[{"name": "get_weather", "parameters": {"location": "Paris, France", "unit": "celsius"}}, '
                 '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}]', None, [WEATHER, TIME]),
    ("required", "[]", "[]", []),
    # a named function: the output is its arguments, as written
    ("named", '{"location": "Paris, France", "unit": "celsius"}', None, [WEATHER]),
]


def make(name: str) -> ToolParser:
    if name == "required":
        return RequiredParser()
    if name == "named":
        return NamedParser("get_weather")
    return get_parser(name)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def token_pieces(tokenizer, text: str) -> list[str]:
    """``text`` as a detokenizer streams it: the new characters of the decoded prefix at each token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, sent = [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        if now.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            continue
        pieces.append(now[len(sent):])
        sent = now
    assert sent == text
    return pieces


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """(content, calls, ids) joined from the stream's deltas, checking each delta's shape."""
    stream = parser.stream()
    content, calls, ids = "", {}, []
    for piece in [*pieces, None]:
        delta = stream.feed(piece) if piece is not None else stream.finish()
        content += delta.content
        for d in delta.tool_calls:
            if d.index not in calls:
                assert d.index == len(calls) and d.id.startswith("call_") and d.name, d
                assert d.to_openai()["type"] == "function" and d.to_openai()["function"]["name"] == d.name
                calls[d.index] = [d.name, ""]
                ids.append(d.id)
            else:
                assert d.id is None and d.name is None and d.arguments, d  # later deltas: arguments only
                assert set(d.to_openai()) == {"index", "function"}
            calls[d.index][1] += d.arguments or ""
    assert stream.called == bool(calls)
    return content or None, [tuple(c) for c in calls.values()], ids


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_text_and_every_stream_agree(tokenizer, name, text, content, calls):
    parser = make(name)
    whole = parser.extract(text)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    ids = [c.id for c in whole.tool_calls]
    assert len(set(ids)) == len(calls) and all(i.startswith("call_") for i in ids)
    for c, (fn, args) in zip(whole.tool_calls, calls):
        assert c.to_openai() == {"id": c.id, "type": "function", "function": {"name": fn, "arguments": args}}
    for pieces in (list(text), token_pieces(tokenizer, text), [text]):
        got_content, got_calls, ids = streamed(parser, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        assert len(set(ids)) == len(ids)


def test_a_stream_holds_back_only_what_may_be_a_marker():
    """Text that may start ``<tool_call>`` waits for the next piece; once it cannot, it goes out."""
    stream = get_parser("hermes").stream()
    assert stream.feed("Look: <tool").content == "Look: "
    assert stream.feed("kit>").content == "<toolkit>"
    assert stream.feed("<").content == ""
    assert stream.finish().content == "<"


def test_a_call_whose_json_breaks_after_its_name_keeps_what_the_stream_sent():
    """The documented limit: a stream cannot take back a call it announced (nor can vLLM's); the
    whole-text parse of the same text gives it all as content."""
    text = '<tool_call>{"name": "get_weather", "arguments": {location: "Paris"}}</tool_call> then text'
    parser = get_parser("hermes")
    assert parser.extract(text).content == text and not parser.extract(text).tool_calls
    content, calls, _ = streamed(parser, list(text))
    assert content is None and calls == [("get_weather", "{")]


def test_registry_has_vllms_names():
    assert parser_names() == ("hermes", "llama3_json")
    with pytest.raises(KeyError, match="invalid tool call parser: mistral"):
        get_parser("mistral")


def _random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.35:
        return rng.choice([0, -7, 10**30, 2.5, -1e-7, 1e300, True, False, None, "", "é\"\\/\n\t\u2028\U0001F600",
                           "\x01 ctl", "plain"])
    if r < 0.65:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{rng.choice(['', ' ', 'é'])}": _random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def canonical(raw: str) -> str:
    stream = JsonStream()
    for ch in raw:
        if not stream.feed(ch):
            assert stream.done and ch in " \t\n\r", (raw, ch)
    if not stream.done:
        stream.finish()
    return stream.text


def test_the_streaming_json_writer_equals_json_dumps_of_json_loads():
    rng = random.Random(0)
    for _ in range(500):
        value = _random_json(rng)
        for raw in (json.dumps(value), json.dumps(value, indent=2), json.dumps(value, separators=(",", ":")),
                    json.dumps(value, ensure_ascii=False), f" \n{json.dumps(value)}\t"):
            assert canonical(raw) == dumps(loads(raw)) == json.dumps(json.loads(raw), ensure_ascii=False), raw
    # \\u escapes of a surrogate pair join, as json.loads joins them; a lone one stays
    assert canonical('"\\ud83d\\ude00 \\ud83d."') == dumps(loads('"\\ud83d\\ude00 \\ud83d."'))


@pytest.mark.parametrize("raw", ['{"a": 1,}', "[1,]", '{"a" 1}', "NaN", "-Infinity", '{"a": 1, "a": 2}', "01",
                                 "tru", "[1 2]", "{a: 1}", '"\x01"', '"\\x"', '"\\u12g4"', "[" * 300 + "]" * 300])
def test_what_is_not_json_is_refused_by_both_readers(raw):
    with pytest.raises(JsonSyntaxError):
        canonical(raw)
    if raw.count("[") < 300:  # json itself takes deeper nesting than the stream's bound
        with pytest.raises(JsonSyntaxError):
            loads(raw)
