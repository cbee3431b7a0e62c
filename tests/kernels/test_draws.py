"""The sampler's counter-based draws (kernels.draws) and its inverse-transform pick
(compute_service.sampling.inverse_transform), against independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compute_service.sampling import inverse_transform
from kernels import draws

#: Random123's known-answer vectors for philox4x32-10 (kat_vectors): counter, key, output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", KAT)
def test_philox4x32_10_known_answers(counter, key, want):
    got = draws.philox4x32(tuple(np.array([c], np.uint64) for c in counter), tuple(np.array([k], np.uint64)
                                                                                    for k in key))
    assert tuple(int(x[0]) for x in got) == want


def test_a_key_is_philox_with_counter_zero_and_the_key_split_low_high():
    keys = np.array([0, 0xFFFFFFFF_FFFFFFFF, 0xA4093822_299F31D0], dtype=np.uint64)
    want = [draws.philox4x32(tuple(np.zeros(1, np.uint64) for _ in range(4)),
                             (np.array([int(k) & 0xFFFFFFFF], np.uint64), np.array([int(k) >> 32], np.uint64)))[0][0]
            for k in keys]
    assert draws.random_uint32(keys).tolist() == [int(w) for w in want]
    assert int(draws.random_uint32(np.zeros(1, np.uint64))[0]) == 0x6627E8D5


def test_the_float_transform_is_exact_and_inside_the_open_interval():
    r = np.array([0, 511, 512, 2**31, 2**32 - 1], dtype=np.uint32)
    u = draws.to_uniform(r)
    exact = [((int(x) >> 9) + 0.5) / 2**23 for x in r]  # in float64: every value is a float32
    assert u.dtype == np.float32 and u.astype(np.float64).tolist() == exact
    assert 0 < u.min() and u.max() < 1 and u.max() == np.float32(1 - 2**-24)


def test_uniforms_on_the_cpu_follow_the_keys():
    u = draws.uniforms([0, 5, 2**64 - 1], "cpu")
    assert u.dtype == torch.float32 and u.tolist() == draws.to_uniform(draws.random_uint32(
        np.array([0, 5, 2**64 - 1], np.uint64))).tolist()


def test_inverse_transform_picks_the_first_token_past_u_and_never_a_zero():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])  # rows need not sum to 1
    for u, want in [(1e-7, 1), (0.2499, 1), (0.2501, 3), (0.7499, 3), (0.7501, 4), (1 - 2**-24, 4)]:
        got = inverse_transform(probs, torch.tensor([u, u]))
        assert got.tolist() == [want, 5], u
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(64, 1000, generator=gen).pow(4)
    p[p < 0.3] = 0
    u = torch.rand(64, generator=gen).clamp(1e-6, 1 - 1e-6)
    got = inverse_transform(p, u)
    cdf = p.double().cumsum(-1)
    for r in range(64):  # the first index whose cumulative mass passes u * total
        want = int(np.argmax(cdf[r].numpy() > float(u[r]) * float(cdf[r, -1])))
        assert int(got[r]) == want and p[r, want] > 0
