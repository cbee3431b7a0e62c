"""A model's generation_config.json through the real services: its sampling defaults apply to the
fields a request leaves unset (Client and HTTP, as vLLM's default generation_config="auto"), and
every end-of-sequence id of a Llama-3-style config (three of them, in config.json and
generation_config.json) stops generation."""

from __future__ import annotations

import itertools
import shutil

import httpx
import pytest
import torch
from conftest import local_stack, pagedkv_process
from helpers.tiny_llama import BASE_PROMPT, echo_prompt, reference_greedy, set_json

from client.api import Client
from client.params import VLLM_DEFAULTS, SamplingParams

#: generation_config.json's defaults (Qwen2.5-Instruct-like values, a stronger repetition penalty).
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.3}
MEMORY_ARGS = ["--num-blocks", "64", "--block-size", "16"]


# ------------------------------------------------------------------ resolving, without services

def test_unset_fields_resolve_from_the_model_then_vllm():
    p = SamplingParams(seed=4)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (None, None, None, None) and not p.resolved
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    plain = p.with_defaults({})
    assert plain.resolved and (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1, 1, 0, 1)
    model = p.with_defaults({"temperature": 0.5, "top_k": 7})
    assert (model.temperature, model.top_p, model.top_k, model.repetition_penalty, model.seed) == (0.5, 1, 7, 1, 4)
    mine = SamplingParams(temperature=0, top_k=3).with_defaults(DEFAULTS)
    assert (mine.temperature, mine.top_p, mine.top_k, mine.repetition_penalty) == (0, 0.9, 3, 1.3) and mine.greedy
    assert mine.with_defaults({"temperature": 2.0}) is mine  # resolved once
    with pytest.raises(ValueError, match="top_p"):
        p.with_defaults({"top_p": 0.0})


def test_model_defaults_come_from_the_proto_fields_it_sets():
    from client.params import model_defaults
    from pagedkv.compute.v1 import compute_service_pb2 as cpb

    assert model_defaults(cpb.GenerationDefaults()) == {}
    got = model_defaults(cpb.GenerationDefaults(temperature=0.7, top_k=-1, repetition_penalty=1.05))
    assert got == {"temperature": pytest.approx(0.7), "top_k": 0, "repetition_penalty": pytest.approx(1.05)}


@pytest.mark.parametrize("kwargs,match", [
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty"),  # 0 in float32
    ({"repetition_penalty": 1e39}, "repetition_penalty"),  # inf in float32
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"presence_penalty": None}, "presence_penalty"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"num_beams": 2, "presence_penalty": 0.5}, "beam search"),
])
def test_bad_client_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_step_carries_the_history_only_where_a_penalty_reads_it():
    from client.engine.scheduler import ScheduledSeq
    from client.engine.worker_step import build_steps
    from client.request import Request

    def step(params: SamplingParams, computed: int, new: int | None = None) -> object:
        req = Request([5, 6, 7], [5, 6, 7], params.with_defaults({}))
        req.worker, seq = 0, req.seqs[0]
        seq.tokens += [8, 9]  # two generated
        seq.seq_id, seq.block_table, seq.num_computed = 1, [0], computed
        (s,) = build_steps([ScheduledSeq(req, seq, new or 5 - computed)], {}, 0)[0].sequences
        return s

    s = step(SamplingParams(repetition_penalty=1.5), 4)
    assert (list(s.prompt_token_ids), list(s.output_token_ids), s.output_index) == ([5, 6, 7], [8, 9], 2)
    assert s.sampling.repetition_penalty == pytest.approx(1.5) and not s.sampling.HasField("presence_penalty")
    s = step(SamplingParams(temperature=0.5, frequency_penalty=0.25, presence_penalty=-1), 4)
    assert (list(s.prompt_token_ids), list(s.output_token_ids)) == ([], [8, 9])
    assert (s.sampling.frequency_penalty, s.sampling.presence_penalty) == (0.25, -1)
    assert not s.sampling.HasField("repetition_penalty")
    s = step(SamplingParams(), 4)
    assert not s.prompt_token_ids and not s.output_token_ids
    s = step(SamplingParams(repetition_penalty=1.5), 0, 3)  # mid-recompute: nothing sampled, nothing sent
    assert s.skip_sampling and not s.prompt_token_ids and not s.output_token_ids
    with pytest.raises(ValueError, match="model's defaults"):
        from client.engine.worker_step import sampling

        req = Request([5], [5], SamplingParams())
        sampling(req, req.seqs[0])


# ------------------------------------------------------------------ through the real services

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model):
    """(directory, transformers model): the tiny Llama with DEFAULTS in its generation_config.json."""
    path = tmp_path_factory.mktemp("generation") / "model"
    shutil.copytree(tiny_model[0], path)
    model = tiny_model[1]
    set_json(path, "generation_config.json", **DEFAULTS, do_sample=True)
    return path, model


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    stack = local_stack(tmp_path_factory.mktemp("stack"), MEMORY_ARGS, name="defaults")
    stack.model = str(model_dir[0])
    with stack, Client(stack.memory_address, stack.worker_addresses) as c:
        yield c


def tokens(client, prompt, max_tokens: int = 24, **kw) -> list[int]:
    (out,) = client.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))
    return out.outputs[0].token_ids


def test_unset_fields_take_the_models_defaults(client, model_dir):
    info = client.engine.model_info
    assert info.generation_defaults.HasField("temperature") and "do_sample" in info.ignored_generation_keys
    assert client.engine.generation_defaults == pytest.approx(DEFAULTS)
    prompt = BASE_PROMPT
    unset = tokens(client, prompt, seed=3)
    assert unset == tokens(client, prompt, seed=3, **DEFAULTS)
    assert unset != tokens(client, prompt, seed=3, **VLLM_DEFAULTS)
    # One field set, the others the model's.
    assert tokens(client, prompt, seed=3, top_k=5) == tokens(client, prompt, seed=3, **{**DEFAULTS, "top_k": 5})
    # Greedy takes the model's repetition penalty too: transformers with it applied by hand.
    echo = echo_prompt(model_dir[1])
    greedy = tokens(client, echo, temperature=0)
    assert greedy == reference_greedy(model_dir[1], echo, 24, repetition_penalty=DEFAULTS["repetition_penalty"])
    assert greedy != tokens(client, echo, temperature=0, repetition_penalty=1.0)


def test_a_users_params_are_resolved_on_a_copy_and_beam_search_ignores_the_models_defaults(client):
    params = SamplingParams(max_tokens=4, seed=1)
    handle = client.submit(BASE_PROMPT, params)
    handle.result()
    assert params.temperature is None and params.repetition_penalty is None  # the caller's object is unchanged
    assert handle.request.params.temperature == pytest.approx(DEFAULTS["temperature"])
    beams = SamplingParams(max_tokens=6, num_beams=2, ignore_eos=True).with_defaults(client.engine.generation_defaults)
    assert (beams.temperature, beams.top_k, beams.repetition_penalty) == (1.0, 0, 1.0)
    (out,) = client.generate([BASE_PROMPT], SamplingParams(max_tokens=6, num_beams=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="beam search takes no repetition"):
        SamplingParams(num_beams=2, repetition_penalty=1.2)


def test_the_http_front_applies_the_same_defaults(client, tmp_path):
    workers = ",".join(w.address for w in client.workers)
    svc = pagedkv_process(["serve", "--memory", client.memory.address, "--workers", workers], tmp_path, "serve")
    try:
        url = f"http://{svc.address}/v1/completions"

        def http(**body) -> list[int]:
            r = httpx.post(url, json={"prompt": BASE_PROMPT, "max_tokens": 24, "ignore_eos": True,
                                      "return_token_ids": True, **body}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        prompt = BASE_PROMPT
        assert http(seed=3) == tokens(client, prompt, seed=3)
        assert http(seed=3, temperature=None, top_p=None) == tokens(client, prompt, seed=3)  # null = unset
        assert http(seed=3, **VLLM_DEFAULTS) == tokens(client, prompt, seed=3, **VLLM_DEFAULTS)
        penalties = dict(temperature=0, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=1.0)
        assert http(**penalties) == tokens(client, prompt, **penalties)
        r = httpx.post(url, json={"prompt": prompt, "presence_penalty": 2.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty"
    finally:
        svc.stop()


def _choose_eos(runs: list[list[int]]) -> list[tuple[int, int, int]]:
    """Three (run, position, token) with distinct tokens such that in each chosen run the first of
    the three tokens to appear is its own, at its position; the latest such positions before the
    run's last two (a stop there is no length limit)."""
    best, best_key = None, None
    for picks in itertools.combinations(range(len(runs)), 3):
        for pos in itertools.product(*(range(len(runs[r]) - 2) for r in picks)):
            toks = [runs[r][p] for r, p in zip(picks, pos)]
            if len(set(toks)) < 3:
                continue
            if any(set(runs[r][:p]) & set(toks) for r, p in zip(picks, pos)):
                continue
            key = sorted(pos)
            if best_key is None or key > best_key:
                best, best_key = list(zip(picks, pos, toks)), key
    assert best is not None, "no three distinct produced tokens stop three runs"
    return best


def test_every_end_of_sequence_id_stops_generation(client, model_dir, tmp_path):
    """Llama 3.1 style: config.json lists three eos ids, generation_config.json two of them.
    Greedy runs (eos ignored) show which tokens the model produces; three of them, each the first
    of the three in its own run, become the eos ids; after a restart each run stops at its own."""
    g = torch.Generator().manual_seed(7)
    prompts = [[1, *torch.randint(100, 49152, (5,), generator=g).tolist()] for _ in range(6)]
    greedy = dict(temperature=0, repetition_penalty=1.0, max_tokens=12)
    runs = [tokens(client, p, **greedy) for p in prompts]
    chosen = _choose_eos(runs)
    eos = [t for _, _, t in chosen]
    llama3 = tmp_path / "llama3"
    shutil.copytree(model_dir[0], llama3)
    set_json(llama3, "config.json", eos_token_id=eos)
    set_json(llama3, "generation_config.json", eos_token_id=[eos[0], eos[2]])
    stack = local_stack(tmp_path, MEMORY_ARGS, name="llama3")
    stack.model = str(llama3)
    with stack, Client(stack.memory_address, stack.worker_addresses) as c:
        assert list(c.engine.model_info.eos_token_ids) == eos
        for run, pos, tok in chosen:
            (out,) = c.generate([prompts[run]], SamplingParams(temperature=0, repetition_penalty=1.0, max_tokens=12))
            o = out.outputs[0]
            assert o.token_ids == runs[run][:pos + 1] and o.token_ids[-1] == tok, (run, pos, tok)
            assert o.finish_reason == "stop" and len(o.token_ids) < 12
            (out,) = c.generate([prompts[run]], SamplingParams(ignore_eos=True, **greedy))
            assert out.outputs[0].token_ids == runs[run] and out.outputs[0].finish_reason == "length"
