"""The client library against real service processes: outputs equal transformers, scheduling is visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.model_fixtures import CHATS, hf_greedy_tokens

from client import Client, SamplingParams
from client.backend import Backend
from client.engine.core import Engine
from client.engine.scheduler import SchedulerConfig
from client.request import Request
from client.services import MemoryClient, WorkerClient
from client.tokenizer import encode_prompt
from pagedkv.model.tokenizer import load_tokenizer


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def llm(stack):
    with Client(stack.memory.address, stack.worker_addresses) as c:
        yield c


@pytest.fixture
def engine(stack):
    """An engine driven step by step from the test (the Client runs the same one on a thread)."""
    memory = MemoryClient(stack.memory.address)
    workers = [WorkerClient(a) for a in stack.worker_addresses]
    eng = Engine(memory, workers, load_tokenizer("smollm2"), config=SchedulerConfig(max_num_batched_tokens=256))
    yield eng
    eng.close()
    memory.close()


def run_to_end(engine: Engine, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_new: int, **kw):
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, pad_token_id=2, **kw)
    return out


def test_greedy_chat_equals_transformers(llm, hf_model):
    outs = llm.generate([chat(c) for c in CHATS], SamplingParams(temperature=0, max_tokens=24))
    for text, out in zip(CHATS, outs):
        ref = hf_greedy_tokens(hf_model, out.prompt_token_ids, 24)
        got = out.outputs[0].token_ids
        assert got == ref, f"{text!r}: {got} != {ref}"
        assert out.outputs[0].finish_reason == ("stop" if ref[-1] == 2 else "length")
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    s = llm.stats()
    assert s.used_blocks == 0 and s.available_blocks == s.total_blocks


def test_requests_pinned_to_least_loaded_worker(llm):
    handles = [llm.submit(chat(c), SamplingParams(temperature=0, max_tokens=4)) for c in CHATS[:2]]
    [h.result() for h in handles]
    assert {h.request.worker for h in handles} == {0, 1}


def test_continuous_batching_step_trace(engine):
    tok = engine.tokenizer
    long = Request("long", encode_prompt(tok, chat(CHATS[3])),
                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    short = Request("short", encode_prompt(tok, chat(CHATS[0])),
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add(long)
    for _ in range(4):  # prefill + 3 decode steps
        engine.step()
    joined_at = engine.step_count
    engine.add(short)  # submitted while `long` is decoding
    run_to_end(engine)
    trace = list(engine.traces)
    # It joins the running batch at the very next step, beside the decoding request.
    assert set(trace[joined_at].request_ids) == {long.request_id, short.request_id}
    done = next(t.step for t in trace if short.request_id in t.finished)
    assert done == joined_at + 2  # prefill (1st token) + 2 decode steps
    # And leaves at once: the next step runs only the long request.
    assert trace[done + 1].request_ids == [long.request_id]
    assert all(len(s.generated) == 12 for s in long.seqs) and len(short.seqs[0].generated) == 3
    assert engine.memory.stats().used_blocks == 0


@pytest.mark.parametrize("fork_calls", ["one", "one per child"])
def test_parallel_sampling_shares_prompt_blocks(engine, llm, fork_calls, monkeypatch):
    if fork_calls == "one per child":  # as when a step forks more children than one call may create
        monkeypatch.setattr("client.engine.slots.MAX_FORK_CHILDREN", 1)
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=3, max_tokens=10, ignore_eos=True)
    ids = encode_prompt(tok, chat("Tell me a story about a dragon and a library, please."))
    full_blocks = (len(ids) - 1) // engine.block_size
    assert full_blocks >= 2
    req = Request("story", ids, params)
    engine.add(req)
    max_shared = 0
    while engine.has_work():
        engine.step()
        seqs = engine.memory.sequences(engine.lease.lease_id)
        if len(seqs) == 3:
            shared = [b for b, rc in zip(seqs[0].block_ids, seqs[0].ref_counts) if rc == 3]
            assert all(b in s.block_ids for s in seqs for b in shared)
            max_shared = max(max_shared, len(shared))
    assert max_shared == full_blocks  # every full prompt block shared by the three samples
    samples = [s.generated for s in sorted(req.seqs, key=lambda s: s.index)]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1
    # Each sample equals a solo run with its seed.
    for i, sample in enumerate(samples):
        solo = SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, n=1, max_tokens=10, ignore_eos=True)
        (out,) = llm.generate([chat("Tell me a story about a dragon and a library, please.")], solo)
        assert out.outputs[0].token_ids == sample, f"sample {i} differs from its solo run"


@pytest.mark.parametrize("prompt", ["What is the capital of France?", "Name a fruit."])
def test_beam_search_equals_transformers(engine, hf_model, prompt):
    ids = encode_prompt(engine.tokenizer, chat(prompt))
    params = SamplingParams(num_beams=4, length_penalty=1.0, early_stopping=True, max_tokens=16)
    req = Request(prompt, ids, params)
    engine.add(req)
    saw_sharing = False
    while engine.has_work():
        engine.step()
        seqs = engine.memory.sequences(engine.lease.lease_id)
        saw_sharing |= len(seqs) > 1 and any(rc > 1 for s in seqs for rc in s.ref_counts)
    assert saw_sharing, "beams never shared a block"
    best = req.beam.best(1)[0]
    ref = hf_generate(hf_model, ids, 16, num_beams=4, length_penalty=1.0, early_stopping=True,
                      output_scores=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, len(ids):].tolist()
    while ref_tokens and ref_tokens[-1] == 2 and len(ref_tokens) > len(best.tokens):
        ref_tokens.pop()  # padding after EOS
    assert best.tokens == ref_tokens
    assert best.score == pytest.approx(float(ref.sequences_scores[0]), abs=1e-3)
    assert engine.memory.stats().used_blocks == 0


@pytest.mark.parametrize("length_penalty", [1e308, -1e308, 2000.0, -2000.0, 1.0])
def test_beam_scores_of_any_finite_length_penalty_are_transformers(length_penalty):
    """``sum_logprobs / generated_len ** length_penalty`` as transformers' float tensors compute it:
    a power past the float range scores -0.0, one below it -inf; the search goes on (no
    OverflowError or ZeroDivisionError failing the request)."""
    from client.engine.beam import BeamState
    from client.request import Seq

    state = BeamState(num_beams=2, length_penalty=length_penalty, early_stopping=False, max_tokens=3, eos_ids={2})
    beams = [Seq(0, [5, 6], 1, beam_score=-0.25)]  # one generated token: candidates have generated length 2
    running = state.step(beams, [[(2, -0.5), (7, -1.0), (8, -2.0), (9, -3.0)]])
    assert [(tok, score) for _, tok, score in running] == [(7, -1.25), (8, -2.25)]
    (hyp,) = state.finished
    ref = torch.tensor(-0.75, dtype=torch.float64) / torch.tensor(2.0, dtype=torch.float64) ** length_penalty
    assert hyp.tokens == [6, 2] and hyp.sum_logprobs == -0.75
    assert hyp.score == float(ref) and str(hyp.score) == str(float(ref))  # -0.0 and -inf as torch has them


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory):
    """A pool too small for four requests at once: 14 blocks of 16 tokens, all of them one lease's
    (the pool runs out, not the lease's quota)."""
    from conftest import local_stack

    with local_stack(tmp_path_factory.mktemp("small"), ["--num-blocks", "14", "--block-size", "16",
                                                        "--max-blocks-per-lease", "none"], name="small") as s:
        yield s


def test_preemption_gives_the_unconstrained_outputs(small_stack, llm):
    prompts = [chat(c) for c in CHATS]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with Client(small_stack.memory.address, small_stack.worker_addresses) as small:
        got = small.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == expected
        assert small.engine.preemption.preemptions > 0
        stats = small.stats()
        assert stats.preemptions == small.engine.preemption.preemptions
        published = small.engine_stats()  # what pagedkv serve reads (client.backend)
        assert isinstance(small, Backend) and published.preemptions == small.engine.preemption.preemptions
        assert published.step_count == small.engine.step_count and published.lease_id == small.lease_id
        assert (published.num_running, published.num_waiting) == (0, 0)
        assert sum(t.num_tokens for t in small.step_logs()[small.memory.address].steps) > 0
        assert stats.used_blocks == 0 and stats.available_blocks == 14


def test_cancelled_stream_frees_blocks_before_next_step(llm):
    keep = llm.submit(chat(CHATS[1]), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stream = llm.stream(chat(CHATS[0]), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for i, _ in enumerate(stream):
        if i == 2:
            break
    handle_req = [r for r in llm.engine.scheduler.running if r.prompt == chat(CHATS[0])]
    seq_ids = {s.seq_id for r in handle_req for s in r.seqs}
    stream.close()  # cancels
    before = llm.engine.step_count
    deadline = time.monotonic() + 60
    while llm.engine.step_count < before + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    live = {s.seq_id for s in llm.memory.sequences(llm.lease_id)}
    assert seq_ids and not (seq_ids & live), "the cancelled request still holds blocks after a step"
    keep.result()
    assert llm.stats().used_blocks == 0


KILLED_CLIENT = r"""
import sys
from client import Client, SamplingParams
llm = Client(sys.argv[1], [sys.argv[2]], lease_ttl=1.0)
for i, out in enumerate(llm.stream([{"role": "user", "content": "Count to one hundred."}],
                                   SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))):
    if i == 3:
        print("streaming", flush=True)
"""


def test_killed_client_blocks_freed_when_lease_expires(stack):
    memory = MemoryClient(stack.memory.address)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, stack.memory.address, stack.worker_addresses[0]],
                            stdout=subprocess.PIPE, env={**os.environ, "PAGEDKV_LOG_LEVEL": "error"})
    try:
        assert proc.stdout.readline().strip() == b"streaming"
        assert memory.stats().used_blocks > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while memory.stats().used_blocks > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = memory.stats()
        assert stats.used_blocks == 0 and stats.available_blocks == stats.total_blocks
    finally:
        proc.kill()
        memory.close()


def test_bad_sampling_params_raise_before_sending():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(n=0), dict(max_tokens=0), dict(num_beams=50),
                dict(logprobs=99),
                dict(stop_token_ids=[3, -2])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


async def test_async_client_generate_and_stream(stack):
    from client import AsyncClient

    async with await AsyncClient.connect(stack.memory.address, stack.worker_addresses) as llm:
        (out,) = await llm.generate([chat(CHATS[0])], SamplingParams(temperature=0, max_tokens=12))
        assert out.outputs[0].text == "The capital of France is Paris."
        params = SamplingParams(temperature=0, max_tokens=12)
        texts = [o.outputs[0].text async for o in llm.stream(chat(CHATS[0]), params)]
        assert texts[-1] == out.outputs[0].text and len(texts) > 3
        assert (await llm.stats()).used_blocks == 0


def test_cli_generate_and_stats(stack):
    env = {
        **os.environ,
        "PAGEDKV_MEMORY": stack.memory.address,
        "PAGEDKV_WORKERS": ",".join(stack.worker_addresses),
        "PAGEDKV_LOG_LEVEL": "error",
        "COLUMNS": "160",
        "PAGEDKV_ADMIN_TOKEN_FILE": stack.memory.info["admin_token_file"],
    }  # stats shows every lease's sequences
    out = subprocess.run(
        [sys.executable, "-m", "client.ops.cli", "generate", CHATS[0], "--chat", "--max-tokens", "12"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "client.ops.cli",
            "generate",
            "Name a color.",
            "--chat",
            "--n",
            "2",
            "--temperature",
            "0.9",
            "--seed",
            "3",
            "--max-tokens",
            "6",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.count("--- [") == 2, out.stdout + out.stderr
    stats = subprocess.run(
        [sys.executable, "-m", "client.ops.cli", "stats"], env=env, capture_output=True, text=True, timeout=120
    )
    assert stats.returncode == 0 and "KV-cache pool" in stats.stdout and "512" in stats.stdout
    no_token = subprocess.run(
        [sys.executable, "-m", "client.ops.cli", "stats"],
        env={**env, "PAGEDKV_ADMIN_TOKEN_FILE": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        no_token.returncode == 1
        and "KV-cache pool" in no_token.stdout
        and "no admin token at /nonexistent" in no_token.stderr
    )
    bad = subprocess.run(
        [sys.executable, "-m", "client.ops.cli", "generate", "x", "--temperature", "-1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "temperature" in bad.stderr
