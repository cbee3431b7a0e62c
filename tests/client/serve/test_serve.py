"""`pagedkv serve` as a real process, driven by the real `openai` package (and plain HTTP).

The server attaches to the session's stack (memory service + two workers); one module-scoped
server with two tenant keys and an admin key serves every test here, plus short-lived servers for
the queue limit, the pool check and the embedded mode.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import openai
import pytest
from conftest import START_TIMEOUT, pagedkv_process, private_home
from helpers.model_fixtures import CHATS, hf_greedy_tokens
from prometheus_client.parser import text_string_to_metric_families

from client.api import Client
from client.params import SamplingParams
from client.services import MemoryClient

KEY_A, KEY_B, ADMIN = "key-tenant-a", "key-tenant-b", "key-admin"
#: Tenants c and d share one prefix cache (--cache-sharing-group team=tenant-c,tenant-d).
KEY_C, KEY_D = "key-tenant-c", "key-tenant-d"
BLOCK = 16  # the stack's block size


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(stack, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    keys = tmp / "keys.txt"
    keys.write_text(f"# key tenant\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n{KEY_C} tenant-c\n{KEY_D} tenant-d\n")
    svc = pagedkv_process(["serve", "--memory", stack.memory.address, "--workers", ",".join(stack.worker_addresses),
                           "--api-keys-file", str(keys), "--admin-api-key", ADMIN, "--max-num-batched-tokens", "256",
                           "--cache-sharing-group", "team=tenant-c,tenant-d", "--memory-admin-token-file",
                           stack.memory.info["admin_token_file"]], tmp, "serve")  # an admin lease: the whole pool
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def url(server) -> str:
    return f"http://{server.address}"


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def memory(stack):
    m = MemoryClient(stack.memory.address)
    yield m
    m.close()


def steps(url: str, since: int = 0) -> dict:
    r = httpx.get(f"{url}/debug/steps", params={"since": since}, headers={"Authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()
    return r.json()


def metrics(url: str, key: str | None = ADMIN) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels without model_name): value}, read with ``key``
    (the module server's has API keys: /metrics needs the admin or the metrics key)."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_greedy_chat_equals_transformers_and_stream_equals_reply(oai, hf_model, memory):
    for text in CHATS:
        r = oai.chat.completions.create(model="smollm2", messages=chat(text), max_tokens=24, temperature=0,
                                        extra_body={"return_token_ids": True})
        (choice,) = r.choices
        got = choice.model_extra["token_ids"]
        ref = hf_greedy_tokens(hf_model, r.model_extra["prompt_token_ids"], 24)
        assert got == ref, f"{text!r}: {got} != {ref}"
        assert choice.finish_reason == ("stop" if ref[-1] == 2 else "length")
        assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])
        assert r.usage.completion_tokens == len(got) and r.usage.total_tokens == r.usage.prompt_tokens + len(got)
        stream = oai.chat.completions.create(model="smollm2", messages=chat(text), max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        # The stream repeats the reply's prompt: every whole block but the one holding its last token is cached.
        cached = (r.usage.prompt_tokens - 1) // BLOCK * BLOCK
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
        assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == \
            r.usage.model_dump(exclude={"prompt_tokens_details"})
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert oai.chat.completions.create(model="smollm2", messages=chat(CHATS[0]), max_tokens=24,
                                       temperature=0).choices[0].message.content == "The capital of France is Paris."
    assert memory.stats().used_blocks == 0


def test_parallel_samples_equal_solo_runs(oai):
    kw = dict(model="smollm2", messages=chat("Tell me a story about a robot."), max_tokens=12, temperature=1.0)
    both = oai.chat.completions.create(n=2, seed=7, **kw)
    assert [c.index for c in both.choices] == [0, 1]
    solo = [oai.chat.completions.create(seed=7 + i, **kw).choices[0].message.content for i in range(2)]
    assert [c.message.content for c in both.choices] == solo
    assert solo[0] != solo[1]
    tokens = [oai.chat.completions.create(seed=7 + i, extra_body={"return_token_ids": True}, **kw)
              .choices[0].model_extra["token_ids"] for i in range(2)]
    assert both.usage.completion_tokens == sum(len(t) for t in tokens)


def test_completions_prompt_forms_logprobs_and_stop(oai, hf_model):
    ids = [504, 3458, 282, 4649, 314]  # "The capital of France is"
    r = oai.completions.create(model="smollm2", prompt=[ids, ids[:3]], max_tokens=6,
                               temperature=0, logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                      "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    ref = hf_greedy_tokens(hf_model, ids, 6)
    assert r.choices[0].model_extra["token_ids"] == ref
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ref]
    for tok, chosen, top in zip(ref, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[f"token_id:{tok}"] == pytest.approx(chosen)  # greedy: the best is chosen
        assert chosen == max(top.values())
    assert r.model_extra["prompt_token_ids"] == [ids, ids[:3]] and r.usage.prompt_tokens == len(ids) + 3
    assert r.usage.completion_tokens == 12
    full = r.choices[0].text
    stop_at = full.index("Paris") if "Paris" in full else len(full) // 2
    stop = full[stop_at:stop_at + 3]
    cut = oai.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop
    streamed = oai.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0, stop=[stop],
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text  # never a piece of the stop string
    chunks = list(oai.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0, logprobs=1,
                                         stream=True))
    whole = oai.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0, logprobs=1)
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset and len(set(offsets)) == 6


def test_two_clients_share_one_batch_and_one_lease(url, memory):
    ids: dict[str, str] = {}
    leases_seen: list[int] = []

    def run(name: str, key: str) -> None:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
        for chunk in c.chat.completions.create(model="smollm2", messages=chat(f"Count to one hundred, {name}."),
                                               max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            ids[name] = chunk.id
            if len(ids) == 2:
                leases_seen.append(memory.stats().num_leases)

    start = steps(url)["step_count"]
    threads = [threading.Thread(target=run, args=(n, k)) for n, k in (("a", KEY_A), ("b", KEY_B))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(ids) == 2 and leases_seen and set(leases_seen) == {1}
    both = [s for s in steps(url, start)["steps"] if set(ids.values()) <= set(s["request_ids"])]
    assert len(both) >= 5, "the two clients' requests never ran in the same steps"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_disconnect_frees_blocks_within_two_steps(url, memory, stream):
    body = {"model": "smollm2", "messages": chat("Write a very long essay about oceans."), "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    first = steps(url)["step_count"]
    aborts_before = len(steps(url)["aborts"])
    if stream:
        with httpx.Client(timeout=60) as h, h.stream("POST", f"{url}/v1/chat/completions", json=body,
                                                     headers=headers) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and memory.stats().used_blocks > 0:
                    break
            assert memory.stats().used_blocks > 0
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes the connection
            httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers,
                       timeout=httpx.Timeout(30, read=3))
    # The connection is closed: the server sees it, aborts, and the next step frees the blocks.
    deadline = time.monotonic() + 60
    while memory.stats().used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory.stats().used_blocks == 0 and memory.stats().num_sequences == 0
    trace = steps(url)
    (abort,) = trace["aborts"][aborts_before:]
    assert trace["step_count"] - abort["step"] <= 2, f"aborted at step {abort['step']}, engine at {trace['step_count']}"
    ran = [s["step"] for s in steps(url, first)["steps"] if abort["request_id"] in s["request_ids"]]
    assert ran and max(ran) < abort["step"] + 2 and len(ran) < 1000


#: The openai package's tool example; strict-mode style (additionalProperties false), so the grammar
#: of tool_choice "required" keeps SmolLM2 to the one argument.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object",
                   "properties": {"location": {"type": "string", "description": "The city, e.g. Paris"}},
                   "required": ["location"], "additionalProperties": False}}}

BAD = [
    # (route, body, status, param)
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ("chat", {"messages": chat("hi"), "temperature": -1}, 400, "temperature"),
    ("chat", {"messages": chat("hi"), "top_p": 0}, 400, "top_p"),
    ("chat", {"messages": chat("hi"), "n": 0}, 400, "n"),
    ("chat", {"messages": chat("hi"), "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": chat("hi"), "max_tokens": 10**6}, 400, "max_tokens"),
    ("chat", {"messages": chat("hi"), "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("chat", {"messages": chat("hi"), "presence_penalty": -3}, 400, "presence_penalty"),
    ("chat", {"messages": chat("hi"), "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 1e39}, 400, "repetition_penalty"),
    ("chat", {"messages": chat("hi"), "logit_bias": {"42": 101}}, 400, "logit_bias"),
    ("chat", {"messages": chat("hi"), "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias"),  # SmolLM2 has 49152 tokens
    ("completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("chat", {"messages": chat("hi"), "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"messages": chat("hi"), "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {"messages": chat("hi"), "stop": [""]}, 400, "stop"),
    ("chat", {"messages": chat("hi"), "best_friend": 1}, 400, "best_friend"),
    ("chat", {"messages": chat("hi"), "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"messages": chat("hi"), "model": "gpt-4o"}, 404, "model"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    ("completions", {"prompt": [1] * 9000}, 400, "prompt"),
    ("completions", {"prompt": [10**9]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "priority": 1}, 400, "priority"),  # this server schedules FCFS, as vLLM's default
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    # values the worker's int32 / float32 fields cannot carry: refused here, never failing the batch
    ("completions", {"prompt": "hi", "top_k": 2**31}, 400, "top_k"),
    ("completions", {"prompt": "hi", "temperature": 1e39}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1e-50}, 400, "top_p"),
    # strict types
    ("completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("completions", {"prompt": "hi", "temperature": True}, 400, "temperature"),
    ("completions", {"prompt": "\ud800"}, 400, None),
    ("completions", {"prompt": "hi", "stop": ["x"] * 33}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": ["x" * 513]}, 400, "stop"),
    ("completions", {"prompt": "hi", "n": 64, "max_tokens": 400, "ignore_eos": True}, 400, "max_tokens"),
    # tools: "auto" (also the default with tools) needs --enable-auto-tool-choice --tool-call-parser, which this
    # server lacks; a named function must be one of the tools; tools are checked; the template's own arguments
    ("chat", {"messages": chat("hi"), "tools": [WEATHER_TOOL], "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat", {"messages": chat("hi"), "tools": [WEATHER_TOOL]}, 400, "tool_choice"),
    ("chat", {"messages": chat("hi"), "tools": [WEATHER_TOOL],
              "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, 400, "tool_choice"),
    ("chat", {"messages": chat("hi"), "tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"messages": chat("hi"), "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
              "tool_choice": "required"}, 400, "tools"),
    ("chat", {"messages": chat("hi"), "tools": [WEATHER_TOOL], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("chat", {"messages": chat("hi"), "chat_template_kwargs": {"add_generation_prompt": False}}, 400,
     "chat_template_kwargs"),
    ("chat", {"messages": [{"role": "tool", "content": "22 C", "tool_call_id": 7}]}, 400, "messages"),
    # beam search: what cannot combine with it (client.serve.beam)
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "stream": True}, 400, "stream"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 11}, 400, "n"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "logprobs": 0}, 400, "logprobs"),
    ("chat", {"messages": chat("hi"), "use_beam_search": True, "n": 2, "logprobs": True}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "presence_penalty": 0.5}, 400,
     "presence_penalty"),
    ("chat", {"messages": chat("hi"), "use_beam_search": True, "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "frequency_penalty": -1}, 400,
     "frequency_penalty"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "min_p": 0.1}, 400, "min_p"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "min_tokens": 2}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "logit_bias": {"42": 3}}, 400, "logit_bias"),
    ("chat", {"messages": chat("hi"), "use_beam_search": True, "n": 2, "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "structured_outputs": {"regex": "a+"}}, 400,
     "structured_outputs"),
    ("chat", {"messages": chat("hi"), "use_beam_search": True, "n": 2, "tools": [WEATHER_TOOL],
              "tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"messages": chat("hi"), "use_beam_search": True, "tools": [WEATHER_TOOL],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 400, "tool_choice"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "stop": "x"}, 400, "stop"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "stop_token_ids": [5]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "length_penalty": "1"}, 400, "length_penalty"),
    ("completions", {"prompt": "hi", "use_beam_search": "yes"}, 400, "use_beam_search"),
    ("completions", {"prompt": "hi", "early_stopping": 1}, 400, "early_stopping"),
]


@pytest.mark.parametrize("route,body,status,param", BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, _, p) in enumerate(BAD)])
def test_bad_requests_get_openai_errors_and_change_nothing(url, memory, route, body, status, param):
    before = steps(url)["step_count"]
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=json.dumps(body), headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"], err
    assert steps(url)["step_count"] == before and memory.stats().used_blocks == 0


def test_oversized_body_and_unknown_routes_get_openai_errors(url):
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "' + b"a" * (1 << 20) + b'"}',
                   headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 413 and r.json()["error"]["message"]
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, f"{url}{path}")
        assert r.status_code == status and r.json()["error"]["message"]
    r = httpx.get(f"{url}/debug/steps", params={"since": "abc"})
    assert r.status_code == 401  # the key is checked first
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"},
                   headers=[("Authorization", f"Bearer {KEY_A}"), ("Authorization", "Bearer other")])
    assert r.status_code == 401


def test_neutral_values_of_unimplemented_parameters_are_accepted(oai):
    r = oai.chat.completions.create(model="smollm2", messages=chat("hi"), max_tokens=2, temperature=0,
                                    frequency_penalty=0, presence_penalty=0, logit_bias={}, user="someone")
    assert r.choices[0].message.content


def test_unset_sampling_fields_are_the_models_defaults_and_penalties_apply(url):
    """SmolLM2's GGUF sets no generation defaults: unset temperature, top_p and top_k are vLLM's
    (1, 1, off). Penalties change greedy text of a repetitive prompt."""
    def tokens(**body) -> list[int]:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "one two one two one two one", "max_tokens": 6,
                                                      "ignore_eos": True, "return_token_ids": True, **body},
                       headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    unset = tokens(seed=5)
    assert unset == tokens(seed=5, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    assert unset != tokens(seed=5, temperature=0.3)
    greedy = tokens(temperature=0)
    assert greedy != tokens(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0)


def test_logit_bias_min_tokens_and_min_p_act_on_greedy_output(url):
    """A +100 bias makes greedy pick its token every time; min_tokens keeps a stop id from being
    drawn or ending the output before it; min_p changes nothing under greedy."""
    def run(**body) -> tuple[list[int], str]:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "one two one two one two one", "max_tokens": 4,
                                                      "temperature": 0, "return_token_ids": True, **body},
                       headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["finish_reason"]

    plain, _ = run(ignore_eos=True)
    forced = next(t for t in (1234, 4321) if t not in plain)
    assert run(ignore_eos=True, logit_bias={str(forced): 100})[0] == [forced] * 4
    stop = plain[0]
    assert run(stop_token_ids=[stop]) == ([stop], "stop")
    held, _ = run(stop_token_ids=[stop], min_tokens=3)
    assert len(held) == 4 and stop not in held[:3]
    assert run(ignore_eos=True, min_p=0.9)[0] == plain


def test_keys_and_admin_routes(url, oai, stack):
    before = steps(url)["step_count"]
    body = {"model": "smollm2", "messages": chat("hi"), "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY_A}):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    assert steps(url)["step_count"] == before  # nothing was scheduled
    assert httpx.get(f"{url}/debug/steps", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 403
    assert httpx.get(f"{url}/debug/steps").status_code == 401
    (model,) = oai.models.list().data
    assert model.id == "smollm2" and model.model_extra["max_model_len"] == 512 * 16  # the whole pool: an admin lease
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "workers": {"ready": 2, "total": 2}}
    worker = urllib.parse.quote(stack.worker_addresses[1], safe="")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.post(f"{url}/admin/workers/{worker}/drain", headers={"Authorization": f"Bearer {KEY_A}"}) \
        .status_code == 403
    assert httpx.post(f"{url}/admin/workers/127.0.0.1%3A1/drain", headers=admin).status_code == 404
    r = httpx.post(f"{url}/admin/workers/{worker}/drain", headers=admin)
    assert r.status_code == 200 and r.json() == {"worker": stack.worker_addresses[1], "state": "draining",
                                                 "moved_sequences": 0}
    assert httpx.post(f"{url}/admin/workers/{worker}/undrain", headers=admin).json()["state"] == "ready"
    cli = [sys.executable, "-m", "client.ops.cli", "drain", stack.worker_addresses[1], "--url", url, "--api-key", ADMIN]
    for extra, state in (([], "draining"), (["--undrain"], "ready")):
        out = subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and json.loads(out.stdout)["state"] == state, out.stderr
    m = metrics(url)
    assert m[("pagedkv:workers_ready", ())] == 2 and m[("pagedkv:worker_failovers_total", ())] == 0
    assert not [k for k in m if k[0] == "pagedkv:host_tier_page_locked"]  # a CPU pool: nothing to page-lock
    assert {labels for name, labels in m if name == "pagedkv:recomputed_tokens_total"} == {
        (("reason", r),) for r in ("worker_failure", "preemption", "lease_lost")}


def test_metrics_move_by_the_requests(url, oai):
    before = metrics(url)
    prompt = [504, 3458, 282, 4649, 314, 11, 284]
    oai.completions.create(model="smollm2", prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    oai.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=0, n=2,
                           extra_body={"ignore_eos": True})
    after = metrics(url)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("pagedkv:prompt_tokens_total") == 2 * len(prompt)
    assert moved("pagedkv:generation_tokens_total") == 5 + 2 * 3
    assert moved("pagedkv:request_success_total", finished_reason="length") == 2
    assert moved("pagedkv:time_to_first_token_seconds_count") == 2
    assert moved("pagedkv:e2e_request_latency_seconds_count") == 2
    assert moved("pagedkv:time_per_output_token_seconds_count") == 4 + 4  # every token after each first
    assert moved("pagedkv:prefix_cache_queries_total") >= 2 * len(prompt) - 2
    assert after[("pagedkv:num_requests_running", ())] == 0 and after[("pagedkv:kv_cache_usage_perc", ())] == 0


def test_queue_limit_shutdown_and_pool_check(stack, tmp_path, memory):
    svc = pagedkv_process(["serve", "--memory", stack.memory.address, "--workers", stack.worker_addresses[0],
                           "--max-num-seqs", "1", "--max-queued-requests", "1"], tmp_path, "serve-small")
    url = f"http://{svc.address}"
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True}
    streamed: list[str] = []
    status: list[int] = []

    def stream() -> None:  # runs; cut by the shutdown below
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as r:
            streamed.extend(line for line in r.iter_lines() if line)

    def post() -> None:  # waits behind it (--max-num-seqs 1)
        status.append(httpx.post(f"{url}/v1/completions", json=body, timeout=600).status_code)

    threads = []
    for target, gauge in ((stream, "pagedkv:num_requests_running"), (post, "pagedkv:num_requests_waiting")):
        threads.append(threading.Thread(target=target))
        threads[-1].start()
        deadline = time.monotonic() + 120
        while metrics(url, key=None).get((gauge, ()), 0) < 1 and time.monotonic() < deadline:  # no keys: open
            time.sleep(0.05)
    r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # can never be queued: not a 429
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    # SIGTERM with both in flight: each ends with a 503 in the OpenAI body, and the server exits 0.
    assert svc.stop() == 0
    for t in threads:
        t.join(60)
    assert status == [503]
    assert streamed[-1] == "data: [DONE]" and json.loads(streamed[-2][6:])["error"]["code"] == "unavailable"
    assert memory.stats().used_blocks == 0
    refused = subprocess.run([sys.executable, "-m", "client.ops.cli", "serve", "--memory", stack.memory.address,
                              "--workers",
                              stack.worker_addresses[0], "--block-size", "32", "--no-prefix-caching", "--port", "0"],
                             capture_output=True, text=True, timeout=120, env={**os.environ})
    assert refused.returncode == 1 and "--block-size 32 (the pool's is 16)" in refused.stderr
    assert "--no-prefix-caching (it configures embedded services" in refused.stderr


def _children(pid: int) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]


def test_embedded_backends_are_restarted_and_stop_with_the_server(tmp_path):
    """A SIGKILLed embedded worker is reaped and started again at its address; the request that waited
    longer than the recovery timeout for it fails, and once it is back the next one succeeds. A
    SIGKILLed server leaves no child running (they watch their parent)."""
    env = {"PAGEDKV_HOME": str(private_home(tmp_path / "home")), "PAGEDKV_KV_CACHE_MEMORY": "64MiB"}
    svc = pagedkv_process(["serve", "--recovery-timeout", "1"], tmp_path, "serve-embedded", env=env,
                          timeout=START_TIMEOUT * 2)
    url = f"http://{svc.address}"
    children = _children(svc.pid)
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    try:
        assert len(children) == 2  # the memory service and one worker
        assert httpx.get(f"{url}/health").status_code == 200
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        (worker,) = [p for p in children if b"compute" in Path(f"/proc/{p}/cmdline").read_bytes()]
        os.kill(worker, signal.SIGKILL)
        down = httpx.post(f"{url}/v1/completions", json=body, timeout=120)  # the new one loads for longer than 1 s
        assert down.status_code == 503 and down.json()["error"]["code"] == "unavailable"
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert again.status_code == 200 and again.json()["choices"] == r.json()["choices"]
        assert gone(worker) and '"service_restarted"' in svc.log()
        now = _children(svc.pid)
        assert len(now) == 2 and worker not in now
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and health.json()["workers"] == {"ready": 1, "total": 1}
    except BaseException:
        svc.stop()
        raise
    svc.proc.kill()
    svc.proc.wait()
    deadline = time.monotonic() + 20
    while not all(gone(p) for p in now) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in now if not gone(p)] == []


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_request_done_in_its_prefill_step_fills_the_prefix_cache(url, oai):
    prompt = list(range(1000, 1080))  # 5 full blocks of 16
    oai.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
    before = metrics(url)[("pagedkv:prefix_cache_hits_total", ())]
    oai.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
    assert metrics(url)[("pagedkv:prefix_cache_hits_total", ())] - before == 64  # 4 blocks; the last is recomputed


def test_attaches_to_the_services_of_pagedkv_up(stack, tmp_path, memory):
    """No flags, no PAGEDKV_MEMORY: the state file of `pagedkv up` whose processes live is used."""
    home = private_home(tmp_path / "home")
    state = {"memory": {"address": stack.memory.address, "pid": stack.memory.pid},
             "workers": [{"address": a.address, "pid": a.pid} for a in stack.workers], "device": "cpu"}
    (home / "state.json").write_text(json.dumps(state))
    env = {"PAGEDKV_HOME": str(home), "PAGEDKV_MEMORY": "", "PAGEDKV_WORKERS": ""}
    svc = pagedkv_process(["serve"], tmp_path, "serve-up", env=env)
    try:
        assert subprocess.run(["pgrep", "-P", str(svc.pid)], capture_output=True).stdout == b""  # no children
        assert '"backends": "state file"' in svc.log()
        r = httpx.post(f"http://{svc.address}/v1/completions", json={"prompt": "The capital of France is",
                                                                     "max_tokens": 2, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        svc.stop()
    assert memory.stats().used_blocks == 0


def test_one_tenant_cannot_fill_the_server(stack, tmp_path, memory):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY_A: "tenant-a", KEY_B: "tenant-b"}))
    svc = pagedkv_process(["serve", "--memory", stack.memory.address, "--workers", stack.worker_addresses[0],
                           "--api-keys-file", str(keys), "--max-requests-per-tenant", "1"], tmp_path, "serve-tenants")
    url = f"http://{svc.address}/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    a, b = ({"Authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B))
    try:
        with httpx.stream("POST", url, json={**body, "max_tokens": 2000, "ignore_eos": True, "stream": True},
                          headers=a, timeout=120) as long:
            lines = long.iter_lines()  # kept: a dropped line iterator would close the stream
            for line in lines:
                if line.startswith("data: "):
                    break
            r = httpx.post(url, json=body, headers=a, timeout=120)
            assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_limit"
            assert httpx.post(url, json=body, headers=b, timeout=120).status_code == 200  # another tenant is served
            # The limit counts sequences: two samples of one prompt are two.
            r = httpx.post(url, json={**body, "n": 2, "temperature": 1.0, "seed": 1}, headers=b, timeout=120)
            assert r.status_code == 429 and "adds 2" in r.json()["error"]["message"]
        # The stream is gone: its slot is free again once the server has seen the disconnect.
        deadline = time.monotonic() + 30
        while (r := httpx.post(url, json=body, headers=a,
                               timeout=120)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200
    finally:
        svc.stop()
    assert memory.stats().used_blocks == 0


def complete(url: str, key: str, prompt: str, **extra) -> dict:
    """One greedy 3-token completion as ``key``'s tenant; the reply body."""
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, **extra},
                   headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


LONG = ("A paged KV cache splits each sequence's keys and values into fixed-size blocks, so that requests "
        "which begin with the same system prompt can share the blocks of that prompt instead of computing "
        "and storing them again for every caller of the server.")


def test_tenant_salts_isolate_the_prefix_cache(url):
    first = complete(url, KEY_A, LONG)
    n = first["usage"]["prompt_tokens"]
    shared = (n - 1) // BLOCK * BLOCK  # whole blocks; the block holding the last token is computed again
    assert n > 2 * BLOCK and cached_tokens(first) == 0
    again = complete(url, KEY_A, LONG)
    assert cached_tokens(again) == shared and again["choices"][0]["text"] == first["choices"][0]["text"]
    other = complete(url, KEY_B, LONG)  # the same prompt from another tenant: nothing from A's cache
    assert cached_tokens(other) == 0 and other["choices"][0]["text"] == first["choices"][0]["text"]
    # A request's own salt narrows sharing, never widens it: A's salted prompt is not A's unsalted one,
    # and B sending A's salt stays in B's namespace.
    assert cached_tokens(complete(url, KEY_A, LONG, cache_salt="shared-salt")) == 0
    assert cached_tokens(complete(url, KEY_B, LONG, cache_salt="shared-salt")) == 0
    assert cached_tokens(complete(url, KEY_A, LONG, cache_salt="shared-salt")) == shared


def test_a_cache_sharing_group_shares_its_prefix_cache(url, oai):
    prompt = "The tenants of one sharing group " + LONG
    first = complete(url, KEY_C, prompt)
    shared = (first["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert cached_tokens(first) == 0 and shared > 0
    second = complete(url, KEY_D, prompt)  # the group's other tenant hits C's blocks
    assert cached_tokens(second) == shared and second["choices"][0]["text"] == first["choices"][0]["text"]
    assert cached_tokens(complete(url, KEY_A, prompt)) == 0  # a tenant outside the group does not
    # Chat replies carry the figure too (openai's typed usage).
    r = oai.chat.completions.create(model="smollm2", messages=chat(prompt), max_tokens=1, temperature=0)
    again = oai.chat.completions.create(model="smollm2", messages=chat(prompt), max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens == \
        (again.usage.prompt_tokens - 1) // BLOCK * BLOCK


def test_cache_sharing_groups_are_checked_at_start(tmp_path, monkeypatch, capsys):
    from client.serve.config import parse_args

    keys = tmp_path / "keys.txt"
    keys.write_text("k1 t1\nk2 t2\nk3 t3\n")
    base = ["--api-keys-file", str(keys)]
    args = parse_args([*base, "--cache-sharing-group", "x=t1,t2", "--cache-sharing-group", "y=t3"])
    assert args.tenants.groups == {"t1": "x", "t2": "x", "t3": "y"}
    monkeypatch.setenv("PAGEDKV_CACHE_SHARING_GROUP", "x=t1,t2; y=t3")
    assert parse_args(base).tenants.groups == {"t1": "x", "t2": "x", "t3": "y"}
    assert parse_args([*base, "--cache-sharing-group", "z=t2"]).tenants.groups == {"t2": "z"}  # the flag wins
    monkeypatch.delenv("PAGEDKV_CACHE_SHARING_GROUP")
    refused = {
        ("x=t1,t2", "y=t2,t3"): "tenant 't2' is in group 'x' and in group 'y'",
        ("x=t1", "x=t2"): "group 'x' is given twice",
        ("x=t1,nobody",): "no API key maps to tenant 'nobody'",
        ("x=t1,t1",): "tenant 't1' is listed twice",
        ("x",): "expected NAME=TENANT[,TENANT...]",
        ("x=t1,",): "expected NAME=TENANT[,TENANT...]",
    }
    for groups, message in refused.items():
        with pytest.raises(SystemExit) as e:
            parse_args([*base, *(a for g in groups for a in ("--cache-sharing-group", g))])
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--cache-sharing-group", "x=default"])  # no keys: no tenants to group
    assert "groups need tenants" in capsys.readouterr().err
    # Tenant names the server gives a meaning of its own are refused.
    for reserved in ("admin", " "):
        keys.write_text(json.dumps({"k1": reserved}))
        with pytest.raises(SystemExit) as e:
            parse_args(base)
        assert e.value.code == 2 and "reserved or empty" in capsys.readouterr().err


def test_tokenize_detokenize_and_version_as_vllm_answers_them(url, hf_tokenizer):
    """vLLM's bodies: /tokenize {count, max_model_len, tokens} for a prompt (the tokenizer's own ids)
    or chat messages (the chat template's), /detokenize {prompt}, /version {version}; behind the
    tenant key; bad input a 400 naming the field."""
    key = {"Authorization": f"Bearer {KEY_A}"}
    text = "The capital of France is"
    r = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "prompt": text}, headers=key)
    assert r.status_code == 200, r.text
    want = hf_tokenizer.encode(text)
    body = r.json()
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] > len(want)
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": msgs, "return_token_strs": True}, headers=key)
    templated = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    templated = list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    assert r.json()["tokens"] == templated
    assert r.json()["token_strs"] == hf_tokenizer.convert_ids_to_tokens(templated)
    r = httpx.post(f"{url}/detokenize", json={"tokens": want}, headers=key)
    assert r.status_code == 200 and r.json() == {"prompt": hf_tokenizer.decode(want)}, r.text
    r = httpx.get(f"{url}/version", headers=key)
    assert r.status_code == 200 and r.json()["version"], r.text
    assert httpx.get(f"{url}/version").status_code == 401
    assert httpx.post(f"{url}/tokenize", json={"prompt": text}).status_code == 401
    for path, bad, param in [("/tokenize", {"prompt": text, "messages": msgs}, "prompt"),
                             ("/tokenize", {"prompt": [10**9]}, "prompt"),
                             ("/tokenize", {"prompt": text, "model": "gpt-4o"}, "model"),
                             ("/detokenize", {"tokens": [-1]}, "tokens"),
                             ("/detokenize", {"tokens": []}, "tokens"),
                             ("/detokenize", {"tokens": ["a"]}, "tokens")]:
        r = httpx.post(f"{url}{path}", json=bad, headers=key)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, bad, r.text)


def streamed_tool_calls(stream) -> tuple[str, list[tuple[str, str, str]], list[str]]:
    """(content, [(id, name, arguments)], finish reasons) joined from a chat stream's deltas: a
    call's first delta has its id, type and name, later ones only fragments of its arguments."""
    content, calls, finish = "", {}, []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.index not in calls:
                    assert t.id.startswith("call_") and t.type == "function" and t.function.name, t
                    calls[t.index] = [t.id, t.function.name, t.function.arguments or ""]
                else:
                    assert t.id is None and t.function.name is None and t.function.arguments, t
                    calls[t.index][2] += t.function.arguments
            if c.finish_reason:
                finish.append(c.finish_reason)
    return content, [tuple(v) for _, v in sorted(calls.items())], finish


def test_tool_calling_with_the_openai_package_two_turns(oai, url, hf_tokenizer):
    """The openai package's tool example on SmolLM2: tool_choice "required" (the grammar holds the
    output to vLLM's array schema) gives get_weather(location) as tool_calls, content null and
    finish_reason "tool_calls"; streamed, the deltas reassemble to the same call. The reply's
    message and the tool's result go back (role "tool"), the model answers in text, and its prompt
    held both (the chat route and /tokenize render it alike)."""
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    ask = dict(model="smollm2", tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
               temperature=0, max_tokens=48)
    r = oai.chat.completions.create(messages=messages, **ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert list(args) == ["location"] and isinstance(args["location"], str) and args["location"], args
    content, calls, finish = streamed_tool_calls(oai.chat.completions.create(messages=messages, stream=True, **ask))
    assert content == "" and finish == ["tool_calls"]
    assert [c[1:] for c in calls] == [("get_weather", call.function.arguments)]

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id,
                                  "content": json.dumps({"location": args["location"], "temperature_c": 22})}]
    r2 = oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                                     temperature=0, max_tokens=8, extra_body={"return_token_ids": True})
    answer = r2.choices[0]
    assert answer.message.content and not answer.message.tool_calls and answer.finish_reason in ("stop", "length")
    prompt = r2.model_extra["prompt_token_ids"]
    text = hf_tokenizer.decode(prompt)
    assert (f'<|im_start|>assistant\n<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}'
            f'\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{messages[-1]["content"]}'
            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in text and "# Tools" in text
    sent = [m if isinstance(m, dict) else json.loads(m.model_dump_json()) for m in messages]
    r = httpx.post(f"{url}/tokenize", json={"messages": sent, "tools": [WEATHER_TOOL]},
                   headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 200 and r.json()["tokens"] == prompt, r.text


def test_a_named_function_is_called_with_its_parameters_schema(oai):
    """tool_choice naming a function: the output is that function's arguments (its parameters
    schema), the call is made, and the finish reason stays "stop" (OpenAI's)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(model="smollm2", messages=chat("Weather in Rome?"), tools=[WEATHER_TOOL],
                                    tool_choice=named, temperature=0, max_tokens=32)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None and call.function.name == "get_weather"
    assert list(json.loads(call.function.arguments)) == ["location"]


@pytest.fixture(scope="module")
def library(stack):
    """The client library on the module server's stack, with the server's step budget."""
    with Client(stack.memory.address, stack.worker_addresses, max_num_batched_tokens=256) as c:
        yield c


BEAM_PROMPTS = ["The capital of France is", "Once upon a time, a little robot"]


@pytest.mark.parametrize("n,extra", [(2, {"length_penalty": 0.5, "early_stopping": True}), (3, {})],
                         ids=["n2-early", "n3"])
def test_beam_search_over_http_equals_the_client_library(url, library, memory, n, extra):
    """vLLM's use_beam_search on /v1/completions: n beams, n choices per prompt best first, equal to
    Client.generate with num_beams = n; temperature, top_p and seed do nothing."""
    body = {"model": "smollm2", "prompt": BEAM_PROMPTS, "n": n, "use_beam_search": True, "max_tokens": 6,
            "temperature": 0.7, "top_p": 0.9, "seed": 3, "repetition_penalty": 1.0, "return_token_ids": True,
            **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    ref = library.generate(BEAM_PROMPTS, SamplingParams(num_beams=n, n=n, max_tokens=6, **extra))
    want = [(p * n + o.index, o.text, o.token_ids, o.finish_reason) for p, out in enumerate(ref) for o in out.outputs]
    got = [(c["index"], c["text"], c["token_ids"], c["finish_reason"]) for c in reply["choices"]]
    assert got == want
    assert [c[0] for c in got] == list(range(2 * n))
    for p in range(2):
        assert len({tuple(c[2]) for c in got[p * n:(p + 1) * n]}) == n  # n different beams
    assert reply["usage"]["completion_tokens"] == sum(len(c[2]) for c in got)
    assert memory.stats().used_blocks == 0


def test_beam_search_on_chat_and_its_stream_equal_the_client_library(oai, library):
    """Chat completions take use_beam_search too (as vLLM's); a stream sends the finished beams;
    ignore_eos keeps beams going past the end-of-sequence token (2)."""
    msgs = chat("Is the sky blue? Answer yes or no.")
    for ignore_eos in (False, True):
        kw = dict(model="smollm2", messages=msgs, n=2, max_tokens=6,
                  extra_body={"use_beam_search": True, "ignore_eos": ignore_eos, "return_token_ids": True})
        (ref,) = library.generate([msgs], SamplingParams(num_beams=2, n=2, max_tokens=6, ignore_eos=ignore_eos))
        want = [(o.text, o.token_ids, o.finish_reason) for o in ref.outputs]
        reply = oai.chat.completions.create(**kw)
        assert [(c.message.content, c.model_extra["token_ids"], c.finish_reason) for c in reply.choices] == want
        if ignore_eos:
            assert all(len(t) == 6 and r == "length" for _, t, r in want) and any(2 in t for _, t, _ in want)
        else:
            assert "stop" in [r for _, _, r in want]  # a beam ended at EOS
        if not ignore_eos:
            texts = ["", ""]
            for chunk in oai.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
            assert texts == [t for t, _, _ in want]
