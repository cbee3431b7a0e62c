"""Per-worker gauges of `pagedkv serve`'s metrics, from the engine's worker view (no services)."""

from __future__ import annotations

import types

from client.engine.failover import Failover
from client.engine.stats import EngineStats, WorkerInfo
from client.serve.metrics import ServeMetrics
from pagedkv.compute.v1 import compute_service_pb2 as cpb


class Backend:
    def __init__(self, workers):
        self.workers = workers

    def engine_stats(self):
        return EngineStats(worker_info=self.workers)

    def stats(self):
        raise RuntimeError("no memory service here")


def test_host_tier_page_lock_per_worker():
    infos = [cpb.GetModelInfoResponse(instance_id="a", host_tier_page_locked=True),
             cpb.GetModelInfoResponse(instance_id="b", host_tier_page_locked=False),
             cpb.GetModelInfoResponse(instance_id="c")]  # a CPU pool, or no host tier
    workers = [types.SimpleNamespace(address=f"127.0.0.1:{5000 + i}") for i in range(3)]
    failover = Failover(None, workers, types.SimpleNamespace(down=set()), lambda: "lease", lambda: 1, 5.0, infos)
    view = failover.info((), ())
    assert [w.host_tier_page_locked for w in view] == [True, False, None]
    reg = ServeMetrics("m", Backend(view)).registry
    got = {s.labels["worker"]: s.value for m in reg.collect() if m.name == "pagedkv:host_tier_page_locked"
           for s in m.samples}
    assert got == {"127.0.0.1:5000": 1.0, "127.0.0.1:5001": 0.0}
    none = ServeMetrics("m", Backend((WorkerInfo("127.0.0.1:1"),))).registry
    assert not [s for m in none.collect() if m.name == "pagedkv:host_tier_page_locked" for s in m.samples]
