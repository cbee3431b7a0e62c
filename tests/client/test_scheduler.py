"""The scheduler alone: no service, no model, no tokenizer; exact ids and token counts step by step.

Between steps, :func:`run` does what the engine does to the sequences it ran: give each a sequence
id and enough blocks, count the computed tokens, and append a sampled token where a sequence
computed everything it knows.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from client.engine.reservation import OrcaMax, OrcaOracle, OrcaPow2, Paged
from client.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from client.params import SamplingParams
from client.request import Request, Status

BLOCK = 4
_seq_ids = itertools.count(100)


def scheduler(max_num_seqs: int = 8, max_num_batched_tokens: int = 16, num_workers: int = 1, reservation=None,
              max_context: int = 64, config_mode: str = "recompute") -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, reservation or Paged(), config_mode)
    return Scheduler(config, block_size=BLOCK, max_context=max_context, num_workers=num_workers)


def request(rid: str, prompt_len: int, **params) -> Request:
    ids = list(range(1, prompt_len + 1))
    return Request(rid, ids, SamplingParams(**{"max_tokens": 4, **params}), request_id=rid)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def run(out: SchedulerOutput) -> None:
    """Execute ``out`` as the engine would (allocate, append, compute, sample token 7)."""
    for x in out.scheduled:
        s = x.seq
        if s.seq_id is None:
            s.seq_id = next(_seq_ids)
        s.num_computed += x.num_new_tokens
        s.block_table = list(range(-(-s.num_computed // BLOCK)))
        if s.num_computed == len(s.tokens):
            s.tokens.append(7)


def test_admission_under_the_token_budget():
    sch = scheduler(max_num_batched_tokens=8)
    for rid in ("a", "b", "c"):
        sch.add(request(rid, 4))
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("a", 4), ("b", 4)]
    assert ids(out.admitted) == ["a", "b"] and ids(sch.running) == ["a", "b"] and ids(sch.waiting) == ["c"]
    assert [r.status for r in (out.admitted[0], sch.waiting[0])] == [Status.RUNNING, Status.WAITING]
    run(out)
    # Decodes first (one token each), then the next waiting prompt in what is left of the budget.
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 4)] and ids(out.admitted) == ["c"]


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    sch = scheduler(max_num_batched_tokens=8)
    sch.add(request("long", 20))
    chunks = []
    for _ in range(4):
        out = sch.schedule(available_blocks=100)
        chunks.append(plan(out))
        run(out)
    assert chunks == [[("long", 8)], [("long", 8)], [("long", 4)], [("long", 1)]]
    assert len(sch.running[0].seqs[0].tokens) == 22  # two sampled tokens: after the last chunk and the decode


def test_decodes_go_before_the_rest_of_a_chunked_prefill():
    sch = scheduler(max_num_batched_tokens=8)
    sch.add(request("short", 3))
    sch.add(request("long", 12))
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("short", 3), ("long", 5)]
    run(out)
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("short", 1), ("long", 7)] and out.admitted == []


def test_a_request_joins_between_steps():
    sch = scheduler()
    sch.add(request("first", 5))
    for _ in range(2):  # prefill, one decode
        run(sch.schedule(available_blocks=100))
    sch.add(request("joiner", 6))
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("first", 1), ("joiner", 6)] and ids(out.admitted) == ["joiner"]
    assert ids(sch.running) == ["first", "joiner"]


def test_max_num_seqs_caps_running_requests():
    sch = scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sch.add(request(rid, 2))
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("a", 2), ("b", 2)] and ids(sch.waiting) == ["c"]
    run(out)
    sch.finish(sch.running[0])
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("b", 1), ("c", 2)] and ids(sch.running) == ["b", "c"]


def test_free_blocks_limit_admission_after_this_steps_growth():
    sch = scheduler()
    sch.add(request("a", 4))
    run(sch.schedule(available_blocks=100))  # a: 4 tokens in 1 full block; its decode needs a 2nd block
    sch.add(request("b", 8))  # needs 2 blocks
    out = sch.schedule(available_blocks=2)  # 2 - 1 (a's growth) = 1 < 2
    assert plan(out) == [("a", 1)] and ids(sch.waiting) == ["b"]
    out = sch.schedule(available_blocks=3)  # 3 - 1 = 2
    assert plan(out) == [("a", 1), ("b", 8)] and ids(out.admitted) == ["b"]


def test_forked_sequences_may_each_copy_their_shared_last_block():
    sch = scheduler()
    sch.add(request("n2", 1, n=2, seed=1))  # a one-token prompt: two samples from the start
    run(sch.schedule(available_blocks=100))
    sch.add(request("b", 4))  # needs 1 block
    out = sch.schedule(available_blocks=2)  # 2 - 2 (one copy-on-write block per sample) = 0
    assert plan(out) == [("n2", 1), ("n2", 1)] and ids(sch.waiting) == ["b"]
    out = sch.schedule(available_blocks=3)
    assert plan(out) == [("n2", 1), ("n2", 1), ("b", 4)]


def test_unknown_capacity_admits_nothing():
    sch = scheduler()
    sch.add(request("a", 1))
    out = sch.schedule(available_blocks=0)
    assert plan(out) == [] and ids(sch.waiting) == ["a"]
    assert sch.stalled() and sch.pop_waiting().request_id == "a" and not sch.has_work()


def test_victim_is_the_most_recently_admitted_scheduled_request():
    sch = scheduler()
    for rid in ("a", "b", "c"):
        sch.add(request(rid, 3))
    out = sch.schedule(available_blocks=100)
    assert sch.pick_victim(out.scheduled).request_id == "c"
    out.drop(sch.running[2])
    assert plan(out) == [("a", 3), ("b", 3)] and ids(out.admitted) == ["a", "b"]
    assert sch.pick_victim(out.scheduled).request_id == "b"
    out.drop(sch.running[1])
    assert sch.pick_victim(out.scheduled) is None  # a lone request: preempting it frees nothing for another


def test_preempt_requeues_the_victim_at_the_front_with_reset_sequences():
    sch = scheduler()
    for rid in ("a", "b"):
        sch.add(request(rid, 5))
    for _ in range(3):  # prefill, two decodes
        run(sch.schedule(available_blocks=100))
    sch.add(request("late", 2))
    victim = sch.running[1]
    seq = victim.seqs[0]
    assert (seq.num_computed, len(seq.tokens), len(seq.block_table)) == (7, 8, 2)
    sch.preempt(victim)
    assert ids(sch.running) == ["a"] and ids(sch.waiting) == ["b", "late"]
    assert victim.status == Status.WAITING and victim.metrics.preemptions == 1
    assert (seq.seq_id, seq.block_table, seq.num_computed, seq.grant) == (None, [], 0, None)
    assert seq.generated == [7, 7, 7]  # the tokens stay: recompute prefills prompt + generated
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("a", 1), ("b", 8), ("late", 2)] and ids(out.admitted) == ["b", "late"]


def swapped_pair():
    """``a`` running, ``b`` preempted by swap after its prefill and two decodes, ``late`` waiting."""
    sch = scheduler(config_mode="swap")
    for rid in ("a", "b"):
        sch.add(request(rid, 5))
    for _ in range(3):
        run(sch.schedule(available_blocks=100))
    sch.add(request("late", 2))
    victim = sch.running[1]
    sch.preempt(victim, swap=True)
    return sch, victim


def test_preempt_by_swap_keeps_the_sequences_and_waits_swapped():
    sch, victim = swapped_pair()
    seq = victim.seqs[0]
    assert ids(sch.running) == ["a"] and ids(sch.waiting) == ["b", "late"]
    assert victim.status == Status.SWAPPED
    assert (victim.metrics.preemptions, victim.metrics.swaps) == (1, 1)
    assert seq.seq_id is not None and (seq.block_table, seq.num_computed, seq.grant) == ([0, 1], 7, None)
    assert seq.generated == [7, 7, 7]


def test_a_swapped_request_needs_its_whole_table_to_be_readmitted():
    sch, victim = swapped_pair()
    # b's decode (position 7) fits its 2 blocks: it needs both (either may have left the device), no more.
    out = sch.schedule(available_blocks=1)
    assert plan(out) == [("a", 1)] and out.admitted == [] and out.swapped == []
    out = sch.schedule(available_blocks=2)
    assert plan(out) == [("a", 1), ("b", 1)] and ids(out.swapped) == ["b"] and ids(out.admitted) == ["b"]
    assert victim.status == Status.SWAPPED and ids(sch.running) == ["a", "b"]  # until the engine swaps it in
    assert ids(sch.waiting) == ["late"]  # FCFS: no block left for it
    sch.unadmit(victim)  # its swap-in was refused: it waits, still swapped
    out.drop(victim)
    assert out.swapped == [] and victim.status == Status.SWAPPED and ids(sch.waiting) == ["b", "late"]
    out = sch.schedule(available_blocks=2)
    sch.swapped_in(victim)
    assert victim.status == Status.RUNNING and ids(out.swapped) == ["b"]


def test_lease_recovery_recomputes_swapped_requests_too():
    sch, victim = swapped_pair()
    assert ids(sch.requeue_running()) == ["a", "b"]
    assert ids(sch.waiting) == ["a", "b", "late"] and victim.status == Status.WAITING
    assert (victim.seqs[0].seq_id, victim.seqs[0].block_table, victim.seqs[0].num_computed) == (None, [], 0)


def test_config_refuses_an_unknown_preemption_mode():
    assert SchedulerConfig(preemption_mode="swap").preemption_mode == "swap"
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap, got 'offload'"):
        SchedulerConfig(preemption_mode="offload")


def test_unadmit_puts_the_request_back_at_the_front():
    sch = scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sch.add(request(rid, 3))
    out = sch.schedule(available_blocks=100)
    assert ids(out.admitted) == ["a", "b"] and ids(sch.waiting) == ["c"]
    sch.unadmit(out.admitted[-1])
    out.drop(out.admitted[-1])
    assert plan(out) == [("a", 3)] and ids(out.admitted) == ["a"]
    assert ids(sch.running) == ["a"] and ids(sch.waiting) == ["b", "c"]
    assert sch.waiting[0].status == Status.WAITING and sch.waiting[0].metrics.preemptions == 0


def test_parallel_sampling_prefills_the_prompt_less_its_last_token_once():
    sch = scheduler()
    sch.add(request("n3", 6, n=3, seed=1))
    out = sch.schedule(available_blocks=100)
    assert plan(out) == [("n3", 5)] and len(sch.running[0].seqs) == 1
    run(out)
    assert sch.schedule(available_blocks=100).scheduled == []  # waits for the fork


def test_requests_pin_to_the_least_loaded_worker():
    sch = scheduler(num_workers=2)
    for rid in ("a", "b", "c"):
        sch.add(request(rid, 2))
    sch.schedule(available_blocks=100)
    assert [r.worker for r in sch.running] == [0, 1, 0]


def test_aborts_leave_both_queues():
    sch = scheduler(max_num_seqs=1)
    for rid in ("a", "b", "c"):
        sch.add(request(rid, 2))
    sch.schedule(available_blocks=100)
    sch.abort("a")
    sch.abort("c")
    assert sch.has_work() and ids(sch.take_aborted()) == ["a", "c"]
    assert sch.running == [] and ids(sch.waiting) == ["b"] and sch.take_aborted() == []
    assert ids(sch.drain()) == ["b"] and not sch.has_work()


def test_allocated_counts_prefix_cache_hits_as_computed():
    sch = scheduler()
    sch.add(request("a", 10))
    (x,) = sch.schedule(available_blocks=100).scheduled
    x.allocated(SimpleNamespace(seq_id=5, block_ids=[3, 9, 4], num_tokens=10, num_cached_tokens=8))
    assert (x.seq.seq_id, x.seq.block_table, x.seq.num_computed) == (5, [3, 9, 4], 8)
    assert x.num_new_tokens == 2 and x.token_ids == [9, 10]
    assert x.request.num_cached_tokens == 8
    sch.preempt(x.request)  # recomputed later with nothing cached: the request keeps its first figure
    (y,) = sch.schedule(available_blocks=100).scheduled
    y.allocated(SimpleNamespace(seq_id=6, block_ids=[1, 2, 7], num_tokens=10, num_cached_tokens=0))
    assert y.seq.num_computed == 0 and y.request.num_cached_tokens == 8


@pytest.mark.parametrize(("policy", "tokens", "blocks"),
                         [(OrcaMax(40), 40, 10), (OrcaPow2(), 32, 8), (OrcaOracle(), 19, 5)])
def test_reservation_policies_admit_their_whole_reservation(policy, tokens, blocks):
    sch = scheduler(reservation=policy)
    sch.add(request("a", 6, max_tokens=13))  # final length 19
    assert sch.reservation(sch.waiting[0]) == tokens
    out = sch.schedule(available_blocks=blocks - 1)
    assert plan(out) == [] and ids(sch.waiting) == ["a"]
    out = sch.schedule(available_blocks=blocks)
    assert plan(out) == [("a", 6)]
    with pytest.raises(ValueError, match="reservation policy takes n=1 requests without beam search"):
        sch.add(request("n2", 3, n=2))


def test_a_reservation_is_capped_by_the_context():
    sch = scheduler(reservation=OrcaMax(100), max_context=64)
    assert sch.reservation(request("a", 6, max_tokens=13)) == 64


def test_add_refuses_a_prompt_longer_than_the_context():
    sch = scheduler(max_context=16)
    with pytest.raises(ValueError, match="the prompt has 16 tokens; the model and pool allow 15"):
        sch.add(request("a", 16))
    assert sch.reservation(request("b", 3)) is None and not sch.has_work()


@pytest.mark.parametrize("bad", ["paged", None, 256])
def test_config_refuses_a_reservation_that_is_not_a_policy(bad):
    with pytest.raises(ValueError, match="reservation must be a client.engine.reservation policy"):
        SchedulerConfig(reservation=bad)


def test_a_request_the_admission_gate_holds_waits_at_the_head_and_the_others_go_first():
    """The disk tier's gate (client.engine.disk.DiskGate): a request whose prompt's blocks are being
    read waits, keeps its place at the head of the queue, and the requests behind it are admitted;
    once the gate lets it pass it is admitted before the rest."""
    sch = scheduler(max_num_batched_tokens=8)
    for rid in ("a", "b", "c"):
        sch.add(request(rid, 4))
    reading = {"a"}
    sch.admit_gate = lambda r: r.request_id not in reading
    out = sch.schedule(available_blocks=100)
    assert ids(out.admitted) == ["b", "c"] and ids(sch.waiting) == ["a"] and sch.gate_held == 1
    run(out)
    reading.clear()
    out = sch.schedule(available_blocks=100)
    assert ids(out.admitted) == ["a"] and sch.gate_held == 0 and not sch.waiting
