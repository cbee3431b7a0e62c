"""The worker and its device's asynchronous work (compute_service.device_sync), checked on a CPU.

- a receipt is never signed before the event recorded after the step's last write has completed,
  also when no sequence samples (an intermediate prefill chunk: nothing else synchronizes then),
  and the forward's seconds are the events' elapsed time;
- every step makes the pool's device the compute thread's current one;
- a sticky CUDA error makes the worker refuse every later step as UNAVAILABLE and report once
  (the server then goes NOT_SERVING and exits 70); an error that is not sticky fails the step only;
- a mapping is closed only after its device has finished; an fp8 pool is refused below sm_89.
"""

from __future__ import annotations

import asyncio
import os
import time
import types

import pytest
import torch

import compute_service.main as worker_main
import compute_service.pool_map as pool_map
import compute_service.worker as worker_module
from compute_service.device_sync import StepFence, bind_compute_thread, is_fatal_device_error
from compute_service.pool_map import check_fp8_capability, map_handle
from compute_service.worker import Worker
from memory_service.layout import PoolLayout
from memory_service.pool import CpuPool
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime.errors import UnavailableError
from pagedkv.runtime.grants import sign_grant, token_digest
from pagedkv.runtime.pool_socket import PoolHandle

LAYOUT = PoolLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32", num_blocks=8)
VOCAB = 16
ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


@pytest.fixture
def pool():
    p = CpuPool(LAYOUT, pool_id="devsync")
    handle = PoolHandle(p.worker_descriptor(), p.plane_key, {k: os.dup(fd) for k, fd in p.worker_fds().items()})
    try:
        m = map_handle(handle)
    finally:
        handle.close()
    yield p, m
    m.close()
    p.close()


class Model:
    """Stands in for the decoder: logs its call, returns logits with token 5 highest, or raises ``error``."""

    device = torch.device("cpu")

    def __init__(self, log: list, error: Exception | None = None):
        self.log, self.error, self.calls = log, error, 0

    def __call__(self, input_ids, positions, kv_pool, slots, plan, logits_indices, kv_scales=None):
        self.calls += 1
        self.log.append("forward")
        if self.error is not None:
            raise self.error
        logits = torch.zeros(len(logits_indices), VOCAB)
        logits[:, 5] = 1.0
        return logits


class Event:
    """A fake device event: completes only when synchronized; 12.5 ms between begin and end."""

    made = 0

    def __init__(self, log: list):
        Event.made += 1
        self.log, self.index, self.done = log, Event.made, False

    def record(self):
        self.log.append(f"record {self.index}")

    def synchronize(self):
        self.done = True
        self.log.append(f"synchronize {self.index}")

    def elapsed_time(self, end):
        return 12.5


def step_request(p: CpuPool, sample: bool) -> cpb.StepRequest:
    tokens = [1, 2, 3]
    grant = sign_grant(p.plane_key, grant_pb2.StepGrant(
        pool_generation=p.generation, seq_id=0, block_ids=[3], block_epochs=p.epochs[[3]].tolist(), readable_tokens=0,
        write_end=3, token_digest=token_digest(tokens), expires_at=time.time() + 60))
    return cpb.StepRequest(pool_generation=p.generation, sequences=[cpb.StepSequence(
        seq_id=0, token_ids=tokens, positions=range(3), block_ids=[3], grant=grant, skip_sampling=not sample)])


def make_worker(m, log: list, error: Exception | None = None) -> Worker:
    w = Worker(Model(log, error), types.SimpleNamespace(vocab_size=VOCAB, sliding_window=None), m)
    w.fence = StepFence(torch.device("cpu"), event=lambda: Event(log))
    return w


@pytest.mark.parametrize("sample", [False, True], ids=["prefill-chunk", "sampled"])
def test_receipts_wait_for_the_step_end_event(pool, monkeypatch, sample):
    p, m = pool
    log: list = []
    worker = make_worker(m, log)
    signed = worker_module.sign_receipts

    def sign(request, results, *args):
        end = worker.fence._end
        assert end is not None and end.done, "a receipt was signed before the step's end event completed"
        log.append("sign")
        return signed(request, results, *args)

    monkeypatch.setattr(worker_module, "sign_receipts", sign)
    response = worker.step(step_request(p, sample))
    start, end = worker.fence._start.index, worker.fence._end.index
    assert log == [f"record {start}", "forward", f"record {end}", f"synchronize {end}", "sign"]
    assert response.model_seconds == pytest.approx(0.0125)
    (result,) = response.results
    assert result.receipt.end == 3 and result.HasField("token_id") == sample


def test_each_step_binds_the_pool_device_to_the_compute_thread(pool, monkeypatch):
    p, m = pool
    seen = []
    monkeypatch.setattr(worker_module, "bind_compute_thread", lambda device: seen.append(device))
    make_worker(m, []).step(step_request(p, True))
    assert seen == [m.tensor.device]
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    bind_compute_thread(torch.device("cuda:1"))
    bind_compute_thread(torch.device("cpu"))
    assert calls == [torch.device("cuda:1")]


def test_a_sticky_device_error_ends_the_worker(pool):
    p, m = pool
    log: list = []
    worker = make_worker(m, log, RuntimeError(ILLEGAL_ADDRESS))
    fatal = []
    worker.on_fatal = fatal.append
    with pytest.raises(UnavailableError, match="device failed"):
        worker.step(step_request(p, True))
    assert [str(e) for e in fatal] == [ILLEGAL_ADDRESS]
    with pytest.raises(UnavailableError, match="exiting"):  # refused without touching the device
        worker.step(step_request(p, True))
    assert worker.model.calls == 1 and len(fatal) == 1


def test_an_error_that_is_not_sticky_fails_the_step_only(pool):
    p, m = pool
    worker = make_worker(m, [], RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    worker.on_fatal = lambda e: pytest.fail(f"not a sticky error: {e}")
    with pytest.raises(RuntimeError, match="out of memory"):
        worker.step(step_request(p, True))
    worker.model.error = None
    assert worker.step(step_request(p, True)).results[0].token_id == 5


@pytest.mark.parametrize("text, fatal", [
    (ILLEGAL_ADDRESS, True),
    ("CUDA error: device-side assert triggered", True),
    ("CUDA error: unspecified launch failure", True),
    ("cudaErrorIllegalAddress: an illegal memory access was encountered", True),
    ("CUDA error: uncorrectable ECC error encountered", True),
    ("CUDA out of memory. Tried to allocate 20.00 MiB", False),
    ("CUDA error: invalid argument", False),
    ("an illegal memory access in a CPU kernel", False),
])
def test_sticky_errors_are_told_apart(text, fatal):
    assert is_fatal_device_error(RuntimeError(text)) is fatal


def test_the_server_reports_not_serving_then_exits_70(monkeypatch):
    statuses, exits = [], []

    class Health:
        async def set(self, name, status):
            statuses.append((name, status))

    monkeypatch.setattr(worker_main, "DEVICE_FAILURE_GRACE", 0.0)
    monkeypatch.setattr(worker_main.os, "_exit", exits.append)
    asyncio.run(worker_main.exit_on_device_failure(Health(), RuntimeError(ILLEGAL_ADDRESS)))
    not_serving = worker_main.health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses == [("", not_serving), (worker_main.SERVICE_NAME, not_serving)]
    assert exits == [worker_main.EXIT_DEVICE_FAILED] == [70]


def test_a_mapping_closes_after_its_device_finished(pool, monkeypatch):
    p, m = pool
    order = []
    monkeypatch.setattr(pool_map, "synchronize", lambda device: order.append(("synchronize", device, m.tensor)))
    device = m.tensor.device
    m.close()
    assert [(what, d) for what, d, _ in order] == [("synchronize", device)]
    assert order[0][2] is not None and m.tensor is None  # synchronized while the mapping was still there


def test_an_fp8_pool_is_refused_below_compute_capability_8_9():
    with pytest.raises(ValueError, match=r"cuda:1 has compute capability 8\.0; fp8 needs 8\.9 or later"):
        check_fp8_capability(torch.float8_e4m3fn, (8, 0), "cuda:1")
    for ok in ((8, 9), (9, 0), (10, 0)):
        check_fp8_capability(torch.float8_e4m3fn, ok, "cuda:0")
    check_fp8_capability(torch.bfloat16, (7, 5), "cuda:0")  # other dtypes: any GPU the kernels compile for
