"""min_p, logit_bias and min_tokens on the client (vLLM's checks), what a step sends the worker for
them and for a structured-output grammar, and the front's stop checks under min_tokens (vLLM v1's
``check_stop`` and detokenizer); no services."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from client.engine.scheduler import ScheduledSeq
from client.engine.worker_step import build_steps
from client.params import SamplingParams
from client.request import Request
from client.stop import StopChecker
from pagedkv.model.tokenizer import load_tokenizer


@pytest.mark.parametrize("kwargs,match", [
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"min_p": None}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens must be <= max_tokens=16"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
    ({"logit_bias": {True: 1.0}}, "logit_bias keys"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias values"),
    ({"logit_bias": {5: "1"}}, "logit_bias values"),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias must map"),
    ({"num_beams": 2, "min_p": 0.1}, "beam search takes no min_p"),
    ({"num_beams": 2, "logit_bias": {5: 1.0}}, "beam search takes no min_p"),
    ({"num_beams": 2, "min_tokens": 1}, "beam search takes no min_p"),
])
def test_bad_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_biases_are_clamped_as_vllm_and_ids_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={3: 250, 4: -1e9, 5: 0.5})
    assert p.logit_bias == {3: 100.0, 4: -100.0, 5: 0.5}
    p.check_vocab(6)
    with pytest.raises(ValueError, match=r"logit_bias token id\(s\) \[6, 9\] are outside the vocabulary \[0, 6\)"):
        SamplingParams(logit_bias={9: 1, 6: 1, 2: 1}).check_vocab(6)
    SamplingParams(min_tokens=16, max_tokens=16)  # equal is fine


class Grammar:
    """A stand-in for client.structured's matcher: its bitmask is fixed bytes."""

    def bitmask(self) -> bytes:
        return b"\x01\x00\x00\x00"


def _step(params: SamplingParams, generated: int, stop_ids=(), computed: int | None = None, grammar=None):
    """The StepSequence of a 3-token prompt with ``generated`` tokens after it (decode by default)."""
    req = Request([5, 6, 7], [5, 6, 7], params.with_defaults({}))
    req.min_tokens_stop_ids = tuple(stop_ids)
    req.worker, seq = 0, req.seqs[0]
    seq.tokens += list(range(20, 20 + generated))
    seq.seq_id, seq.block_table, seq.grammar = 1, [0, 1], grammar
    seq.num_computed = len(seq.tokens) - 1 if computed is None else computed
    (s,) = build_steps([ScheduledSeq(req, seq, len(seq.tokens) - seq.num_computed)], {}, 0)[0].sequences
    return s


def test_a_step_sends_min_p_bias_and_min_tokens_only_where_they_act():
    p = SamplingParams(temperature=0.8, min_p=0.25, logit_bias={7: -3.0, 2: 100.0}, min_tokens=3)
    s = _step(p, 2, (0, 2))
    assert s.sampling.min_p == 0.25
    assert [(b.token_id, b.bias) for b in s.sampling.logit_bias] == [(7, -3.0), (2, 100.0)]
    assert (s.sampling.min_tokens, list(s.sampling.min_tokens_stop_ids)) == (3, [0, 2])
    s = _step(p, 3, (0, 2))  # min_tokens reached: nothing left for the worker to suppress
    assert not s.sampling.HasField("min_tokens") and not s.sampling.min_tokens_stop_ids
    assert len(s.sampling.logit_bias) == 2
    s = _step(SamplingParams(temperature=0, min_p=0.5), 0)  # greedy: min_p changes nothing, not sent
    assert not s.sampling.HasField("min_p") and not s.sampling.logit_bias and not s.sampling.HasField("min_tokens")


def test_a_sampled_step_carries_the_grammars_bitmask():
    s = _step(SamplingParams(temperature=0), 1, grammar=Grammar())
    assert s.token_bitmask == b"\x01\x00\x00\x00" and not s.skip_sampling
    s = _step(SamplingParams(temperature=0), 0, computed=0, grammar=Grammar())  # a prefill chunk that samples
    assert s.HasField("token_bitmask")
    assert not _step(SamplingParams(temperature=0), 1).HasField("token_bitmask")  # unconstrained


# ------------------------------------------------------------------ the front's stop checks

@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def _run(tok, ids: list[int], **params) -> tuple[list[int], str | None, str | int | None, str]:
    """Append ``ids`` one by one to a fresh sequence until it finishes: (tokens kept, finish_reason,
    stop_reason, text)."""
    checker = StopChecker({0}, 10_000, tok)
    p = SamplingParams(max_tokens=len(ids), **params)
    seq = Request([1], [1], p).seqs[0]
    for t in ids:
        checker.append(seq, p, SimpleNamespace(token_id=t))
        if seq.finished:
            break
    return seq.generated, seq.finish_reason, seq.stop_reason, seq.detok.text


def test_eos_and_stop_ids_end_a_sequence_only_from_min_tokens_on(tok):
    ids = [tok.encode(" a")[0], 0, 77, 0, 77, 5]
    assert _run(tok, ids)[:3] == (ids[:2], "stop", 0)
    assert _run(tok, ids, min_tokens=2)[:3] == (ids[:2], "stop", 0)  # the second token is the min_tokens-th
    assert _run(tok, ids, min_tokens=3)[:3] == (ids[:4], "stop", 0)
    assert _run(tok, ids, min_tokens=3, stop_token_ids=[77])[:3] == (ids[:3], "stop", 77)
    assert _run(tok, ids, min_tokens=6)[:2] == (ids, "length")


def test_a_stop_string_must_end_after_the_text_of_the_first_min_tokens_tokens(tok):
    """vLLM's own case (tests/detokenizer/test_min_tokens.py): with stop "e", min_tokens 5 skips
    the e's the first five tokens wrote, and a stop string may begin in them and end after them."""
    ids = tok.encode(" is Lee, and I'm a student in the college")
    first5 = tok.decode(ids[:5])
    assert "e" in first5 and "e" in tok.decode(ids[5:])
    _, reason, stop, text = _run(tok, ids, stop=["e"])
    assert (reason, stop, text) == ("stop", "e", " is L")
    _, reason, stop, text = _run(tok, ids, stop=["e"], min_tokens=5)
    after = tok.decode(ids)[len(first5):]
    assert (reason, stop, text) == ("stop", "e", first5 + after[:after.index("e")])
    # a stop string straddling the boundary ends after it: found
    tail = first5[-2:] + tok.decode(ids[5:6])[:1]
    assert _run(tok, ids, stop=[tail], min_tokens=5)[1:3] == ("stop", tail)
    # one wholly inside the first five tokens' text: not found
    assert _run(tok, ids, stop=[first5[-3:]], min_tokens=5)[1] == "length"


def test_min_tokens_stop_ids_are_the_eos_and_stop_ids_inside_the_vocabulary(tok):
    checker = StopChecker({2, 0}, 100, tok)
    assert checker.min_tokens_stop_ids(SamplingParams(stop_token_ids=[9]), 50) == ()
    p = SamplingParams(min_tokens=2, stop_token_ids=[9, 2, 70])
    assert checker.min_tokens_stop_ids(p, 50) == (0, 2, 9)
