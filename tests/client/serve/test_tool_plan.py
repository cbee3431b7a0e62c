"""A request's tools and tool_choice (client/serve/tools/plan.py) and the replies they shape
(client/serve/outputs.py): vLLM's checks and messages, the JSON schemas ``required`` and a named
function constrain the output to, ``finish_reason``, ``parallel_tool_calls``, and a reply's
``message.tool_calls`` against its stream's ``delta.tool_calls`` for the same output."""

from __future__ import annotations

import pytest

from client.params import SamplingParams
from client.request_output import CompletionOutput, RequestOutput
from client.serve.outputs import Choices
from client.serve.protocol import APIError
from client.serve.tools.forced import required_schema
from client.serve.tools.plan import ToolRequestError, ToolSettings, constrain, plan_tools
from client.structured.params import StructuredOutputsParams
from pagedkv.model.tokenizer import load_tokenizer

PARAMS = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "now"}}
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def refused(tools, tool_choice, settings=ToolSettings(), parallel=None) -> ToolRequestError:
    with pytest.raises(ToolRequestError) as e:
        plan_tools(tools, tool_choice, parallel, settings)
    return e.value


def test_tool_choice_as_vllm_reads_it():
    assert plan_tools(None, None, None, ToolSettings()) is None
    assert plan_tools([WEATHER], "none", None, ToolSettings()) is None  # the tools are still rendered
    assert plan_tools([], "required", None, ToolSettings()) is None  # OpenAI's rule, as vLLM's
    assert plan_tools([WEATHER], None, None, AUTO).mode == "auto"  # tools given: "auto" by default
    e = refused([WEATHER], None)
    assert str(e) == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    assert e.param == "tool_choice"
    assert str(refused(None, "required")) == "When using `tool_choice`, `tools` must be set."
    assert "does not match any of the specified `tools`" in str(
        refused([WEATHER], {"type": "function", "function": {"name": "nope"}}))
    assert "Invalid value for `tool_choice`: maybe" in str(refused([WEATHER], "maybe"))
    assert "Expected field `name`" in str(refused([WEATHER], {"type": "function", "function": {}}))


@pytest.mark.parametrize("tool", [
    {"type": "retrieval"}, {"type": "function", "function": {"name": ""}},
    {"type": "function", "function": {"name": "a b"}}, {"type": "function", "function": {"name": "f", "x": 1}},
    {"type": "function", "function": {"name": "f", "parameters": []}}, {"type": "function", "function": "f"},
    {"type": "function", "function": {"name": "f"}, "extra": 1}])
def test_bad_tools_are_refused_naming_tools(tool):
    assert refused([tool], "required").param == "tools"
    assert refused([WEATHER, WEATHER], "required").param == "tools"


def test_required_and_named_constrain_the_output_to_vllms_schemas():
    defs = {"Unit": {"enum": ["c", "f"]}}
    with_defs = {"type": "function", "function": {"name": "get_temp", "parameters": {
        "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": defs}}}
    plan = plan_tools([WEATHER, TIME, with_defs], "required", None, ToolSettings())
    assert plan.schema == {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": PARAMS},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_temp"]}, "parameters": {
                "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}}},
             "required": ["name", "parameters"]}]},
        "$defs": defs}
    assert "$defs" in with_defs["function"]["parameters"]  # the request's own tools are left as they were
    one = plan_tools([WEATHER], "required", False, ToolSettings()).schema  # parallel_tool_calls false: one call
    assert one["maxItems"] == 1 and one["minItems"] == 1
    clash = {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"Unit": {"enum": ["k"]}}}}}
    with pytest.raises(ValueError, match="multiple schemas"):
        required_schema([with_defs, clash])
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, ToolSettings())
    assert named.schema == PARAMS
    sp = constrain(named, [SamplingParams(max_tokens=8)])[0]
    assert sp.structured_outputs == StructuredOutputsParams(json=PARAMS) and sp.max_tokens == 8
    assert constrain(plan_tools([WEATHER], None, None, AUTO), [sp])[0] is sp  # auto constrains nothing
    with pytest.raises(APIError) as e:  # response_format and a forced tool both: refused, as vLLM does
        constrain(named, [sp])
    assert e.value.status == 400 and "not both" in e.value.message


def test_finish_reason_is_tool_calls_only_for_calls_that_ended_by_themselves():
    auto = plan_tools([WEATHER], "auto", None, AUTO)
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, ToolSettings())
    assert auto.finish_reason("stop", True) == "tool_calls"
    assert auto.finish_reason("stop", False) == "stop"
    assert auto.finish_reason("length", True) == "length"
    assert auto.finish_reason(None, True) is None
    assert named.finish_reason("stop", True) == "stop"  # OpenAI's (and vLLM's) for a named function


TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def outputs(tokenizer, text: str, finish: str = "stop") -> list[RequestOutput]:
    """The cumulative outputs an engine publishes while it generates ``text``, one token at a time."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [RequestOutput("r", "p", [1, 2], [CompletionOutput(0, tokenizer.decode(ids[:k]), ids[:k],
                                                              finish if k == len(ids) else None)], k == len(ids))
            for k in range(1, len(ids) + 1)]


@pytest.mark.parametrize("parallel", [None, False])
def test_a_stream_of_tool_calls_reassembles_to_the_reply(parallel):
    tokenizer = load_tokenizer("smollm2")
    plan = plan_tools([WEATHER, TIME], "auto", parallel, AUTO)
    outs = outputs(tokenizer, TEXT)
    reply = Choices("chatcmpl-x", "smollm2", True, 1, tokenizer, tools=plan).reply([outs[-1]])
    choice = reply["choices"][0]
    calls = [("get_weather", '{"location": "Paris"}'), ("get_time", "{}")][:1 if parallel is False else 2]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look.\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in choice["message"]["tool_calls"])
    choices = Choices("chatcmpl-x", "smollm2", True, 1, tokenizer, tools=plan)
    chunks = [c for out in outs for c in choices.chunks(0, out)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    content = "".join(d.get("content", "") for d in deltas)
    streamed: dict[int, list] = {}
    for d in deltas:
        for t in d.get("tool_calls", []):
            if "id" in t:
                streamed[t["index"]] = [t["function"]["name"], t["function"].get("arguments", "")]
            else:
                streamed[t["index"]][1] += t["function"]["arguments"]
    assert content == "Let me look.\n" and [tuple(v) for _, v in sorted(streamed.items())] == calls
    # an output without calls keeps its text and the engine's reason
    plain = Choices("c", "smollm2", True, 1, tokenizer, tools=plan).reply(outputs(tokenizer, "Sunny.", "length")[-1:])
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Sunny."}
    assert plain["choices"][0]["finish_reason"] == "length"
