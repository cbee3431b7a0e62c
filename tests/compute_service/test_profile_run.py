"""A GPU worker's profile run (compute_service.profile_run) as far as a CPU checks it: the dummy
step runs the model at the largest batch on a scratch pool and never touches the mapped one; the
refusal and the warning name their terms; ``--max-num-batched-tokens`` reaches the worker's spec.
The measured run itself (torch.cuda.max_memory_allocated) is checked by scripts/gpu_check.py."""

from __future__ import annotations

import pytest
import torch
from helpers.random_llama import random_llama

from compute_service.main import WorkerSpec, build_parser
from compute_service.profile_run import ProfileResult, budget_warning, dummy_step, shortfall_message
from pagedkv.memory.v1 import memory_service_pb2 as mpb

GiB = 2**30


def test_the_dummy_step_runs_the_largest_batch_on_a_scratch_pool():
    model = random_llama(torch.float32)  # 2 layers, 2 KV heads of 16
    pool = torch.randn(8, 2, 2, 4, 2, 16)  # the mapped pool: 8 blocks of 4 tokens
    before = pool.clone()
    calls = []
    model.register_forward_hook(lambda m, args, out: calls.append((args[0].shape, out.shape)))
    scratch = dummy_step(model, pool, 10)
    assert scratch == 3 * 2 * 2 * 4 * 2 * 16 * 4  # ceil(10 / 4) blocks of the pool's layout, float32
    assert calls == [(torch.Size([10]), torch.Size([10, 128]))]  # 10 tokens in, a logits row for each
    assert torch.equal(pool, before)
    with pytest.raises(ValueError, match="max-num-batched-tokens must be >= 1"):
        dummy_step(model, pool, 0)


def sized(weights: int, reserve: int, tokens: int = 512, source=mpb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION):
    return mpb.PoolSizing(source=source, weight_bytes=weights, reserve_bytes=reserve, max_num_batched_tokens=tokens,
                          utilization=0.9, workers_per_device=2)


def test_the_budget_warning_compares_the_measured_need_with_the_share_set_aside():
    run = ProfileResult(num_tokens=512, peak_bytes=GiB, free_bytes=10 * GiB, total_bytes=80 * GiB)
    assert budget_warning(run, 4 * GiB, None) is None
    assert budget_warning(run, 4 * GiB, sized(0, 0, source=mpb.POOL_SIZING_SOURCE_KV_CACHE_MEMORY)) is None
    assert budget_warning(run, 4 * GiB, sized(4 * GiB, GiB)) is None  # exactly the share
    msg = budget_warning(run, 4 * GiB, sized(4 * GiB, GiB // 2))
    for term in ("needs 5.00 GiB", "weights 4.00 GiB", "peak 1.00 GiB at 512 tokens", "the 4.50 GiB",
                 "reserve 512.0 MiB", "--gpu-memory-utilization"):
        assert term in msg, (term, msg)
    msg = budget_warning(run, GiB, sized(4 * GiB, GiB, tokens=256))
    assert "--max-num-batched-tokens 512 is more than the memory service's 256" in msg


def test_the_refusal_names_every_term():
    msg = shortfall_message(8192, 3 * GiB, 80 * GiB, 16 * GiB, 60 * GiB)
    for term in ("--max-num-batched-tokens 8192", "3.00 GiB were free", "80.00 GiB", "pool (60.00 GiB)",
                 "weights (16.00 GiB)", "--gpu-memory-utilization", "--workers-per-device"):
        assert term in msg, (term, msg)


def test_the_worker_takes_max_num_batched_tokens(monkeypatch):
    assert WorkerSpec.from_args(build_parser().parse_args([])).max_num_batched_tokens == 512
    assert WorkerSpec.from_args(build_parser().parse_args(["--max-num-batched-tokens", "64"])).max_num_batched_tokens \
        == 64
    monkeypatch.setenv("PAGEDKV_MAX_NUM_BATCHED_TOKENS", "2048")
    assert WorkerSpec.from_args(build_parser().parse_args([])).max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="max-num-batched-tokens must be >= 1"):
        WorkerSpec.from_args(build_parser().parse_args(["--max-num-batched-tokens", "0"]))
