"""pagedkv.runtime.test_hooks: named no-op points, hook modules installed in this process and, through
PAGEDKV_TEST_HOOKS, into a service process (a worker paused inside its steps by tests/hooks/slow_step.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hook_env, local_stack
from helpers.tiny_llama import BASE_PROMPT, make_tiny_llama

import kernels
from pagedkv.runtime import test_hooks

HOOKS = Path(__file__).resolve().parents[1] / "hooks"


@pytest.fixture(autouse=True)
def no_hooks_left():
    """Every test starts and ends with no hook installed in this process."""
    assert not test_hooks._hooks
    yield
    assert not test_hooks._hooks


def test_a_point_without_hooks_returns_none_and_unknown_points_are_refused():
    assert test_hooks.call("worker.step_begin", request=None) is None
    assert not test_hooks.active("worker.step_begin")
    with pytest.raises(ValueError, match="no test hook point 'worker.stepbegin'"):
        test_hooks.register("worker.stepbegin", lambda **_: None)


def test_hooks_run_in_order_and_the_first_result_counts():
    seen = []
    removers = [test_hooks.register("transfer.read_blocks", lambda **kw: seen.append(("a", kw["pairs"]))),
                test_hooks.register("transfer.read_blocks", lambda **kw: seen.append("b") or 3),
                test_hooks.register("transfer.read_blocks", lambda **kw: 5)]
    assert test_hooks.active("transfer.read_blocks") and not test_hooks.active("worker.step_end")
    assert test_hooks.call("transfer.read_blocks", agent="r", source="s", pairs=[(0, 1)]) == 3
    assert seen == [("a", [(0, 1)]), "b"]
    for remove in removers:
        remove()
    assert test_hooks.call("transfer.read_blocks", agent="r", source="s", pairs=[]) is None


def test_hook_modules_install_by_path_for_a_block(monkeypatch):
    monkeypatch.setenv("PAGEDKV_TRANSFER_FAIL_AFTER", "4")
    with test_hooks.installed(str(HOOKS / "transfer_fail_after.py")):
        assert test_hooks.call("transfer.read_blocks", agent="r", source="s", pairs=[]) == 4
        monkeypatch.setenv("PAGEDKV_TRANSFER_FAIL_AFTER", "x")
        with pytest.raises(ValueError, match="need a count"):
            test_hooks.call("transfer.read_blocks", agent="r", source="s", pairs=[])
    assert not test_hooks.active("transfer.read_blocks")


def test_a_module_without_hooks_or_with_an_unknown_point_is_refused(tmp_path):
    (tmp_path / "none.py").write_text("X = 1\n")
    (tmp_path / "typo.py").write_text("HOOKS = {'worker.step_begin': print, 'worker.step_middle': print}\n")
    with pytest.raises(ValueError, match="no HOOKS dict"):
        test_hooks.install(str(tmp_path / "none.py"))
    with pytest.raises(ValueError, match=r"unknown points \['worker.step_middle'\]"):
        test_hooks.install(str(tmp_path / "typo.py"))
    with pytest.raises(ImportError):
        test_hooks.install(str(tmp_path / "absent.py"))
    with pytest.raises(ImportError):
        test_hooks.install("tests.hooks.no_such_hook")


def test_install_from_env_installs_once(monkeypatch, tmp_path):
    monkeypatch.setattr(test_hooks, "_from_env", None)
    monkeypatch.setenv(test_hooks.ENV, f" {HOOKS / 'slow_step.py'} ,")
    try:
        assert test_hooks.install_from_env() == [str(HOOKS / "slow_step.py")]
        assert test_hooks.install_from_env() == []  # a second call in the process does nothing
        assert len(test_hooks._hooks["worker.step_begin"]) == 1
    finally:
        test_hooks._hooks.clear()


def test_a_tier_copy_hook_that_raises_stops_the_copy_half_way():
    src = torch.arange(6.0).view(6, 1, 1, 1, 1, 1).expand(6, 2, 2, 2, 1, 4).contiguous()
    dst = torch.full((6, 2, 2, 2, 1, 4), -1.0)
    calls = []

    def stop_at_third(*, src, dst, src_block, dst_block, index, count):
        calls.append((src_block, dst_block, index, count))
        if index == 2:
            raise RuntimeError("stopped")

    remove = test_hooks.register("tier.copy_block", stop_at_third)
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            kernels.copy_blocks_between(src, dst, [(3, 4), (0, 0), (1, 1), (2, 2)])  # one run of three, then one
    finally:
        remove()
    assert calls == [(0, 0, 0, 4), (1, 1, 1, 4), (2, 2, 2, 4)]
    assert [int(dst[b].flatten()[0]) for b in range(6)] == [0, 1, -1, -1, -1, -1]
    kernels.copy_blocks_between(src, dst, [(3, 4), (2, 2)])  # no hook: run by run again
    assert [int(dst[b].flatten()[0]) for b in range(6)] == [0, 1, 2, -1, 3, -1]


def test_a_hook_installed_into_a_worker_process_pauses_it_inside_each_step(tmp_path):
    from client.api import Client
    from client.params import SamplingParams

    pause, marker = 0.3, tmp_path / "slow_step.marker"
    make_tiny_llama(tmp_path / "model")
    stack = local_stack(tmp_path, ["--num-blocks", "16", "--block-size", "16"], name="hooks")
    stack.model = str(tmp_path / "model")
    stack.env = hook_env("tests.hooks.slow_step", PAGEDKV_TEST_SLOW_STEP_S=str(pause),
                         PAGEDKV_TEST_SLOW_STEP_MARKER=str(marker))
    with stack, Client(stack.memory_address, stack.worker_addresses) as client:
        client.generate([BASE_PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        traces = list(client.engine.traces)
        worker_pid = stack.workers[0].pid
    lines = [line.split() for line in marker.read_text().splitlines()]
    assert len(traces) == 3
    # Every step of the worker's process began, paused and ended in the hook, in order; the
    # memory service (same environment) installed it too but runs no worker step.
    assert [(kind, int(pid), int(step)) for kind, pid, step, *_ in lines] == [
        (kind, worker_pid, step) for step in range(3) for kind in ("begin", "end")]
    assert all(float(line[3]) >= pause for line in lines if line[0] == "end")
    assert all(t.step_seconds >= pause for t in traces)  # the worker timed the pause as part of its step
