"""compute_service.model.decode_graphs: decode in CUDA graphs, its host side checked on CPU.

No GPU here, so nothing is captured: under TRITON_INTERPRET=1 the bucket's padded forward runs
eagerly on the bucket's static inputs, with the split count read from a device tensor, exactly as a
replay would run it. References:
- an eager decode step of the same model on the Triton backend: logits bit for bit, and every byte
  of the pool after the step (the padding rows wrote nothing);
- the CPU production path (torch backend): the same logits within fp32 rounding;
- the eager split policy (`kernels.plan.default_num_splits`): the same split count for every batch
  and length, never more than the bucket's captured grid.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

from helpers.random_llama import random_llama  # noqa: E402

import kernels  # noqa: E402
from compute_service.model.decode_graphs import DecodeGraphs, bucket_for, capture_sizes  # noqa: E402
from compute_service.step_inputs import build_step_inputs  # noqa: E402
from kernels.plan import default_num_splits, split_size  # noqa: E402
from pagedkv.compute.v1 import compute_service_pb2 as pb  # noqa: E402

interpret = pytest.mark.skipif(not INTERPRET, reason="triton was imported before TRITON_INTERPRET=1 could be set; "
                               "run this module on its own")
BLOCK = 16


def test_capture_sizes_and_buckets():
    sizes = capture_sizes(64)
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4] and capture_sizes(0) == []
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64, 65, 0)] == [1, 2, 4, 8, 8, 16, 64, 64, None, None]
    with pytest.raises(ValueError, match="at most 4096"):
        capture_sizes(5000)


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_split_args_are_the_eager_policy_within_the_grid(kv_heads):
    """For every batch of every bucket and a range of lengths: the split count a replay uses is the
    eager path's, and the bucket's grid (fixed at capture) holds it."""
    pool = torch.empty(1, 1, 2, BLOCK, kv_heads, 16)
    graphs = DecodeGraphs(object(), pool, max_size=32, max_blocks=256, capture=False)
    for size in graphs.sizes:
        bucket = graphs._bucket(size)
        grid = bucket.plan.num_splits
        smaller = graphs.sizes[graphs.sizes.index(size) - 1] if size > 1 else 0
        for seqs in range(smaller + 1, size + 1):
            for length in (1, 100, 129, 1000, 4096):
                eager = default_num_splits(seqs, kv_heads, length)
                assert eager <= grid, (size, seqs, length)
                assert graphs.split_args(seqs, length, grid) == (eager, split_size(length, eager))


def _decode_step(lens: list[int], vocab: int, num_blocks: int, seed: int) -> pb.StepRequest:
    """A decode step: sequence i holds lens[i] - 1 cached tokens and adds one, its blocks drawn
    without replacement from the pool."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    seqs = []
    for i, n in enumerate(lens):
        table = [order.pop() for _ in range(-(-n // BLOCK))]
        seqs.append(pb.StepSequence(seq_id=i + 1, token_ids=[int(torch.randint(vocab, (1,), generator=g))],
                                    positions=[n - 1], block_ids=table, output_index=0))
    return pb.StepRequest(sequences=seqs)


def _eager_triton(model, pool, inputs) -> torch.Tensor:
    plan = kernels.plan_attention(inputs.block_tables, inputs.query_start_loc, inputs.seq_lens, BLOCK,
                                  backend="triton", host_query_start_loc=inputs.host_query_start_loc,
                                  host_seq_lens=inputs.host_seq_lens, num_kv_heads=pool.shape[4])
    return model(inputs.token_ids, inputs.positions, pool, inputs.slot_mapping, plan, inputs.logits_indices)


@interpret
@pytest.mark.parametrize("lens", [[5, 300, 17], [1], [40, 33, 129, 2, 64, 200]], ids=["3-of-4", "1", "6-of-8"])
def test_padded_decode_equals_eager_step_bit_for_bit(lens):
    """A decode step through its bucket (padding rows, split count on the device) gives the eager
    Triton step's logits bit for bit and leaves the same pool bytes; the CPU path agrees."""
    torch.manual_seed(0)
    model = random_llama(torch.float32, max_positions=512)
    num_blocks = 64
    pool = torch.randn(num_blocks, 2, 2, BLOCK, 2, 16)
    request = _decode_step(lens, 128, num_blocks, seed=len(lens))
    inputs = build_step_inputs(request, block_size=BLOCK, num_blocks=num_blocks, vocab_size=128, device="cpu")
    graphs = DecodeGraphs(model, pool_graph := pool.clone(), max_size=8, max_blocks=512 // BLOCK, capture=False)
    graphs.capture_all()
    assert torch.equal(pool_graph, pool), "building the buckets wrote to the pool"
    assert graphs.applies(inputs.num_tokens, len(lens), inputs.block_tables.shape[1])
    got = graphs.run(inputs)
    bucket = graphs.buckets[bucket_for(len(lens), graphs.sizes)]
    max_len = max(lens)
    assert bucket.plan.split_args.tolist() == [default_num_splits(len(lens), 2, max_len),
                                               split_size(max_len, default_num_splits(len(lens), 2, max_len))]
    pool_eager = pool.clone()
    want = _eager_triton(model, pool_eager, inputs)
    assert got.shape == (len(lens), 128) and torch.equal(got, want)
    assert torch.equal(pool_graph, pool_eager), "the padded step wrote other bytes than the eager step"
    # The CPU production path (torch backend) on the same step: fp32 rounding apart.
    pool_cpu = pool.clone()
    cpu = model(*inputs.model_args(pool_cpu))
    torch.testing.assert_close(got, cpu, atol=2e-5, rtol=1e-5)


@interpret
def test_wide_tables_and_prefill_stay_eager():
    pool = torch.zeros(8, 2, 2, BLOCK, 2, 16)
    graphs = DecodeGraphs(object(), pool, max_size=4, max_blocks=4, capture=False)
    assert not graphs.applies(1, 1, 1), "nothing built yet"
    for size in graphs.sizes:
        graphs.buckets[size] = graphs._bucket(size)
    assert graphs.applies(4, 4, 4)
    assert not graphs.applies(5, 4, 4), "a prefill chunk (more tokens than sequences)"
    assert not graphs.applies(5, 5, 4), "more sequences than the largest bucket"
    assert not graphs.applies(1, 1, 5), "a table wider than the buckets'"
    with pytest.raises(ValueError, match="largest batch"):
        DecodeGraphs(object(), pool, max_size=0, max_blocks=4)


@interpret
def test_worker_runs_decode_steps_in_its_graphs_and_drops_them_with_the_pool():
    """A real worker over a mapped CPU pool, its graphs built without capture: a signed decode step
    runs in its bucket (one replay), with the eager worker's tokens and pool bytes; a prefill step
    stays eager; dropping the pool drops the graphs (they hold its addresses)."""
    import time

    from compute_service.pool_map import map_handle
    from compute_service.worker import Worker
    from memory_service.layout import PoolLayout
    from memory_service.pool import CpuPool
    from pagedkv.grant.v1 import grant_pb2
    from pagedkv.runtime.grants import sign_grant, token_digest
    from pagedkv.runtime.pool_socket import PoolHandle

    model = random_llama(torch.float32, max_positions=512)
    p = CpuPool(PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK, dtype="float32",
                           num_blocks=32), pool_id="graphs")
    handle = PoolHandle(p.worker_descriptor(), p.plane_key, {k: os.dup(fd) for k, fd in p.worker_fds().items()})
    try:
        m = map_handle(handle)
    finally:
        handle.close()
    m.tensor.copy_(torch.randn(m.tensor.shape, generator=torch.Generator().manual_seed(3)))

    def step(lens: dict[int, int], tables: dict[int, list[int]], new: int = 1) -> pb.StepRequest:
        seqs = []
        for sid, n in lens.items():
            tokens = [(sid * 7 + i) % 128 for i in range(new)]
            grant = sign_grant(p.plane_key, grant_pb2.StepGrant(
                pool_generation=p.generation, seq_id=sid, block_ids=tables[sid],
                block_epochs=p.epochs[tables[sid]].tolist(), readable_tokens=n - new, write_end=n,
                token_digest=token_digest(tokens), expires_at=time.time() + 60))
            seqs.append(pb.StepSequence(seq_id=sid, token_ids=tokens, positions=range(n - new, n),
                                         block_ids=tables[sid], grant=grant, output_index=0))
        return pb.StepRequest(pool_generation=p.generation, sequences=seqs)

    worker = Worker(model, model.config, m, max_capture_size=4)
    assert worker.graphs is None, "a CPU pool is never captured"
    tables = {1: [4, 9], 2: [7], 3: [12, 2, 30]}
    decode = step({1: 20, 2: 3, 3: 40}, tables)
    before = m.tensor.clone()
    eager = worker.step(decode)
    eager_pool = m.tensor.clone()
    m.tensor.copy_(before)
    worker.graphs = DecodeGraphs(model, m.tensor, max_size=4, max_blocks=512 // BLOCK, capture=False)
    worker.graphs.capture_all()
    replayed = worker.step(decode)
    assert worker.graphs.replays == 1
    assert [r.token_id for r in replayed.results] == [r.token_id for r in eager.results]
    # The same slots written (the eager worker's CPU path rounds its attention differently: the
    # second layer's K/V agree within fp32 rounding); every other byte unchanged.
    written = [(tables[sid][(n - 1) // BLOCK], (n - 1) % BLOCK) for sid, n in ((1, 20), (2, 3), (3, 40))]
    for blk, off in written:
        torch.testing.assert_close(m.tensor[blk, :, :, off], eager_pool[blk, :, :, off], atol=1e-5, rtol=1e-5)
        assert not torch.equal(m.tensor[blk, :, :, off], before[blk, :, :, off])
        m.tensor[blk, :, :, off] = before[blk, :, :, off]
    assert torch.equal(m.tensor, before), "the padded step wrote outside its slots"
    worker.step(step({1: 20}, tables, new=4))  # a prefill chunk: eager (its grant reads nothing past position 16)
    assert worker.graphs.replays == 1
    worker.set_pool(None)
    assert worker.graphs is None
    p.close()
