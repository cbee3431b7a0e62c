"""The compute worker over gRPC: real processes, the real model, a pool shared by two workers."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.credentials import new_lease
from helpers.model_fixtures import PROMPT, chat_ids, hf_greedy

from client.errors import error_info
from kernels.cpu import layers as cpu_layers
from kernels.cpu import packed_linear
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc


class Driver:
    """Allocates through the memory service and steps workers by hand, greedy."""

    def __init__(self, stack):
        self.mem_channel = grpc.insecure_channel(stack.memory.address)
        self.mem = mpb_grpc.MemoryServiceStub(self.mem_channel)
        self.channels = [grpc.insecure_channel(a) for a in stack.worker_addresses]
        self.workers = [cpb_grpc.ComputeServiceStub(c) for c in self.channels]
        self.pool = self.mem.GetPoolDescriptor(mpb.GetPoolDescriptorRequest()).pool
        self.lease, self.md = new_lease(self.mem)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        #: Each sequence's latest grant (from the memory service's replies).
        self.grants: dict[int, object] = {}

    def allocate(self, n: int) -> int:
        resp = self.mem.AllocateSequences(mpb.AllocateSequencesRequest(
            lease_id=self.lease, sequences=[mpb.SequenceAllocation(num_tokens=n)]), metadata=self.md)
        (s,), (g,) = resp.sequences, resp.grants
        self.tables[s.seq_id], self.lens[s.seq_id], self.grants[s.seq_id] = list(s.block_ids), 0, g
        return s.seq_id

    def fork(self, seq: int) -> int:
        resp = self.mem.ForkSequences(
            mpb.ForkSequencesRequest(lease_id=self.lease, forks=[mpb.SequenceFork(parent_seq_id=seq)]), metadata=self.md
        )
        (c,), (g,) = resp.children, resp.grants
        self.tables[c.seq_id], self.lens[c.seq_id], self.grants[c.seq_id] = list(c.block_ids), self.lens[seq], g
        return c.seq_id

    def commit(self, results) -> None:
        """Hand the step's receipts to the memory service; keep the fresh grants."""
        resp = self.mem.CommitComputedTokens(
            mpb.CommitComputedTokensRequest(lease_id=self.lease, receipts=[r.receipt for r in results]),
            metadata=self.md,
        )
        self.grants.update((g.seq_id, g) for g in resp.grants)

    def step(
        self, worker: int, chunks: dict[int, list[int]], num_logprobs: int | None = None
    ) -> dict[int, cpb.StepResult]:
        """Append slots (except for fresh allocations), then one Step with every chunk."""
        grow = [(s, len(t)) for s, t in chunks.items() if self.lens[s] > 0]
        copies = []
        if grow:
            resp = self.mem.AppendSlots(
                mpb.AppendSlotsRequest(
                    lease_id=self.lease, appends=[mpb.SlotAppend(seq_id=s, num_tokens=n) for s, n in grow]
                ),
                metadata=self.md,
            )
            for u in resp.updates:
                self.tables[u.seq_id][u.first_changed :] = list(u.block_ids)
            self.grants.update((g.seq_id, g) for g in resp.grants)
            copies = [cpb.BlockCopy(src=c.src, dst=c.dst) for c in resp.copies]
        req = cpb.StepRequest(pool_generation=self.pool.generation, copies=copies)
        for s, toks in chunks.items():
            start = self.lens[s]
            sp = cpb.SamplingParams(num_logprobs=num_logprobs) if num_logprobs else cpb.SamplingParams()
            req.sequences.append(
                cpb.StepSequence(
                    seq_id=s,
                    token_ids=toks,
                    positions=range(start, start + len(toks)),
                    block_ids=self.tables[s],
                    sampling=sp,
                    grant=self.grants[s],
                )
            )
            self.lens[s] = start + len(toks)
        results = self.workers[worker].Step(req).results
        self.commit(results)
        return {r.seq_id: r for r in results}

    def close(self):
        self.mem.ReleaseLease(mpb.ReleaseLeaseRequest(lease_id=self.lease), metadata=self.md)
        for c in [self.mem_channel, *self.channels]:
            c.close()


@pytest.fixture
def driver(stack):
    d = Driver(stack)
    yield d
    d.close()


def test_model_info(driver):
    info = driver.workers[0].GetModelInfo(cpb.GetModelInfoRequest())
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.vocab_size) == (30, 3, 64, 49152)
    assert info.model_source == "smollm2" and info.weights_path.endswith(".gguf")
    assert list(info.eos_token_ids) == [2] and info.dtype == "float32" and info.device == "cpu"
    assert info.pool_generation == driver.pool.generation and info.block_size == 16 and info.num_blocks == 512
    # the CPU path the flags chose, as the worker's own process resolves it
    kernel = packed_linear.describe(torch.float32)
    fused = "fused" if cpu_layers.available(torch.float32) else "per-op"
    assert info.cpu_path.startswith(f"projections={kernel} decode_layers={fused}"), info.cpu_path


def test_one_worker_prefills_the_other_decodes(driver, hf_model, hf_tokenizer):
    """KV written by one process is read by another from the shared blocks, no copy."""
    ids = chat_ids(hf_tokenizer, PROMPT)
    ref, _ = hf_greedy(hf_model, ids, 8)
    seq = driver.allocate(len(ids))
    got = [driver.step(0, {seq: ids})[seq].token_id]
    for _ in range(8):
        got.append(driver.step(1, {seq: [got[-1]]})[seq].token_id)
    assert got == ref


def test_copy_on_write_through_step(driver, hf_model, hf_tokenizer):
    """Fork after the prompt, children diverge; each continuation equals an unshared run."""
    ids = chat_ids(hf_tokenizer, "Name a color.")
    assert len(ids) % 16 != 0  # the last prompt block is shared and partly filled: forks must copy it
    parent = driver.allocate(len(ids))
    res = driver.step(0, {parent: ids}, num_logprobs=2)[parent]
    first, second = res.top_logprobs[0].token_id, res.top_logprobs[1].token_id
    child = driver.fork(parent)
    assert driver.tables[child] == driver.tables[parent]
    cont = {parent: [first], child: [second]}
    for _ in range(6):
        out = driver.step(1, {s: [toks[-1]] for s, toks in cont.items()})
        for s in cont:
            cont[s].append(out[s].token_id)
    assert driver.tables[child][-1] != driver.tables[parent][-1]  # the copy happened
    for s, toks in cont.items():
        ref, _ = hf_greedy(hf_model, ids + toks[:1], 5)  # 6 tokens
        assert toks[1:] == ref, f"sequence {s} diverged from its unshared run"


def bad_step(driver, mutate) -> grpc.RpcError:
    ids = [1, 2, 3, 4, 5]
    seq = driver.allocate(len(ids))
    req = cpb.StepRequest(
        pool_generation=driver.pool.generation,
        sequences=[
            cpb.StepSequence(
                seq_id=seq, token_ids=ids, positions=range(5), block_ids=driver.tables[seq], grant=driver.grants[seq]
            )
        ],
    )
    mutate(req)
    with pytest.raises(grpc.RpcError) as exc:
        driver.workers[0].Step(req)
    return exc.value


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
BAD = [
    ("stale generation", lambda r: setattr(r, "pool_generation", r.pool_generation - 1), PRECONDITION),
    ("empty batch", lambda r: r.ClearField("sequences"), INVALID),
    ("table too short", lambda r: r.sequences[0].positions.__setitem__(slice(None), range(20, 25)), INVALID),
    ("block outside pool", lambda r: r.sequences[0].block_ids.__setitem__(0, 10**6), INVALID),
    ("positions skip", lambda r: r.sequences[0].positions.__setitem__(2, 7), INVALID),
    ("negative position", lambda r: r.sequences[0].positions.__setitem__(slice(None), range(-1, 4)), INVALID),
    ("temperature < 0", lambda r: setattr(r.sequences[0].sampling, "temperature", -1.0), INVALID),
    ("top_p > 1", lambda r: setattr(r.sequences[0].sampling, "top_p", 1.5), INVALID),
    ("too many logprobs", lambda r: setattr(r.sequences[0].sampling, "num_logprobs", 1000), INVALID),
    ("token outside vocab", lambda r: r.sequences[0].token_ids.__setitem__(0, 49152), INVALID),
    ("negative token", lambda r: r.sequences[0].token_ids.__setitem__(0, -3), INVALID),
    ("no tokens", lambda r: (r.sequences[0].ClearField("token_ids"), r.sequences[0].ClearField("positions")), INVALID),
    ("duplicate seq", lambda r: r.sequences.append(r.sequences[0]), INVALID),
    ("copy outside pool", lambda r: r.copies.append(cpb.BlockCopy(src=0, dst=10**6)), INVALID),
    ("bitmask one word short", lambda r: setattr(r.sequences[0], "token_bitmask", b"\xff" * (4 * 1536 - 4)), INVALID),
    ("bitmask allows nothing", lambda r: setattr(r.sequences[0], "token_bitmask", bytes(4 * 1536)), INVALID),
]


@pytest.mark.parametrize("name,mutate,code", BAD, ids=[b[0] for b in BAD])
def test_bad_step_gets_its_code_and_worker_stays_healthy(driver, stack, name, mutate, code):
    err = bad_step(driver, mutate)
    assert err.code() == code, err.details()
    reason = "POOL_GENERATION_MISMATCH" if name == "stale generation" else code.name  # clients recover on it
    assert error_info(err)[0] == reason and len(err.details()) > 20
    with grpc.insecure_channel(stack.worker_addresses[0]) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    # And it still computes.
    seq = driver.allocate(3)
    assert driver.step(0, {seq: [1, 2, 3]})[seq].HasField("token_id")


def test_step_reports_its_time_split(driver):
    seq = driver.allocate(40)
    req = cpb.StepRequest(
        pool_generation=driver.pool.generation,
        sequences=[
            cpb.StepSequence(
                seq_id=seq,
                token_ids=list(range(1, 41)),
                positions=range(40),
                block_ids=driver.tables[seq],
                grant=driver.grants[seq],
            )
        ],
    )
    resp = driver.workers[0].Step(req)
    assert resp.num_tokens == 40
    assert 0 < resp.attention_seconds < resp.model_seconds < resp.step_seconds
