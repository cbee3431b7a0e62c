"""Chat prompts with tools (client/serve/chat_template.py, messages.py): the shipped Hermes-style
template's exact text for a history with a tool call and its result, SmolLM2's template detected
as rendering no tools, ``--chat-template`` from a file, inline and by a shipped name (and its
environment variable), ``chat_template_kwargs`` reaching the template and a key that collides
with the renderer's own arguments refused, and the messages the ``openai`` package sends back."""

from __future__ import annotations

import json

import openai
import pytest

from client.serve.chat_template import (
    TOOL_TEMPLATE,
    ChatTemplate,
    TemplateKwargsError,
    check_template_kwargs,
    renders_tools,
    shipped_template,
)
from client.serve.config import parse_args
from client.serve.messages import chat_messages
from client.serve.protocol import APIError
from pagedkv.model.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]

#: A two-turn history as the openai package sends it: the reply's message (with its null fields) and the result.
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None, "annotations": [],
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 22}'},
]

EXPECTED = """<|im_start|>system
You are a helpful assistant.

# Tools

You may call one or more functions to answer the user. Their signatures are given as JSON between <tools> and \
</tools>:
<tools>
{"name": "get_weather", "description": "Get the current weather in a given location", "parameters": {"type": \
"object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}
</tools>

To call a function, answer with a JSON object giving its name and arguments between <tool_call> and </tool_call>, \
one per call:
<tool_call>
{"name": <function-name>, "arguments": <arguments-json-object>}
</tool_call><|im_end|>
<|im_start|>user
What is the weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"location": "Paris"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature_c": 22}
</tool_response><|im_end|>
<|im_start|>assistant
"""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_the_shipped_template_renders_tools_calls_and_results(tokenizer):
    """SmolLM2's own template never mentions tools, so a request with tools gets the shipped one."""
    assert not renders_tools(tokenizer.chat_template) and renders_tools(shipped_template())
    assert ChatTemplate().choose(tokenizer, with_tools=True) == shipped_template(TOOL_TEMPLATE)
    assert ChatTemplate().choose(tokenizer, with_tools=False) is None
    ids = ChatTemplate().encode(tokenizer, chat_messages(HISTORY), tools=TOOLS)
    assert text_of(tokenizer, ids) == EXPECTED
    # the ids are the tokenizer's own of that text (ChatML markers as their special tokens)
    assert ids == tokenizer.encode(EXPECTED, add_special_tokens=False)
    # a tool message alone (no tools declared) still takes the tool template; plain chat keeps the model's
    assert "<tool_response>" in text_of(tokenizer, ChatTemplate().encode(tokenizer, chat_messages(HISTORY)))
    plain = [{"role": "user", "content": "Hi"}]
    assert ChatTemplate().encode(tokenizer, plain) == list(tokenizer.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_chat_template_flag_takes_a_file_inline_text_or_a_shipped_name(tokenizer, tmp_path, monkeypatch):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ tools | length }} tools"
    path = tmp_path / "plain.jinja"
    path.write_text(template)
    msgs = [{"role": "user", "content": "Hi"}]
    for value in (str(path), template):
        cfg = parse_args(["--chat-template", value])
        assert cfg.chat_template == template
        assert text_of(tokenizer, ChatTemplate(cfg.chat_template).encode(tokenizer, chat_messages(msgs),
                                                                         tools=TOOLS)) == "[user] Hi\n1 tools"
    assert parse_args(["--chat-template", TOOL_TEMPLATE]).chat_template == shipped_template()
    monkeypatch.setenv("PAGEDKV_CHAT_TEMPLATE", str(path))
    assert parse_args([]).chat_template == template
    monkeypatch.delenv("PAGEDKV_CHAT_TEMPLATE")
    assert parse_args([]).chat_template is None


@pytest.mark.parametrize("value,message", [("no/such/template.jinja", "looks like a file path"),
                                           ("{% for m in messages %}", "does not compile")])
def test_a_bad_chat_template_fails_the_start(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--chat-template", value])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_tool_flags_are_checked_at_start(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice"])
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--tool-call-parser", "nope"])
    assert "invalid tool call parser: nope" in capsys.readouterr().err
    cfg = parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert cfg.enable_auto_tool_choice and cfg.tool_call_parser == "hermes"


def test_chat_template_kwargs_reach_the_template_and_its_own_arguments_are_refused(tokenizer):
    greeting = ChatTemplate("{{ greeting }}, {{ messages[0].content }}{% if add_generation_prompt %}!{% endif %}")
    msgs = chat_messages([{"role": "user", "content": "Ada"}])
    assert text_of(tokenizer, greeting.encode(tokenizer, msgs, template_kwargs={"greeting": "Bonjour"})) == \
        "Bonjour, Ada!"
    for key in ("messages", "tools", "add_generation_prompt", "chat_template", "tokenize", "documents",
                "continue_final_message", "return_dict"):
        with pytest.raises(TemplateKwargsError, match=f"unexpected chat template kwargs.*{key}"):
            greeting.encode(tokenizer, msgs, template_kwargs={key: []})
    with pytest.raises(TemplateKwargsError):
        check_template_kwargs(["greeting"])
    # a template's own error is a ValueError (the route's 400), not a server error
    with pytest.raises(ValueError, match="cannot render"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").encode(tokenizer, msgs)


def test_messages_from_the_openai_package_reach_the_template():
    """A reply's message object, sent back as the openai package dumps it, plus a tool result."""
    reply = openai.types.chat.ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"location": "P"}'}}]})
    sent = json.loads(reply.model_dump_json())  # refusal, audio, function_call, annotations: null
    assert {"refusal", "audio", "function_call", "annotations"} <= set(sent)
    msgs = chat_messages([{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                            "text": "b"}]},
                          sent, {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}])
    assert msgs == [
        {"role": "system", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "P"}}}]},
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
    ]
    for bad in ({"role": "robot", "content": "x"}, {"role": "user", "content": "x", "tool_calls": []},
                {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {}}]},
                {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
                {"role": "tool", "content": "x", "tool_call_id": 5}):
        with pytest.raises(APIError) as e:
            chat_messages([bad])
        assert e.value.status == 400 and e.value.param == "messages"
