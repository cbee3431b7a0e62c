"""The greedy-agreement metric of benchmarks/bench_peers.py (identical requests, matching prefix)."""

import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench_peers():
    """The benchmark module. Importing it sets the benchmarks' defaults in this process (sys.path,
    and PAGEDKV_LOG_LEVEL=warning for the services they start): both are put back afterwards, so
    services that later tests start log at their usual level."""
    env, path = dict(os.environ), list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_peers

        yield bench_peers
    finally:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path


def test_agreement_counts_identical_requests_and_mean_prefix(bench_peers):
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9], []]
    outputs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9], []]
    a = bench_peers.agreement(outputs, reference)
    assert a["identical"] == 2 and a["n"] == 4
    assert a["prefix_tokens"] == [4, 2, 0, 0]
    assert a["mean_prefix"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)


def test_agreement_measures_prefix_over_the_longer_output(bench_peers):
    a = bench_peers.agreement([[1, 2]], [[1, 2, 3, 4]])
    assert a["identical"] == 0 and a["mean_prefix"] == pytest.approx(0.5)
    assert bench_peers.agreement([[1, 2, 3, 4]], [[1, 2]])["mean_prefix"] == pytest.approx(0.5)


def test_agreement_refuses_runs_of_different_sizes(bench_peers):
    with pytest.raises(ValueError, match="2 outputs against 1"):
        bench_peers.agreement([[1], [2]], [[1]])
