"""The engine's swap preemption (client.engine.swap) against an in-process memory service and worker.

:class:`FakeMemory` keeps the memory service's bookkeeping in small (blocks on the device and in the
host tier, all-or-nothing calls, the errors of DESIGN.md "Tiers and transfers") and a KV store that
records, per (medium, block, slot), the token id written there; SwapOut/SwapIn move those entries
between the tiers as the worker's copies would, and a device block freed loses its KV (someone else
may write it). :class:`FakeWorker` writes each step's tokens into the KV store through the block
table and samples the next token from the context it reads back through the table, so a request
resumes on the right tokens only if every block table the engine hands it is right. The reference
for every output is :func:`reference`: the same next-token function over the plain token list.
"""

from __future__ import annotations

import itertools

import grpc
import pytest

from client.engine.core import Engine
from client.engine.scheduler import SchedulerConfig
from client.errors import FailedPrecondition, OutOfBlocks, OutOfHostBlocks
from client.params import SamplingParams
from client.request import Request, Status
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.grant.v1 import grant_pb2 as gpb
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.model.tokenizer import load_tokenizer
from pagedkv.runtime.errors import HOST_TIER_OFF, OUT_OF_HOST_BLOCKS, SWAP_LOST

BS = 4
DEVICE, HOST = gpb.MEDIUM_DEVICE, gpb.MEDIUM_HOST


def next_token(ctx: list[int]) -> int:
    """The fake model: a token id in [3, 1000) from the whole context."""
    return sum((i + 1) * t for i, t in enumerate(ctx)) % 997 + 3


def reference(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt):]


def blocks_for(tokens: int) -> int:
    return -(-tokens // BS)


class FakeMemory:
    """The memory service's block bookkeeping and the pool's KV as token ids (the module's docstring)."""

    address = "fake-memory"

    def __init__(self, num_blocks: int, host_blocks: int = 0):
        self.num_blocks, self.host_blocks = num_blocks, host_blocks
        self.free_dev = list(range(num_blocks))
        self.free_host = list(range(host_blocks))
        #: seq_id -> {"blocks": device ids, "host": host ids (swapped), "tokens", "computed"}.
        self.seqs: dict[int, dict] = {}
        #: (medium, block, slot) -> token id.
        self.kv: dict[tuple[int, int, int], int] = {}
        self.calls: list[tuple] = []
        self.ids = itertools.count(100)
        #: Swapped-out sequences whose host copies are "never proven" (SwapIn answers SWAP_LOST).
        self.lose_swapped = False
        self.lost: set[int] = set()
        #: SwapIn calls to refuse with OUT_OF_BLOCKS before serving one.
        self.refuse_swap_in = 0
        #: Make each AppendSlots that adds a block list an offload and a copy-on-write for it.
        self.fake_copies = False
        self.cow_pairs: list[tuple[int, int]] = []
        #: Refuse with OUT_OF_BLOCKS (as if another lease took the blocks) the AppendSlots calls of
        #: these numbers (0: the first), and the one right after a swap-in when set.
        self.refuse_appends: set[int] = set()
        self.refuse_append_after_swap_in = False
        #: Free blocks GetStats leaves out (as if another lease were about to take them).
        self.hidden = 0

    # the calls the engine makes ------------------------------------------------------------
    def pool(self):
        return mpb.PoolDescriptor(generation=1, layout=mpb.PoolLayout(block_size=BS, num_blocks=self.num_blocks),
                                  host_num_blocks=self.host_blocks)

    def create_lease(self, ttl=None):
        return mpb.CreateLeaseResponse(lease_id="lease", ttl_seconds=3600, lease_secret="secret")

    def keep_alive(self, lease_id):
        return 3600.0

    def release_lease(self, lease_id):
        return 0

    def stats(self):
        return mpb.GetStatsResponse(generation=1, total_blocks=self.num_blocks,
                                    available_blocks=len(self.free_dev) - self.hidden,
                                    used_blocks=self.num_blocks - len(self.free_dev),
                                    host_total_blocks=self.host_blocks,
                                    host_used_blocks=self.host_blocks - len(self.free_host))

    def allocate(self, lease_id, allocations):
        self.calls.append(("allocate", [a.num_tokens for a in allocations]))
        need = sum(blocks_for(a.num_tokens) for a in allocations)
        self._take_check(need)
        tables, grants = [], []
        for a in allocations:
            sid = next(self.ids)
            blocks = self._take(blocks_for(a.num_tokens))
            self.seqs[sid] = {"blocks": blocks, "host": [], "tokens": a.num_tokens, "computed": 0}
            tables.append(mpb.SequenceBlockTable(seq_id=sid, num_tokens=a.num_tokens, block_ids=blocks))
            grants.append(gpb.StepGrant(seq_id=sid))
        return mpb.AllocateSequencesResponse(sequences=tables, grants=grants)

    def append(self, lease_id, appends, receipts=()):
        refuse = len(self.named("append")) in self.refuse_appends
        if refuse or (self.refuse_append_after_swap_in and self.calls[-1][0] == "swap_in"):
            self.refuse_append_after_swap_in &= refuse
            self.calls.append(("append", "refused"))
            raise OutOfBlocks.of(1, 0, "another lease took the blocks")
        self.calls.append(("append", [a[0] for a in appends]))
        for r in receipts:  # taken first, as the memory service does (all or nothing with the appends)
            if not self.seqs[r.seq_id]["host"]:
                self.seqs[r.seq_id]["computed"] = r.end
        grow = []
        for sid, n, *_ in appends:
            s = self.seqs[sid]
            if s["host"]:
                raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, f"sequence {sid} is swapped out")
            grow.append(blocks_for(s["tokens"] + n) - len(s["blocks"]))
        self._take_check(sum(grow))
        resp = mpb.AppendSlotsResponse()
        for (sid, n, *_), g in zip(appends, grow):
            s = self.seqs[sid]
            first = len(s["blocks"])
            s["blocks"] += self._take(g)
            s["tokens"] += n
            if g:
                resp.updates.add(seq_id=sid, num_tokens=s["tokens"], first_changed=first, block_ids=s["blocks"][first:])
                if self.fake_copies:  # an offload into the host tier, and a copy-on-write onto the new block
                    new = s["blocks"][-1]
                    resp.copies.add(src=new, dst=0, src_medium=DEVICE, dst_medium=HOST, seq_id=sid)
                    resp.copies.add(src=s["blocks"][0], dst=new, src_medium=DEVICE, dst_medium=DEVICE, seq_id=sid)
                    self.cow_pairs.append((s["blocks"][0], new))
            resp.grants.add(seq_id=sid)
        return resp

    def commit(self, lease_id, receipts):
        for r in receipts:
            self.seqs[r.seq_id]["computed"] = r.end
        return mpb.CommitComputedTokensResponse(grants=[gpb.StepGrant(seq_id=r.seq_id) for r in receipts])

    def fork(self, lease_id, parents):
        raise NotImplementedError

    def free(self, lease_id, seq_ids, reason=mpb.FREE_REASON_FINISHED):
        self.calls.append(("free", list(seq_ids), reason))
        for sid in seq_ids:
            s = self.seqs.pop(sid)
            self._release(s["blocks"])
            self.free_host += s["host"]
        return 0

    def swap_out(self, lease_id, seq_ids):
        self.calls.append(("swap_out", list(seq_ids)))
        if not self.host_blocks:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "no host tier", HOST_TIER_OFF)
        need = sum(len(self.seqs[i]["blocks"]) for i in seq_ids)
        if need > len(self.free_host):
            raise OutOfHostBlocks(grpc.StatusCode.RESOURCE_EXHAUSTED, "host tier full", OUT_OF_HOST_BLOCKS,
                                  {"required": str(need), "available": str(len(self.free_host))})
        for sid in seq_ids:
            s = self.seqs[sid]
            s["host"] = [self.free_host.pop(0) for _ in s["blocks"]]
            for b, h in zip(s["blocks"], s["host"]):
                for slot in range(BS):
                    if (DEVICE, b, slot) in self.kv:
                        self.kv[(HOST, h, slot)] = self.kv[(DEVICE, b, slot)]
            self._release(s["blocks"], first=True)  # the next to be handed out, to someone else
            s["blocks"] = []
            if self.lose_swapped:
                self.lost.add(sid)
        return mpb.SwapOutSequencesResponse(host_blocks_reserved=need)

    def swap_in(self, lease_id, seq_ids, appends=()):
        """Swap in, then grow by ``appends`` (seq_id, n, token_ids), all or nothing."""
        self.calls.append(("swap_in", list(seq_ids)))
        if self.lost.intersection(seq_ids):
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "host copy never made", SWAP_LOST)
        grow = {sid: blocks_for(self.seqs[sid]["tokens"] + n) - len(self.seqs[sid]["host"]) for sid, n, _ in appends}
        need = sum(len(self.seqs[i]["host"]) for i in seq_ids) + sum(grow.values())
        if self.refuse_swap_in:
            self.refuse_swap_in -= 1
            raise OutOfBlocks.of(need, 0, "the device is full")
        self._take_check(need)
        added = {sid: n for sid, n, _ in appends}
        resp = mpb.SwapInSequencesResponse()
        for sid in seq_ids:
            s = self.seqs[sid]
            s["blocks"] = self._take(len(s["host"]))
            for b, h in zip(s["blocks"], s["host"]):
                for slot in range(BS):
                    if (HOST, h, slot) in self.kv:
                        self.kv[(DEVICE, b, slot)] = self.kv.pop((HOST, h, slot))
            self.free_host += s["host"]
            s["host"] = []
            assert s["tokens"] == s["computed"], "swapped with slots never computed"
            if sid in added:
                s["blocks"] += self._take(grow[sid])
                s["tokens"] += added[sid]
            resp.sequences.add(seq_id=sid, num_tokens=s["tokens"], block_ids=s["blocks"])
            resp.grants.add(seq_id=sid)
        return resp

    # bookkeeping ---------------------------------------------------------------------------
    def _take_check(self, need: int) -> None:
        if need > len(self.free_dev):
            raise OutOfBlocks.of(need, len(self.free_dev), "out of blocks")

    def _take(self, n: int) -> list[int]:
        taken, self.free_dev = self.free_dev[:n], self.free_dev[n:]
        return taken

    def _release(self, blocks: list[int], first: bool = False) -> None:
        for b in blocks:  # its KV is gone: the next owner writes over it
            for slot in range(BS):
                self.kv.pop((DEVICE, b, slot), None)
        self.free_dev = [*blocks, *self.free_dev] if first else [*self.free_dev, *blocks]

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


class FakeWorker:
    """Writes each step's tokens into the KV store and samples from the context read back through the table."""

    address = "fake-worker"
    timeout = 600.0

    def __init__(self, memory: FakeMemory):
        self.memory = memory
        self.requests: list[cpb.StepRequest] = []
        self.tokens_computed = 0

    def model_info(self, timeout: float = 30.0):
        return cpb.GetModelInfoResponse(model_name="fake", model_source="fake", eos_token_ids=[0], max_context=1024,
                                        pool_generation=1)

    def step(self, request: cpb.StepRequest) -> cpb.StepResponse:
        self.requests.append(request)
        kv = self.memory.kv
        resp = cpb.StepResponse()
        for s in request.sequences:
            assert not self.memory.seqs[s.seq_id]["host"], "a step on a swapped-out sequence"
            table = list(s.block_ids)
            for pos, tok in zip(s.positions, s.token_ids):
                kv[(DEVICE, table[pos // BS], pos % BS)] = tok
            self.tokens_computed += len(s.token_ids)
            end = s.positions[-1] + 1
            r = resp.results.add(seq_id=s.seq_id,
                                 receipt=gpb.StepReceipt(seq_id=s.seq_id, start=s.positions[0], end=end))
            if not s.skip_sampling:
                r.token_id = next_token([kv[(DEVICE, table[p // BS], p % BS)] for p in range(end)])
        return resp


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [21, 22, 23, 24, 25, 26, 27]]
MAX_TOKENS = 12


def make_engine(tokenizer, num_blocks: int = 8, host_blocks: int = 8, mode: str = "swap"):
    memory = FakeMemory(num_blocks, host_blocks)
    worker = FakeWorker(memory)
    engine = Engine(memory, [worker], tokenizer,
                    config=SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode))
    return engine, memory, worker


def submit(engine: Engine, prompts=PROMPTS) -> list[Request]:
    reqs = [Request(p, p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), request_id=f"r{i}")
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add(r)
    return reqs


def run(engine: Engine, until=lambda: False, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not engine.has_work() or until():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def check_outputs(reqs: list[Request], memory: FakeMemory) -> None:
    for r in reqs:
        assert r.error is None and r.seqs[0].generated == reference(r.prompt_token_ids, MAX_TOKENS), r.request_id
    assert memory.seqs == {} and sorted(memory.free_dev) == list(range(memory.num_blocks))
    assert sorted(memory.free_host) == list(range(memory.host_blocks))


#: Tokens an undisturbed run computes: every prompt, then one per generated token but the last.
UNDISTURBED = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)


def test_out_of_blocks_swaps_the_victim_out_and_back_in(tokenizer):
    engine, memory, worker = make_engine(tokenizer)
    reqs = submit(engine)
    run(engine, until=lambda: engine.preemption.swaps > 0)
    # r1, the most recently admitted, went to the host tier with its sequence, table and progress.
    victim = reqs[1]
    s = victim.seqs[0]
    assert victim.status == Status.SWAPPED and engine.scheduler.waiting[0] is victim
    assert memory.named("swap_out") == [("swap_out", [s.seq_id])]
    assert s.seq_id in memory.seqs and len(memory.seqs[s.seq_id]["host"]) == len(s.block_table)
    assert s.num_computed == memory.seqs[s.seq_id]["computed"] and s.grant is None
    assert engine.traces[-1].swapped == ["r1"] == engine.traces[-1].preempted
    sid = s.seq_id
    run(engine)
    assert memory.named("swap_in") == [("swap_in", [sid])]
    assert not [c for c in memory.calls if c[0] == "free" and c[2] == mpb.FREE_REASON_PREEMPTED]
    assert (engine.preemption.swaps, engine.preemption.preemptions, engine.preemption.swap_fallbacks) == (1, 1, 0)
    assert (victim.metrics.swaps, victim.metrics.preemptions) == (1, 1)
    assert worker.tokens_computed == UNDISTURBED  # nothing computed twice
    check_outputs(reqs, memory)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_published_stats_count_what_the_steps_did(tokenizer, mode):
    # The front reads EngineStats, never the engine: it must hold the preemptions the steps made.
    engine, memory, _ = make_engine(tokenizer, mode=mode)
    reqs = submit(engine)
    waiting = engine.stats()
    assert waiting.step_count == 0 and [r.request_id for r in waiting.waiting] == ["r0", "r1"]
    assert waiting.running == () and waiting.lease_id == engine.lease.lease_id
    run(engine, until=lambda: engine.preemption.preemptions > 0)
    snap = engine.stats()
    assert snap.preemptions == 1 and snap.swaps == (mode == "swap") and snap.swap_fallbacks == 0
    assert snap.step_count == engine.step_count and snap.running == (reqs[0],) and snap.waiting == (reqs[1],)
    assert engine.step_log(snap.step_count - 1).steps[-1].preempted == ["r1"]
    run(engine)
    done = engine.stats()
    assert (done.preemptions, done.swaps, done.num_running, done.num_waiting) == (1, mode == "swap", 0, 0)
    assert done.step_count == engine.step_count > snap.step_count and waiting.num_waiting == 2  # frozen copies
    check_outputs(reqs, memory)


@pytest.mark.parametrize("host_blocks", [0, 1], ids=["host-tier-off", "host-tier-full"])
def test_swap_out_refused_falls_back_to_recompute(tokenizer, host_blocks):
    engine, memory, worker = make_engine(tokenizer, host_blocks=host_blocks)
    reqs = submit(engine)
    run(engine)
    (swap_out,) = memory.named("swap_out")
    assert ("free", swap_out[1], mpb.FREE_REASON_PREEMPTED) in memory.calls
    assert memory.named("swap_in") == []
    assert (engine.preemption.swaps, engine.preemption.preemptions, engine.preemption.swap_fallbacks) == (0, 1, 1)
    assert reqs[1].metrics.preemptions == 1 and reqs[1].metrics.swaps == 0
    assert worker.tokens_computed > UNDISTURBED  # the victim's tokens were computed again
    check_outputs(reqs, memory)


def test_recompute_mode_never_swaps(tokenizer):
    engine, memory, _ = make_engine(tokenizer, mode="recompute")
    reqs = submit(engine)
    run(engine)
    assert memory.named("swap_out") == [] and engine.preemption.preemptions == 1 and engine.preemption.swaps == 0
    check_outputs(reqs, memory)


def test_swap_lost_frees_and_recomputes(tokenizer):
    engine, memory, worker = make_engine(tokenizer)
    memory.lose_swapped = True
    reqs = submit(engine)
    run(engine, until=lambda: engine.preemption.swaps > 0)
    lost = reqs[1].seqs[0].seq_id
    run(engine)
    assert memory.named("swap_in") == [("swap_in", [lost])]
    assert ("free", [lost], mpb.FREE_REASON_PREEMPTED) in memory.calls
    assert engine.preemption.swaps == 1 and engine.preemption.swap_fallbacks == 1
    assert worker.tokens_computed > UNDISTURBED
    check_outputs(reqs, memory)


def test_swap_in_out_of_blocks_waits_still_swapped(tokenizer):
    engine, memory, _ = make_engine(tokenizer)
    memory.refuse_swap_in = 1
    reqs = submit(engine)
    run(engine, until=lambda: bool(memory.named("swap_in")))
    victim = reqs[1]
    assert victim.status == Status.SWAPPED and engine.scheduler.waiting[0] is victim
    assert victim not in engine.scheduler.running and victim.seqs[0].seq_id in memory.seqs
    run(engine)
    assert len(memory.named("swap_in")) == 2 and engine.preemption.swap_fallbacks == 0
    check_outputs(reqs, memory)


def test_a_swapped_request_that_cannot_come_back_while_nothing_runs_is_recomputed(tokenizer):
    engine, memory, _ = make_engine(tokenizer)
    reqs = submit(engine)
    run(engine, until=lambda: engine.preemption.swaps > 0)
    run(engine, until=lambda: reqs[0].finished)
    victim = reqs[1]
    sid = victim.seqs[0].seq_id
    memory.hidden = memory.num_blocks - 1  # the pool looks too full for its table: nothing can run
    engine.step()
    assert ("free", [sid], mpb.FREE_REASON_PREEMPTED) in memory.calls and memory.named("swap_in") == []
    assert victim.status == Status.WAITING and victim.seqs[0].seq_id is None and engine.preemption.swap_fallbacks == 1
    memory.hidden = 0
    run(engine)
    check_outputs(reqs, memory)


def test_a_victim_swapped_in_this_step_is_recomputed(tokenizer):
    engine, memory, worker = make_engine(tokenizer, num_blocks=32)
    memory.refuse_appends, memory.refuse_append_after_swap_in = {3}, True
    reqs = submit(engine)
    run(engine, until=lambda: bool(memory.named("swap_in")))
    (swap_in,) = memory.named("swap_in")
    # its reloads have not run: it is freed rather than swapped out again
    assert ("free", swap_in[1], mpb.FREE_REASON_PREEMPTED) in memory.calls and len(memory.named("swap_out")) == 1
    assert reqs[1].status == Status.WAITING and reqs[1].metrics.preemptions == 2 and reqs[1].metrics.swaps == 1
    run(engine)
    assert (engine.preemption.preemptions, engine.preemption.swaps) == (2, 1)
    check_outputs(reqs, memory)


def test_abort_of_a_swapped_request_frees_its_sequences(tokenizer):
    engine, memory, _ = make_engine(tokenizer)
    reqs = submit(engine)
    run(engine, until=lambda: engine.preemption.swaps > 0)
    sid = reqs[1].seqs[0].seq_id
    engine.abort("r1")
    engine.step()
    assert ("free", [sid], mpb.FREE_REASON_ABORTED) in memory.calls and sid not in memory.seqs
    assert reqs[1].status == Status.FINISHED and reqs[1].seqs[0].finish_reason == "abort"
    run(engine)
    assert reqs[0].seqs[0].generated == reference(PROMPTS[0], MAX_TOKENS)
    assert memory.seqs == {} and len(memory.free_host) == memory.host_blocks


def test_fail_all_frees_swapped_requests(tokenizer):
    engine, memory, _ = make_engine(tokenizer)
    reqs = submit(engine)
    run(engine, until=lambda: engine.preemption.swaps > 0)
    engine.fail_all(RuntimeError("stop"))
    assert memory.seqs == {} and len(memory.free_host) == memory.host_blocks
    assert all(r.error is not None for r in reqs)


def test_steps_carry_only_device_to_device_copies(tokenizer):
    engine, memory, worker = make_engine(tokenizer, num_blocks=32)
    memory.fake_copies = True
    submit(engine, PROMPTS[:1])
    run(engine)
    # the copy-on-write pairs AppendSlots listed, in order; none of its offloads (device to host)
    pairs = [(c.src, c.dst) for r in worker.requests for c in r.copies]
    assert pairs == memory.cow_pairs == [(0, 2), (0, 3), (0, 4)]


def test_flags_of_serve_up_and_client(monkeypatch):
    from client.api import Client
    from client.ops.cli import build_parser
    from client.serve.config import parse_args

    args = parse_args(["--preemption-mode", "swap", "--host-cache-memory", "1GiB"])
    assert (args.preemption_mode, args.host_cache_memory) == ("swap", "1GiB")
    assert (parse_args([]).preemption_mode, parse_args([]).host_cache_memory) == ("recompute", None)
    monkeypatch.setenv("PAGEDKV_PREEMPTION_MODE", "swap")
    assert parse_args([]).preemption_mode == "swap"
    monkeypatch.setenv("PAGEDKV_PREEMPTION_MODE", "offload")
    with pytest.raises(SystemExit):
        parse_args([])
    with pytest.raises(SystemExit):
        parse_args(["--preemption-mode", "offload"])
    assert build_parser().parse_args(["up", "--host-cache-memory", "2GiB"]).host_cache_memory == "2GiB"
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap"):
        Client("127.0.0.1:1", ["127.0.0.1:2"], preemption_mode="offload")  # refused before connecting
