"""Sampling: greedy, reproducible draws per (seed, t), top-k / top-p filters, logprobs, errors."""

from __future__ import annotations

import math

import pytest
import torch

from compute_service.sampling import (
    SamplingParams,
    draw_seed,
    filtered_probs,
    sample,
)
from pagedkv.runtime.limits import MAX_LOGPROBS


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _ref_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Direct computation, one token at a time (float64): temperature, top-k, then top-p."""
    x = row.double() / temperature
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    kept = order[:top_k] if top_k else order
    z = sum(math.exp(float(x[i]) - float(x[kept[0]])) for i in kept)
    mass, final = 0.0, []
    for i in kept:
        if mass >= top_p:
            break
        final.append(i)
        mass += math.exp(float(x[i]) - float(x[kept[0]])) / z
    out = torch.zeros(len(x), dtype=torch.float64)
    out[final] = torch.softmax(x[final], dim=0)
    return out


def test_greedy_is_argmax_whatever_the_seed():
    logits = _logits(5, 300)
    params = [SamplingParams(temperature=0.0, seed=s, top_k=3, top_p=0.5) for s in range(5)]
    out = sample(logits, params, [0, 1, 2, 3, 4])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None


def test_draw_depends_only_on_seed_and_position():
    logits = _logits(6, 1000, seed=1)
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=s)
        for t, k, p, s in [
            (1.0, 0, 1.0, 11),
            (0.7, 50, 1.0, 12),
            (1.3, 0, 0.9, 13),
            (0.0, 0, 1.0, 14),
            (1.0, 20, 0.8, 15),
            (2.0, 0, 1.0, 16),
        ]
    ]
    positions = [0, 5, 9, 3, 100, 7]
    full = sample(logits, params, positions).token_ids
    for i in range(6):  # each row alone
        solo = sample(logits[i : i + 1], [params[i]], [positions[i]]).token_ids
        assert int(solo[0]) == int(full[i]), f"row {i}: batch {int(full[i])} != solo {int(solo)}"
    perm = [4, 2, 0, 5, 1, 3]  # other order, other neighbours, twice as many rows
    mixed = sample(
        torch.cat([logits[perm], _logits(6, 1000, seed=9)]),
        [params[i] for i in perm] + [SamplingParams(seed=99)] * 6,
        [positions[i] for i in perm] + list(range(6)),
    ).token_ids
    assert mixed[:6].tolist() == full[perm].tolist()
    # another output position draws anew
    flat = torch.zeros(200, 1000)
    toks = sample(flat, [SamplingParams(seed=5)] * 200, list(range(200))).token_ids
    assert len(set(toks.tolist())) > 150
    assert draw_seed(5, 0) != draw_seed(5, 1) != draw_seed(6, 0)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.8, 5, 1.0),
        (1.0, 0, 0.6),
        (1.5, 8, 0.7),
        (1.0, 1, 1.0),
        (1.0, 0, 0.01),
    ],
)
def test_filters_match_direct_computation(temperature, top_k, top_p):
    logits = _logits(3, 40, seed=2)
    n = len(logits)
    got = filtered_probs(
        logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p)
    )
    for r in range(n):
        ref = _ref_probs(logits[r], temperature, top_k, top_p)
        torch.testing.assert_close(
            got[r].double(), ref, atol=1e-6, rtol=1e-5, msg=lambda m, r=r: f"row {r}: {m}"
        )


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 1.0), (0, 0.75), (10, 0.8)])
def test_sample_frequencies_follow_filtered_distribution(top_k, top_p):
    """4000 draws (positions 0..3999, fixed seed): only kept tokens, frequencies within 0.03
    of the direct computation (about 4 standard deviations)."""
    row = _logits(1, 20, seed=3)[0] * 0.4
    n = 4000
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=1234)] * n
    toks = sample(row.expand(n, -1).contiguous(), params, list(range(n))).token_ids
    freq = torch.bincount(toks, minlength=20).double() / n
    ref = _ref_probs(row, 1.0, top_k, top_p)
    assert set(toks.tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    assert float((freq - ref).abs().max()) < 0.03, (freq, ref)


def test_logprobs_are_raw_log_softmax():
    logits = _logits(3, 500, seed=4)
    params = [
        SamplingParams(temperature=0.5, seed=1, logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = sample(logits, params, [0, 0, 0])
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_ids.shape == (3, 5)
    torch.testing.assert_close(out.top_logprobs, ref.topk(5, dim=-1).values)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ],
)
def test_bad_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sample_rejects_mismatched_inputs():
    logits = _logits(2, 10)
    with pytest.raises(ValueError, match="2 rows"):
        sample(logits, [SamplingParams()], [0, 0])
    with pytest.raises(ValueError, match="output positions"):
        sample(logits, [SamplingParams(seed=1)] * 2, [0, -1])
