"""``pagedkv up``'s supervisor (client.ops.supervisor) through real processes on the tiny Llama:
a SIGKILLed worker is started again at its address and the state file follows its new pid;
``pagedkv down`` stops the supervisor and every service; a SIGKILLed supervisor leaves no service
running, and ``down`` then reports the state file whose processes are gone and removes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import private_home

from client.ops.launcher import alive
from client.ops.stack import wait_healthy
from client.services import WorkerClient


def _pagedkv(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGEDKV_HOME": str(home), "PAGEDKV_MEMORY": "", "PAGEDKV_WORKERS": ""}
    return subprocess.run([sys.executable, "-m", "client.ops.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def _wait(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def up(tmp_path, tiny_model):
    """Runs ``pagedkv up`` on the tiny Llama in a private home, its pool in bfloat16 (``--kv-cache-dtype``:
    the tiny model's config names no dtype, so auto would be float32); returns (home, state)."""
    home = private_home(tmp_path / "home")

    def start() -> dict:
        done = _pagedkv(home, "up", "--device", "cpu", "--model", str(tiny_model[0]), "--memory-port", "0",
                        "--worker-port", "0", "--num-blocks", "64", "--block-size", "4", "--kv-cache-dtype", "bfloat16")
        assert done.returncode == 0, done.stderr
        return json.loads((home / "state.json").read_text())

    yield home, start
    _pagedkv(home, "down")


def _pids(state: dict) -> list[int]:
    return [state["supervisor"]["pid"], state["memory"]["pid"], *(w["pid"] for w in state["workers"])]


def test_up_restarts_a_killed_worker_and_down_stops_everything(up):
    home, start = up
    state = start()
    (worker,) = state["workers"]
    os.kill(worker["pid"], signal.SIGKILL)
    assert _wait(lambda: json.loads((home / "state.json").read_text())["workers"][0]["pid"] != worker["pid"])
    after = json.loads((home / "state.json").read_text())
    assert after["workers"][0]["address"] == worker["address"]  # the same address: engines find it again
    assert after["memory"] == state["memory"] and after["supervisor"] == state["supervisor"]
    wait_healthy(worker["address"], 30)
    client = WorkerClient(worker["address"])
    try:
        info = client.model_info()
        assert info.pool_generation > 0 and info.dtype == "bfloat16"  # it mapped the pool again, up's dtype
    finally:
        client.close()
    assert '"service_restarted"' in (home / "run" / "supervisor.log").read_text()
    done = _pagedkv(home, "down")
    assert done.returncode == 0 and worker["address"] in done.stdout and state["memory"]["address"] in done.stdout
    assert _wait(lambda: not any(alive(p) for p in _pids(after)), 10)
    assert not (home / "state.json").exists()


def test_a_killed_supervisor_leaves_nothing_running_and_its_state_file_is_reported(up):
    home, start = up
    state = start()
    os.kill(state["supervisor"]["pid"], signal.SIGKILL)
    assert _wait(lambda: not any(alive(p) for p in _pids(state)), 15)
    done = _pagedkv(home, "down")
    assert done.returncode == 0 and "nothing to stop" in done.stdout
    assert "none of its processes runs" in done.stderr and not (home / "state.json").exists()


class _Dead:
    """A service that has exited; its respawn exits too (counted)."""

    def __init__(self, born: list):
        self.proc, self.address, self.pid = type("P", (), {"poll": lambda self: 9})(), "127.0.0.1:1", 1
        self.born = born

    def respawn(self):
        self.born.append(1)
        return _Dead(self.born)


def test_the_restart_policy_waits_its_backoff_and_gives_up_past_its_bound():
    from client.ops.supervisor import RestartPolicy, Supervisor

    born: list = []
    stack = type("S", (), {"memory": None, "workers": [_Dead(born)]})()
    patient = Supervisor(stack, RestartPolicy(backoff=60.0))
    assert patient.check() == [] and born == []  # inside its first backoff
    restarts = []
    eager = Supervisor(stack, RestartPolicy(max_restarts=2, backoff=0.0), on_restart=lambda s: restarts.append(s))
    assert [eager.check() for _ in range(4)] == [["worker0"], ["worker0"], [], []]
    assert len(born) == 2 and restarts == [stack, stack] and stack.workers[0].born is born
