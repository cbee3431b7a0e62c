"""The "priority" scheduling policy (vLLM's ``--scheduling-policy priority``): the scheduler alone,
exact admission orders and preemption victims."""

from __future__ import annotations

import pytest

from client.engine.reservation import Paged
from client.engine.scheduler import Scheduler, SchedulerConfig
from client.params import SamplingParams
from client.request import Request

BLOCK = 4


def scheduler(policy: str = "priority", max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, Paged(), policy=policy), block_size=BLOCK,
                     max_context=64, num_workers=1)


def request(rid: str, priority: int, arrival: float, prompt_len: int = 4) -> Request:
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), request_id=rid, priority=priority)
    r.metrics.arrival = arrival
    return r


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def test_a_high_priority_request_is_admitted_before_queued_low_priority_ones():
    sch = scheduler(max_num_seqs=1)
    sch.add(request("low-a", 5, 1.0))
    sch.add(request("low-b", 5, 2.0))
    sch.add(request("urgent", -3, 3.0))
    sch.add(request("mid", 0, 4.0))
    assert ids(sch.waiting) == ["urgent", "mid", "low-a", "low-b"]  # lower first, then arrival
    out = sch.schedule(available_blocks=100)
    assert ids(out.admitted) == ["urgent"]
    sch.finish(sch.running[0])
    assert ids(sch.schedule(available_blocks=100).admitted) == ["mid"]


def test_fcfs_keeps_arrival_order_and_refuses_a_priority():
    sch = scheduler("fcfs")
    sch.add(request("a", 0, 2.0))
    sch.add(request("b", 0, 1.0))
    assert ids(sch.waiting) == ["a", "b"]
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        sch.add(request("c", 1, 3.0))
    assert ids(sch.waiting) == ["a", "b"]


def test_the_victim_is_the_least_urgent_latest_request_not_the_last_admitted():
    sch = scheduler()
    for rid, prio, t in (("a", 0, 1.0), ("b", 10, 2.0), ("c", 1, 3.0), ("d", 10, 4.0)):
        sch.add(request(rid, prio, t))
    out = sch.schedule(available_blocks=100)
    assert ids(sch.running) == ["a", "c", "b", "d"]  # admitted in priority order
    assert sch.pick_victim(out.scheduled).request_id == "d"  # priority 10, arrived after b
    out.drop(sch.running[3])
    assert sch.pick_victim(out.scheduled).request_id == "b"
    out.drop(sch.running[2])
    assert sch.pick_victim(out.scheduled).request_id == "c"  # admitted after a, and less urgent


def test_a_preempted_request_waits_at_its_priority_place_not_the_front():
    sch = scheduler(max_num_seqs=2)
    sch.add(request("low", 9, 1.0))
    sch.add(request("high", 0, 2.0))
    sch.schedule(available_blocks=100)
    sch.add(request("mid", 4, 3.0))
    victim = sch.pick_victim([x for x in sch.schedule(available_blocks=100).scheduled])
    assert victim.request_id == "low"
    sch.preempt(victim)
    assert ids(sch.waiting) == ["mid", "low"] and ids(sch.running) == ["high"]
    sch.add(request("higher", -1, 4.0))
    assert ids(sch.waiting) == ["higher", "mid", "low"]


def test_config_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="fcfs, priority"):
        SchedulerConfig(policy="lifo")
