"""compute_service.model.fused_decode / kernels.cpu.layers: a decode step's layers in one native call.

Reference: the per-op path of the same model on the same step (the fused call runs the same
kernels in the same order), so logits and every byte of the pool must be identical, at several
batches, context lengths and block sizes, in bf16 and fp32 (each on the projection kernel this
CPU's flags choose; a dtype without one is skipped naming the missing flags); and refusals that
leave a step to the per-op path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.model_fixtures import PROMPT, PagedCache, chat_ids

from compute_service.model.llama import LlamaForPagedLM
from compute_service.step_inputs import build_step_inputs
from compute_service.timing import AttentionClock
from kernels.cpu import layers as cpu_layers
from kernels.cpu import native as cpu_native
from pagedkv.compute.v1 import compute_service_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
needs_fused = pytest.mark.skipif(not cpu_layers.available(torch.bfloat16),
                                 reason=f"no fused decode layers here: {cpu_layers.unavailable_reason(torch.bfloat16)}")
DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch."), marks=pytest.mark.skipif(
    not cpu_layers.available(dtype), reason=f"no fused decode layers here: {cpu_layers.unavailable_reason(dtype)}"))
    for dtype in (torch.bfloat16, torch.float32)]


@pytest.fixture(scope="module")
def models(ours):
    config, weights, _ = ours
    built = {}

    def get(dtype):
        if dtype not in built:
            built[dtype] = LlamaForPagedLM(config, weights, "cpu", dtype)
        return config, built[dtype]
    return get


@pytest.fixture(scope="module")
def bf16_model(models):
    return models(torch.bfloat16)


def _step(config, lens: list[int], new: int, block_size: int, seed: int = 0, dtype=torch.bfloat16):
    """A step of sequences with `lens` cached tokens and `new` new tokens each, blocks shuffled
    over a pool with random contents; returns (pool, inputs)."""
    gen = torch.Generator().manual_seed(seed)
    per = [-(-(n + new) // block_size) for n in lens]
    num_blocks = sum(per) + 5
    order = torch.randperm(num_blocks, generator=gen).tolist()
    pool = torch.randn(num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim,
                       generator=gen).to(dtype)
    seqs, used = [], 0
    for i, (n, nb) in enumerate(zip(lens, per)):
        ids = torch.randint(0, config.vocab_size, (new,), generator=gen).tolist()
        seqs.append(pb.StepSequence(seq_id=i, token_ids=ids, positions=list(range(n, n + new)),
                                    block_ids=order[used:used + nb], sampling=pb.SamplingParams(temperature=0.0)))
        used += nb
    inputs = build_step_inputs(pb.StepRequest(sequences=seqs), block_size=block_size, num_blocks=num_blocks,
                               vocab_size=config.vocab_size, device=torch.device("cpu"))
    return pool, inputs


def _both(model, pool, inputs):
    """(logits, pool after) of the fused path (if it applies) and of the per-op path."""
    fused_pool, per_op_pool = pool.clone(), pool.clone()
    fused = model(*inputs.model_args(fused_pool))
    keep, model.fused_decode = model.fused_decode, None
    try:
        per_op = model(*inputs.model_args(per_op_pool))
    finally:
        model.fused_decode = keep
    return (fused, fused_pool), (per_op, per_op_pool)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,block_size", [([0], 16), ([255], 16), ([5, 300, 16, 17, 1, 63], 16),
                                             ([40] * 32, 16), ([7, 100, 33], 1), ([31, 250], 24), ([600, 2], 32)])
def test_fused_layers_give_the_per_op_bits(models, dtype, lens, block_size):
    config, model = models(dtype)
    assert model.fused_decode is not None
    pool, inputs = _step(config, lens, 1, block_size, seed=len(lens) + block_size, dtype=dtype)
    (fused, fused_pool), (per_op, per_op_pool) = _both(model, pool, inputs)
    assert model.native_attention_seconds == 0.0  # the last forward was the per-op one
    assert torch.equal(fused, per_op)
    assert torch.equal(fused_pool.view(torch.uint8), per_op_pool.view(torch.uint8))  # the new K/V, bit for bit
    assert not torch.equal(fused_pool.view(torch.uint8), pool.view(torch.uint8))  # and they were written


@needs_fused
def test_fused_path_taken_only_for_decode_only_steps(bf16_model, monkeypatch):
    config, model = bf16_model
    taken = []
    real = model.fused_decode.run
    monkeypatch.setattr(model.fused_decode, "run", lambda *a: taken.append(1) or real(*a))
    for lens, new in (([3, 50], 1), ([0, 0], 9), ([10], 4)):
        pool, inputs = _step(config, lens, new, 16)
        model(*inputs.model_args(pool))
        assert len(taken) == (1 if new == 1 else 0), (lens, new)
        taken.clear()
    pool, inputs = _step(config, [3, 50], 1, 16)
    with cpu_native.use_native(False):  # native kernels switched off: every op on torch
        model(*inputs.model_args(pool))
    assert not taken


@needs_fused
def test_fused_attention_time_reaches_the_worker_clock(bf16_model):
    config, model = bf16_model
    clock = AttentionClock(model)
    pool, inputs = _step(config, [200] * 4, 1, 16)
    model(*inputs.model_args(pool))
    assert model.native_attention_seconds > 0
    assert clock.seconds == pytest.approx(model.native_attention_seconds)


@needs_fused
def test_a_bad_slot_is_refused_like_the_per_op_path(bf16_model):
    config, model = bf16_model
    pool, inputs = _step(config, [20, 30], 1, 16)
    args = list(inputs.model_args(pool))
    slots = args[3].clone()
    slots[1] = pool.shape[0] * 16  # one past the last slot
    args[3] = slots
    before = pool.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        model(*args)
    assert torch.equal(pool.view(torch.int16), before.view(torch.int16))  # nothing written
    keep, model.fused_decode = model.fused_decode, None
    try:
        with pytest.raises(ValueError, match="slot"):
            model(*args)
    finally:
        model.fused_decode = keep


def test_switch_gives_a_reason():
    env = {**os.environ, cpu_layers.ENV_SWITCH: "0"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kernels.cpu import layers as cpu_layers; "
            "import torch; print(cpu_layers.available(torch.bfloat16), cpu_layers.unavailable_reason(torch.float32))",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert out == f"False disabled by {cpu_layers.ENV_SWITCH}=0"


class _StreamAtNorm(torch.nn.Module):
    """Stands in for the final norm: records the residual stream it is given (x + residual)."""

    def __init__(self):
        super().__init__()
        self.stream = None

    def forward(self, x, residual):
        self.stream = (x.double() + residual.double())
        return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_track_an_fp32_reference_layer_by_layer(models, hf_model, hf_tokenizer, dtype, monkeypatch):
    """The decode step's residual stream after each of several layer counts, fused (the prompt's
    K/V written by our own prefill in the same dtype), against transformers' fp32 forward of the
    whole sequence (no native code): relative L2 error within fp32's or bf16's rounding."""
    config, model = models(dtype)
    ids = chat_ids(hf_tokenizer, PROMPT)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    bound = 2e-5 if dtype == torch.float32 else 0.05  # bf16: a rounding of 2^-8 per op, over the layers
    capture = _StreamAtNorm()
    monkeypatch.setattr(model, "norm", capture)
    monkeypatch.setattr(model, "lm_head", torch.nn.Identity())
    errors, taken, real = {}, [], model.fused_decode.run
    monkeypatch.setattr(model.fused_decode, "run", lambda *a: taken.append(1) or real(*a))
    for layers in (1, 2, 8, 16, config.num_layers - 1):
        cache = PagedCache(model, num_blocks=16)
        cache.pool = torch.zeros_like(cache.pool, dtype=dtype)
        cache.step({0: ids[:-1]})  # prefill, per op
        monkeypatch.setattr(model.fused_decode, "num_layers", layers)
        taken.clear()
        cache.step({0: ids[-1:]})  # the decode step, fused over `layers` layers
        assert taken == [1], "the decode step did not take the fused layers"
        want = ref[layers][0, -1].double()
        errors[layers] = ((capture.stream[0] - want).norm() / want.norm()).item()
        monkeypatch.setattr(model.fused_decode, "num_layers", config.num_layers)
    print(dtype, errors)
    assert max(errors.values()) <= bound, errors
