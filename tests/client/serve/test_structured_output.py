"""Structured output through `pagedkv serve` and the real `openai` package, on SmolLM2.

Every output that ends with finish_reason "stop" must parse and validate against its schema (the
independent check: `jsonschema`); regex, choice and grammar constraints are checked with Python's
`re` and the choices themselves. One module server on the session's stack. `make test` runs a
bounded grid (10 of the 20 schemas greedy, 2 of the 4 sampled streams, together covering nested
objects, arrays, enums, patterns and bounded numbers); `make test-full` (PAGEDKV_TEST_FULL=1) all.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from conftest import pagedkv_process
from helpers.json_schemas import SCHEMAS

MAX_TOKENS = 96  # the longest answer here is 42 tokens
FULL = os.environ.get("PAGEDKV_TEST_FULL") == "1"
#: The schemas run greedy, and those sampled n=3 and streamed.
GREEDY = range(len(SCHEMAS)) if FULL else [0, 2, 3, 5, 8, 10, 11, 14, 16, 18]
SAMPLED = [0, 8, 10, 16] if FULL else [0, 16]


@pytest.fixture(scope="module")
def server(stack, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    svc = pagedkv_process(["serve", "--memory", stack.memory.address, "--workers", ",".join(stack.worker_addresses),
                           "--max-num-seqs", "32"], tmp, "serve")
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="none", max_retries=0, timeout=600)


def ask(oai: openai.OpenAI, prompt: str, schema: dict, **kw):
    return oai.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        **kw)


def test_schemas_greedy(oai):
    """The schemas at once (one batch), greedy: each stops on its own and validates."""
    picked = [SCHEMAS[k] for k in GREEDY]
    with ThreadPoolExecutor(len(picked)) as pool:
        replies = list(pool.map(lambda ps: ask(oai, *ps, temperature=0), picked))
    for (prompt, schema), reply in zip(picked, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_sampled_n3_streamed(oai):
    """Schemas at once with seeded sampling, n=3, streamed: each sample's deltas join into a
    document that validates."""
    def run(k: int) -> tuple[list[str], list]:
        prompt, schema = SCHEMAS[k]
        stream = ask(oai, prompt, schema, temperature=1.0, seed=k, n=3, stream=True)
        text, finish = ["", "", ""], [None, None, None]
        for chunk in stream:
            for c in chunk.choices:
                text[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
        return text, finish

    with ThreadPoolExecutor(len(SAMPLED)) as pool:
        runs = list(pool.map(run, SAMPLED))
    for k, (text, finish) in zip(SAMPLED, runs):
        assert finish == ["stop"] * 3, text
        for t in text:
            jsonschema.validate(json.loads(t), SCHEMAS[k][1])


def test_json_object(oai):
    reply = oai.chat.completions.create(model="smollm2", temperature=0, max_tokens=32,
                                        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                                        response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a free-form object may run long; what there is stays on the grammar's path
        assert reply.choices[0].message.content.startswith("{")


def test_vllm_extras_on_completions(oai):
    """vLLM's structured_outputs on /v1/completions: choice, regex, a GBNF grammar and a JSON schema."""
    def complete(prompt: str, so: dict):
        r = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=40, temperature=0,
                                   extra_body={"structured_outputs": so})
        return r.choices[0]

    c = complete("The capital of France is", {"choice": ["Paris", "London", "Berlin"]})
    assert c.text in ("Paris", "London", "Berlin") and c.finish_reason == "stop"
    c = complete("My phone number is", {"regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) and c.finish_reason == "stop"
    c = complete("Answer yes or no:", {"grammar": 'root ::= ("yes" | "no") "!"'})
    assert c.text in ("yes!", "no!")
    schema = SCHEMAS[1][1]
    c = complete("Is water wet? JSON:", {"json": schema})
    jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}, "required": ["a"]}}}},
     "response_format", "nsatisfiable"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"field_{i}": {"type": "string", "description": "x" * 60}
                                         for i in range(1000)}}}}}, "response_format", "too large"),
])
def test_bad_constraints_are_400(server, body, param, words):
    r = httpx.post(f"http://{server.address}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
