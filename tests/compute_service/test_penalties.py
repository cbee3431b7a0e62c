"""Repetition, presence and frequency penalties (vLLM's semantics) on the worker: the penalised
logits against a float64 reference written here one token at a time, the sampler's order
(penalties before greedy and the draws, logprobs raw), the step's token history and its checks,
and greedy through the real services against transformers with the penalties applied by hand."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from helpers.tiny_llama import echo_prompt, reference_greedy

from compute_service.penalties import TokenHistory, penalised
from compute_service.sampling import SamplingParams, sample
from compute_service.step_inputs import build_step_inputs
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.runtime.errors import InvalidArgumentError

VOCAB = 300


def _reference(row: list[float], prompt: list[int], output: list[int], rep: float, pres: float,
               freq: float) -> list[float]:
    """vLLM's apply_penalties for one row, float64, one vocabulary entry at a time."""
    out = []
    for v, x in enumerate(row):
        count = sum(1 for t in output if t == v)
        if v in prompt or count:
            x = x / rep if x > 0 else x * rep
        x -= freq * count
        if count:
            x -= pres
        out.append(x)
    return out


def _rows(seed: int = 0):
    """Six rows: penalties of every kind, with repeats, prompt/output overlap, and rows without."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, generator=g) * 3
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    rows = [  # (params, prompt, output)
        (SamplingParams(temperature=0.0, repetition_penalty=1.7), ids(12), ids(9) + [5, 5, 5]),
        (SamplingParams(temperature=0.0), ids(4), ids(4)),  # no penalty: untouched
        (SamplingParams(temperature=0.8, presence_penalty=1.5, frequency_penalty=-0.7, seed=3), ids(3), ids(30)),
        (SamplingParams(temperature=0.0, repetition_penalty=0.6, presence_penalty=-2.0, frequency_penalty=2.0),
         ids(20), ids(40)),
        (SamplingParams(temperature=1.2, top_k=20, frequency_penalty=1.0, seed=9), ids(5), []),  # nothing generated
        (SamplingParams(temperature=0.0, repetition_penalty=3.0), [int(i) for i in logits[5].topk(8).indices], [7]),
    ]
    return logits, rows


def _history(rows) -> TokenHistory:
    pen = [i for i, (p, _, _) in enumerate(rows) if p.has_penalties]
    return TokenHistory(pen, [np.array(rows[i][1] if rows[i][0].repetition_penalty != 1 else [], dtype=np.int64)
                              for i in pen], [np.array(rows[i][2], dtype=np.int64) for i in pen])


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_penalised_logits_equal_the_float64_reference(device):
    logits, rows = _rows()
    got = penalised(logits.to(device), [p for p, _, _ in rows], _history(rows)).cpu()
    assert torch.equal(logits, _rows()[0]), "the raw logits are not changed"
    for i, (p, prompt, output) in enumerate(rows):
        ref = _reference(logits[i].double().tolist(), prompt, output, p.repetition_penalty, p.presence_penalty,
                         p.frequency_penalty)
        torch.testing.assert_close(got[i].double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-6, atol=1e-5,
                                   msg=f"row {i}")
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[5].argmax(), logits[5].argmax())  # the prompt's top tokens lost their lead


def test_penalties_come_before_greedy_and_draws_and_logprobs_stay_raw():
    logits, rows = _rows(1)
    params = [p for p, _, _ in rows]
    for p in params:
        p.logprobs = 3
    out = sample(logits, params, [len(o) for _, _, o in rows], _history(rows))
    # The same draws from the reference's penalised logits with the penalties off.
    ref = torch.stack([torch.tensor(_reference(logits[i].double().tolist(), pr, o, p.repetition_penalty,
                                               p.presence_penalty, p.frequency_penalty)) for i, (p, pr, o) in
                       enumerate(rows)]).float()
    plain = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed) for p in params]
    assert out.token_ids.tolist() == sample(ref, plain, [len(o) for _, _, o in rows]).token_ids.tolist()
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert out.token_ids[greedy].tolist() == ref[greedy].argmax(-1).tolist()
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, raw.topk(3, dim=-1).values)


def test_an_overflowing_penalty_or_temperature_samples_the_largest_entries_not_nan():
    """A tiny positive repetition penalty (or temperature) sends positive logits to +inf in
    float32; the draw must still be among the largest entries (not token 0 from NaN)."""
    logits = torch.full((2, VOCAB), -1.0)
    logits[:, 17], logits[:, 42] = 5.0, 3.0  # both in the history, both positive: both overflow
    params = [SamplingParams(temperature=0.7, repetition_penalty=1e-40, seed=s) for s in (1, 2)]
    hist = TokenHistory([0, 1], [np.array([17, 42, 9]), np.array([17, 42])], [np.array([], dtype=np.int64)] * 2)
    drawn = {int(t) for pos in range(20) for t in sample(logits, params, [pos, pos], hist).token_ids}
    assert drawn <= {17, 42} and drawn, drawn  # every draw is one of the two +inf entries
    tiny_t = sample(logits[:1], [SamplingParams(temperature=1e-40, seed=0)], [0]).token_ids
    assert tiny_t.tolist() == [17]


def test_a_penalty_without_its_history_is_an_error():
    logits, rows = _rows()
    params = [p for p, _, _ in rows]
    with pytest.raises(ValueError, match="penalty"):
        sample(logits, params, [0] * 6)


@pytest.mark.parametrize("kwargs,match", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
])
def test_bad_penalties_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------ the step's token history

def _step(*seqs) -> pb.StepRequest:
    """A step of sequences (seq_id, tokens, start, sampling, prompt, output, output_index), 4-token blocks."""
    return pb.StepRequest(sequences=[pb.StepSequence(
        seq_id=i, token_ids=t, positions=range(p, p + len(t)), block_ids=range(8 * i, 8 * i + 8), sampling=sp,
        prompt_token_ids=pr, output_token_ids=o, output_index=n) for i, (t, p, sp, pr, o, n) in enumerate(seqs)])


def _build(req):
    return build_step_inputs(req, block_size=4, num_blocks=64, vocab_size=VOCAB, device="cpu")


def test_step_history_reaches_the_sampler_for_the_rows_with_penalties():
    rep = pb.SamplingParams(repetition_penalty=1.5)
    freq = pb.SamplingParams(temperature=0.7, frequency_penalty=0.5, seed=1)
    req = _step(
        ([5], 6, rep, [1, 2, 3, 4], [9, 8, 5], 3),  # decode: 4 prompt + 3 generated = its 7 tokens
        ([1, 2, 3], 0, pb.SamplingParams(), [], [], 0),  # no penalty
        ([7], 9, freq, [], [7, 7, 3, 1], 4),  # presence/frequency read the output only
        ([1, 2, 3], 0, rep, [1, 2, 3], [], 0),  # prefill: nothing generated yet
    )
    req.sequences[1].skip_sampling = True  # a chunk mid-prefill: not sampled, no history read
    inputs = _build(req)
    h = inputs.history
    assert inputs.sample_rows == [0, 2, 3] and h.rows == [0, 1, 2]
    assert [a.tolist() for a in h.prompt] == [[1, 2, 3, 4], [], [1, 2, 3]]
    assert [a.tolist() for a in h.output] == [[9, 8, 5], [7, 7, 3, 1], []]
    assert inputs.sampling[1].frequency_penalty == 0.5 and inputs.sampling[0].repetition_penalty == 1.5
    assert _build(_step(([5], 6, pb.SamplingParams(), [], [], 3))).history is None


BAD_HISTORY = [
    ("output shorter than output_index", ([5], 6, pb.SamplingParams(presence_penalty=1), [], [9, 8], 3),
     "output_token_ids must hold the 3"),
    ("no prompt with a repetition penalty", ([5], 6, pb.SamplingParams(repetition_penalty=2), [], [9, 8, 5], 3),
     "prompt_token_ids and output_token_ids must hold the sequence's 7 tokens"),
    ("prompt + output not the sequence", ([5], 6, pb.SamplingParams(repetition_penalty=2), [1, 2], [9, 8, 5], 3),
     "must hold the sequence's 7 tokens"),
    ("output longer than the sequence", ([5], 2, pb.SamplingParams(frequency_penalty=1), [], [9, 8, 5], 3),
     "only 3 tokens"),
    ("output id outside the vocabulary", ([5], 6, pb.SamplingParams(frequency_penalty=1), [], [9, VOCAB, 5], 3),
     "output_token_ids must be in"),
    ("prompt id negative", ([5], 6, pb.SamplingParams(repetition_penalty=2), [1, -2, 3, 4], [9, 8, 5], 3),
     "prompt_token_ids must be in"),
    ("repetition penalty < 0", ([5], 6, pb.SamplingParams(repetition_penalty=-0.5), [1, 2, 3, 4], [9, 8, 5], 3),
     "repetition_penalty"),
    ("presence penalty 3", ([5], 6, pb.SamplingParams(presence_penalty=3), [], [9, 8, 5], 3), "presence_penalty"),
]


@pytest.mark.parametrize("name,seq,match", BAD_HISTORY, ids=[b[0] for b in BAD_HISTORY])
def test_an_inconsistent_history_refuses_the_step_naming_the_sequence(name, seq, match):
    good = ([1, 2, 3], 0, pb.SamplingParams(), [], [], 0)
    with pytest.raises(InvalidArgumentError, match=match) as e:
        _build(_step(good, seq))
    assert "Step sequence 1 (batch index 1)" in str(e.value)


# ------------------------------------------------------------------ through the real services

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model):
    """(transformers model, Client, prompt) over a memory service and a worker running the tiny Llama."""
    from conftest import local_stack

    from client.api import Client

    tmp = tmp_path_factory.mktemp("penalties")
    path, model = tiny_model
    stack = local_stack(tmp, ["--num-blocks", "64", "--block-size", "16"], name="penalties")
    stack.model = str(path)
    with stack, Client(stack.memory_address, stack.worker_addresses) as client:
        yield model, client, echo_prompt(model)


def test_greedy_with_penalties_equals_transformers_with_them_applied_by_hand(tiny):
    from client.params import SamplingParams as Params

    model, client, prompt = tiny
    plain = reference_greedy(model, prompt, 16)
    assert plain[0] in prompt  # unpenalised, the model repeats a prompt token at once
    # The prompt's history (a repetition penalty), the output's (a presence reward that makes it
    # repeat, a frequency penalty that ends it), all three.
    for kw in ({"repetition_penalty": 1.8}, {"presence_penalty": -2.0, "frequency_penalty": 0.5},
               {"repetition_penalty": 0.7, "frequency_penalty": -0.4, "presence_penalty": 0.3}):
        ref = reference_greedy(model, prompt, 16, **kw)
        (out,) = client.generate([prompt], Params(temperature=0, max_tokens=16, ignore_eos=True, **kw))
        assert out.outputs[0].token_ids == ref, kw
        assert ref != plain, kw
    (out,) = client.generate([prompt], Params(temperature=0, max_tokens=16, ignore_eos=True))
    assert out.outputs[0].token_ids == plain


def test_parallel_samples_with_penalties_equal_solo_runs(tiny):
    """After the fork each sample carries its own history: n = 3 equals three solo runs. (A presence
    reward makes the samples repeat their own tokens, so the draws differ from unpenalised ones.)"""
    from client.params import SamplingParams as Params

    _, client, prompt = tiny
    kw = dict(temperature=0.2, max_tokens=12, ignore_eos=True, repetition_penalty=1.2, presence_penalty=-2.0,
              frequency_penalty=0.5)
    (out,) = client.generate([prompt], Params(n=3, seed=11, **kw))
    solo = [client.generate([prompt], Params(seed=11 + i, **kw))[0].outputs[0].token_ids for i in range(3)]
    assert [o.token_ids for o in out.outputs] == solo
    (plain,) = client.generate([prompt], Params(n=3, seed=11, **{**kw, "repetition_penalty": 1.0,
                                                                   "presence_penalty": 0.0, "frequency_penalty": 0.0}))
    assert [o.token_ids for o in plain.outputs] != solo


def test_the_worker_refuses_a_step_whose_history_is_inconsistent(tiny):
    """Over gRPC: INVALID_ARGUMENT naming the sequence, before anything is read or written."""
    client = tiny[1]
    req = _step(([5], 6, pb.SamplingParams(presence_penalty=1), [], [9, 8], 3))
    req.pool_generation = client.engine.model_info.pool_generation
    with pytest.raises(grpc.RpcError) as e:
        client.workers[0].stub.Step(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "output_token_ids" in e.value.details()
