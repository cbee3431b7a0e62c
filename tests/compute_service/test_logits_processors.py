"""The token bitmask, min_tokens, logit_bias and min_p on the worker (vLLM's semantics and order),
against a float64 reference written here one token at a time: greedy's pick, and for sampled rows
the set of tokens that may be drawn, alone and with penalties, temperature, top-k and top-p; then the
step's checks of these fields (INVALID_ARGUMENT)."""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import pytest
import torch

from compute_service.logits_processors import TokenMasks, constrain
from compute_service.penalties import TokenHistory
from compute_service.sampling import SamplingParams, draw_probs, processed_logits, sample
from compute_service.step_inputs import build_step_inputs
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.runtime.errors import InvalidArgumentError

VOCAB = 300
WORDS = (VOCAB + 31) // 32
NEG = -math.inf


def packed(allowed) -> bytes:
    """StepSequence.token_bitmask for a set of allowed tokens: int32 words, bit i of word j = token 32 j + i."""
    words = [0] * WORDS
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return struct.pack(f"<{WORDS}I", *words)


def reference(row, p: SamplingParams, t: int, allowed=None, prompt=(), output=()) -> set[int]:
    """The tokens row may yield, float64, one vocabulary entry at a time: {argmax} for greedy, else
    every token of non-zero probability after the filters (vLLM v1's order, this module's docstring)."""
    x = [float(v) for v in row]
    if allowed is not None:
        x = [v if i in allowed else NEG for i, v in enumerate(x)]
    if t < p.min_tokens:
        cut = [NEG if i in p.min_tokens_stop_ids else v for i, v in enumerate(x)]
        if any(v > NEG for v in cut):
            x = cut
    for tok, b in p.logit_bias:
        x[tok] += b
    for v in range(len(x)):  # penalties (vLLM's apply_penalties)
        count = list(output).count(v)
        if x[v] == NEG:
            continue
        if p.repetition_penalty != 1 and (v in prompt or count):
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
        x[v] -= p.frequency_penalty * count + (p.presence_penalty if count else 0.0)
    if p.temperature == 0:
        return {max(range(len(x)), key=lambda i: (x[i], -i))}
    x = [v / p.temperature for v in x]
    top = max(x)
    z = sum(math.exp(v - top) for v in x)
    prob = [math.exp(v - top) / z for v in x]
    kept = [i for i in range(len(x)) if x[i] > NEG and prob[i] >= p.min_p * max(prob)]
    kept.sort(key=lambda i: -x[i])
    if p.top_k:
        kept = kept[:p.top_k]
    z = sum(prob[i] for i in kept)
    mass, out = 0.0, set()
    for i in kept:
        if p.top_p < 1 and mass >= p.top_p:
            break
        out.add(i)
        mass += prob[i] / z
    return out


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _cases(logits: torch.Tensor, temperature: float):
    """(params, output position, allowed set or None, prompt, output) per row of ``logits``: each
    feature alone, inactive, and combined with penalties and the filters."""
    top = [int(i) for i in logits.argmax(-1)]
    second = [int(i) for i in logits.topk(2).indices[:, 1]]
    rng = np.random.default_rng(7)
    grammar = set(rng.choice(VOCAB, 40, replace=False).tolist())
    T = temperature
    kw = dict(temperature=T, seed=3)
    return [
        (SamplingParams(**kw), 0, grammar, (), ()),  # bitmask alone
        (SamplingParams(**kw, logit_bias=((17, 20.0), (top[1], -30.0))), 0, None, (), ()),  # bias up and down
        (SamplingParams(**kw, min_tokens=4, min_tokens_stop_ids=(top[2], second[2])), 3, None, (), ()),  # active
        (SamplingParams(**kw, min_tokens=4, min_tokens_stop_ids=(top[3],)), 4, None, (), ()),  # reached: off
        (SamplingParams(**kw, min_p=0.05), 0, None, (), ()),
        (SamplingParams(**kw, min_p=0.3, top_k=5, top_p=0.8), 0, None, (), ()),
        # a grammar that allows only the suppressed ids: min_tokens yields
        (SamplingParams(**kw, min_tokens=9, min_tokens_stop_ids=(5, 6)), 0, {5, 6}, (), ()),
        # everything at once, with penalties
        (SamplingParams(**kw, min_p=0.02, top_k=30, top_p=0.9, repetition_penalty=1.6, frequency_penalty=0.4,
                        presence_penalty=-0.5, logit_bias=((top[7], -4.0), (9, 2.5)), min_tokens=3,
                        min_tokens_stop_ids=(second[7], 11)),
         1, grammar | {top[7], second[7], 9}, (1, 2, 9, top[7]), (4, second[7], 4, 9)),
        (SamplingParams(**kw), 0, None, (), ()),  # nothing: untouched
    ]


def _history(cases) -> TokenHistory | None:
    rows = [i for i, c in enumerate(cases) if c[0].has_penalties]
    return TokenHistory(rows, [np.array(cases[i][3], dtype=np.int64) for i in rows],
                        [np.array(cases[i][4], dtype=np.int64) for i in rows]) if rows else None


def _masks(cases) -> TokenMasks:
    rows = [i for i, c in enumerate(cases) if c[2] is not None]
    return TokenMasks(rows, np.stack([np.frombuffer(packed(cases[i][2]), dtype=np.uint8) for i in rows]))


def _run(logits, cases):
    args = ([c[0] for c in cases], [c[1] for c in cases], _history(cases), _masks(cases))
    return args, processed_logits(logits, *args)


def test_greedy_picks_equal_the_float64_reference():
    logits = _logits(9, 1)
    cases = _cases(logits, 0.0)
    args, _ = _run(logits, cases)
    got = sample(logits, *args).token_ids.tolist()
    for i, (p, t, allowed, prompt, output) in enumerate(cases):
        (want,) = reference(logits[i].tolist(), p, t, allowed, prompt, output)
        assert got[i] == want, f"row {i}"
    assert got[1] == 17 and got[8] == int(logits[8].argmax())  # the bias wins; an untouched row is plain argmax
    assert got[2] != int(logits[2].argmax()) and got[3] == int(logits[3].argmax())  # min_tokens, then not
    assert got[6] in (5, 6)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_the_tokens_a_draw_may_pick_equal_the_float64_reference(temperature):
    logits = _logits(9, 2)
    cases = _cases(logits, temperature)
    args, x = _run(logits, cases)
    probs = draw_probs(x, args[0], list(range(len(cases))))
    for i, (p, t, allowed, prompt, output) in enumerate(cases):
        want = reference(logits[i].tolist(), p, t, allowed, prompt, output)
        assert set(torch.nonzero(probs[i]).flatten().tolist()) == want, f"row {i}"
        drawn = {int(sample(logits[i:i + 1], [dataclasses.replace(p, seed=s)], [t], *_one(args, i)).token_ids[0])
                 for s in range(30)}
        assert drawn <= want, f"row {i}: drew {drawn - want}"
    assert probs[0].nonzero().numel() == 40  # the grammar's 40 tokens, nothing else
    assert set(probs[6].nonzero().flatten().tolist()) == {5, 6}


def _one(args, i):
    """The history and masks of row i alone (as row 0)."""
    _, _, history, masks = args
    h = None
    if history is not None and i in history.rows:
        k = history.rows.index(i)
        h = TokenHistory([0], [history.prompt[k]], [history.output[k]])
    m = TokenMasks([0], masks.packed[[masks.rows.index(i)]]) if i in masks.rows else None
    return h, m


def test_min_p_changes_nothing_under_greedy_and_raw_logprobs_stay():
    logits = _logits(4, 3)
    plain = [SamplingParams(temperature=0.0, logprobs=2) for _ in range(4)]
    with_min_p = [SamplingParams(temperature=0.0, logprobs=2, min_p=m) for m in (0.0, 0.1, 0.9, 1.0)]
    a, b = sample(logits, plain, [0] * 4), sample(logits, with_min_p, [0] * 4)
    assert torch.equal(a.token_ids, b.token_ids)
    biased = [SamplingParams(temperature=0.0, logprobs=2, logit_bias=((3, 100.0),)) for _ in range(4)]
    c = sample(logits, biased, [0] * 4, masks=TokenMasks([1], np.frombuffer(packed({8}), np.uint8)[None]))
    assert c.token_ids.tolist() == [3, 8, 3, 3]
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(c.logprobs, raw.gather(1, c.token_ids[:, None])[:, 0])  # raw, not biased
    torch.testing.assert_close(c.top_logprobs, raw.topk(2, dim=-1).values)


def test_rows_without_a_feature_cost_no_copy_and_a_mask_survives_an_overflowing_penalty():
    logits = _logits(3, 4)
    params = [SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(min_p=0.5, seed=1), SamplingParams()]
    assert constrain(logits, params, [5, 0, 0]) is logits  # min_tokens reached, min_p applies later
    # Every allowed token is seen and negative: a huge repetition penalty overflows them to -big, and
    # the masked ones must stay below (-inf), not tie with them at -big.
    row = torch.full((1, VOCAB), -2.0)  # * 3e38 overflows float32
    p = SamplingParams(temperature=0.0, repetition_penalty=3e38)
    hist = TokenHistory([0], [np.array([200, 201])], [np.array([], dtype=np.int64)])
    out = sample(row, [p], [0], hist, TokenMasks([0], np.frombuffer(packed({200, 201}), np.uint8)[None]))
    assert out.token_ids.tolist() == [200]


# ------------------------------------------------------------------ the step's checks

def _step(*seqs) -> pb.StepRequest:
    """Sequences (sampling, token_bitmask or None, skip_sampling), one decode token each, 4-token blocks."""
    return pb.StepRequest(sequences=[pb.StepSequence(
        seq_id=i, token_ids=[5], positions=[6], block_ids=range(8 * i, 8 * i + 8), sampling=sp, output_index=2,
        skip_sampling=skip, **({} if mask is None else {"token_bitmask": mask}))
        for i, (sp, mask, skip) in enumerate(seqs)])


def _build(req):
    return build_step_inputs(req, block_size=4, num_blocks=64, vocab_size=VOCAB, device="cpu")


def test_the_step_reads_the_fields_and_the_masks_of_the_sampled_rows():
    sp = pb.SamplingParams(temperature=0.5, min_p=0.25, min_tokens=7, min_tokens_stop_ids=[0, 299],
                           logit_bias=[pb.LogitBias(token_id=3, bias=-2.5), pb.LogitBias(token_id=299, bias=100)])
    inputs = _build(_step((sp, packed({1, 299}), False), (pb.SamplingParams(), None, False),
                          (pb.SamplingParams(), b"junk", True),  # not sampled: its mask is not read
                          (pb.SamplingParams(), packed({0}), False)))
    p = inputs.sampling[0]
    assert (p.min_p, p.min_tokens, p.min_tokens_stop_ids, p.logit_bias) == (0.25, 7, (0, 299), ((3, -2.5), (299, 100)))
    assert inputs.sample_rows == [0, 1, 3] and inputs.masks.rows == [0, 2]
    assert inputs.masks.packed.tobytes() == packed({1, 299}) + packed({0})
    assert _build(_step((sp, None, False))).masks is None


BAD = [
    ("mask one word short", (pb.SamplingParams(), packed({1})[:-4], False), "token_bitmask has 36 bytes"),
    ("mask one byte long", (pb.SamplingParams(), packed({1}) + b"\0", False), "token_bitmask has 41 bytes"),
    ("mask all zero", (pb.SamplingParams(), bytes(4 * WORDS), False), "allows no token"),
    ("mask only past the vocabulary", (pb.SamplingParams(), packed({300, 319}), False), "allows no token"),
    ("bias id = V", (pb.SamplingParams(logit_bias=[pb.LogitBias(token_id=VOCAB, bias=1)]), None, False),
     "logit_bias token id 300"),
    ("bias id < 0", (pb.SamplingParams(logit_bias=[pb.LogitBias(token_id=-1, bias=1)]), None, False), "logit_bias"),
    ("bias id twice", (pb.SamplingParams(logit_bias=[pb.LogitBias(token_id=4, bias=1)] * 2), None, False),
     "at most once"),
    ("bias inf", (pb.SamplingParams(logit_bias=[pb.LogitBias(token_id=4, bias=math.inf)]), None, False), "finite"),
    ("bias nan", (pb.SamplingParams(logit_bias=[pb.LogitBias(token_id=4, bias=math.nan)]), None, False), "finite"),
    ("min_p 1.5", (pb.SamplingParams(temperature=1, min_p=1.5), None, False), "min_p"),
    ("min_p nan", (pb.SamplingParams(temperature=1, min_p=math.nan), None, False), "min_p"),
    ("stop id = V", (pb.SamplingParams(min_tokens=3, min_tokens_stop_ids=[2, VOCAB]), None, False),
     "min_tokens_stop_ids token id 300"),
    ("stop id < 0", (pb.SamplingParams(min_tokens=3, min_tokens_stop_ids=[-5]), None, False), "min_tokens_stop_ids"),
]


@pytest.mark.parametrize("name,seq,match", BAD, ids=[b[0] for b in BAD])
def test_bad_values_refuse_the_step_naming_the_sequence(name, seq, match):
    with pytest.raises(InvalidArgumentError, match=match) as e:
        _build(_step((pb.SamplingParams(), None, False), seq))
    assert "Step sequence 1 (batch index 1)" in str(e.value)
