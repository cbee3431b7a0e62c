"""LocalStack: a worker that fails to start stops the memory service it started; bad settings raise."""

from __future__ import annotations

import pytest
from conftest import local_stack

from client.ops.stack import LocalStack


def test_failed_worker_stops_the_memory_service(tmp_path):
    stack = local_stack(tmp_path, ["--num-blocks", "8", "--block-size", "4"], name="broken")
    stack.worker_args = ["--no-such-flag"]
    with pytest.raises(RuntimeError, match="no-such-flag") as exc:
        stack.start()
    assert "broken-worker did not start" in str(exc.value)
    assert stack.memory is not None and stack.memory.proc.poll() is not None, "the memory service still runs"
    assert stack.workers == []


@pytest.mark.parametrize("kwargs",
                         [{"num_workers": -1}, {"memory_port": 70000}, {"worker_port": 65535, "num_workers": 2},
                                    {"timeout": 0}])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError):
        LocalStack(["--num-blocks", "8"], **kwargs)


def test_addresses_need_a_started_stack():
    with pytest.raises(RuntimeError, match="not started"):
        _ = LocalStack().memory_address
