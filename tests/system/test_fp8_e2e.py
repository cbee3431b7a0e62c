"""An fp8 pool end to end: the first worker calibrates the scales, the next one reads them, and
greedy generation over the fp8 pool matches the float32 pool's on the share of prompts that
benchmarks/bench_fp8_kv.py measured (docs/benchmarks.md, "FP8 KV cache").
"""

from __future__ import annotations

import grpc
import pytest
import torch

import kernels
from client import Client, SamplingParams
from compute_service.kv_calibration import (
    FP8_MAX,
    HEADROOM,
    calibrate,
    calibration_sequences,
    layer_scales,
    scale_rows,
)
from compute_service.model.packed_forward import packed_forward
from pagedkv.config import FP8
from pagedkv.memory.v1 import memory_service_pb2 as mpb
from pagedkv.memory.v1 import memory_service_pb2_grpc as mpb_grpc
from tests.conftest import local_stack

#: The wire name of fp8 (PoolLayout.dtype, GetStats.kv_cache_dtype).
FP8_DTYPE = FP8.name

#: Share of prompts whose first FIRST greedy tokens over an fp8 pool must equal the float32 pool's,
#: at least: bench_fp8_kv.py measured 53.1% of its 64 trace prompts so (docs/benchmarks.md,
#: section 15; bfloat16 KV: 95.3%). These 10 prompts gave 7 on this machine.
MIN_SHARE_FIRST_16 = 0.53
FIRST = 16
#: Windows of benchmarks/corpus.txt, as the benchmark's trace prompts are.
PROMPT_LENGTHS = (37, 64, 101, 150, 211, 280, 333, 420, 19, 88)


@pytest.fixture(scope="module")
def fp8_stack(tmp_path_factory):
    """Memory service with an fp8 pool (256 blocks of 16 tokens) and two workers, started one after the other."""
    with local_stack(tmp_path_factory.mktemp("fp8"), ["--num-blocks", "256", "--block-size", "16",
                                                      "--kv-cache-dtype", "fp8", "--lease-ttl", "30"],
                     num_workers=2, name="fp8") as s:
        yield s


@pytest.fixture(scope="module")
def scales(ours):
    """calibrate()'s scales for the session's fp32 SmolLM2: ([L, H], [L, H])."""
    return calibrate(ours[2], calibration_sequences("smollm2"))


def _forward(model, pool, ids, kv_scales=None):
    """One prefill of ``ids`` into blocks 0.. of ``pool``; logits of every position [T, vocab]."""
    return packed_forward(model, pool, [(list(range(pool.shape[0])), 0, ids)], kv_scales, all_rows=True)


def test_calibrated_scales_cover_the_calibration_text(ours, scales):
    """Scales are amax x HEADROOM / 448 per (layer, KV head): the calibration text's own keys and
    values land at 1/HEADROOM of fp8's range, never saturated."""
    config, _, model = ours
    k, v = scales
    assert k.shape == v.shape == (config.num_layers, config.num_kv_heads) and bool((k > 0).all() and (v > 0).all())
    seq = calibration_sequences("smollm2")[0]
    pool = torch.zeros(-(-len(seq) // 16), config.num_layers, 2, 16, config.num_kv_heads, config.head_dim)
    _forward(model, pool, seq)
    amax = pool.abs().amax(dim=(0, 3, 5))  # [L, 2, H] of this passage alone
    assert bool((amax[:, 0] <= k * FP8_MAX / HEADROOM * (1 + 1e-6)).all())
    assert bool((amax[:, 1] <= v * FP8_MAX / HEADROOM * (1 + 1e-6)).all())


def test_fp8_pool_logits_stay_near_float32(ours, scales, hf_tokenizer):
    """The model over an fp8 pool: next-token distributions within a bound of the float32 pool's,
    and the model refuses an fp8 pool without scales (or scales for another pool)."""
    config, _, model = ours
    ids = hf_tokenizer.encode("The quick brown fox jumps over the lazy dog because it wanted to see the river.")
    shape = (4, config.num_layers, 2, 16, config.num_kv_heads, config.head_dim)
    ref = _forward(model, torch.zeros(shape), ids).log_softmax(-1)
    got = _forward(model, torch.zeros(shape, dtype=kernels.FP8_DTYPE), ids, scale_rows(*scales)).log_softmax(-1)
    # KL(float32 || fp8) per position: measured 0.039 nats mean, 0.26 max on this prompt (a
    # bfloat16 pool: 0.00013 / 0.0008); e4m3 keeps 3 mantissa bits, bfloat16 7.
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert float(kl.mean()) < 0.1 and float(kl.max()) < 0.5, kl
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9
    with pytest.raises(ValueError, match="takes kv_scales"):
        _forward(model, torch.zeros(shape, dtype=kernels.FP8_DTYPE), ids)
    with pytest.raises(ValueError, match="takes no kv_scales"):
        _forward(model, torch.zeros(shape), ids, scale_rows(*scales))


def test_descriptor_scales_of_the_wrong_shape_are_refused(scales):
    from pagedkv.memory.v1 import memory_service_pb2 as pb

    k, v = scales
    good = pb.KvScales(k_scale=k.flatten().tolist(), v_scale=v.flatten().tolist())
    rows = layer_scales(good, *k.shape, "cpu")
    assert len(rows) == k.shape[0] and torch.equal(rows[3][1], v[3])
    with pytest.raises(ValueError, match="num_layers x num_kv_heads"):
        layer_scales(pb.KvScales(k_scale=good.k_scale[1:], v_scale=good.v_scale), *k.shape, "cpu")


def _descriptor(address: str) -> mpb.PoolDescriptor:
    with grpc.insecure_channel(address) as ch:
        return mpb_grpc.MemoryServiceStub(ch).GetPoolDescriptor(mpb.GetPoolDescriptorRequest(), timeout=10).pool


def test_the_first_worker_calibrates_and_the_second_reads_its_scales(fp8_stack, scales):
    desc = _descriptor(fp8_stack.memory.address)
    assert desc.layout.dtype == FP8_DTYPE and desc.kv_scales.source.startswith("calibration:")
    first, second = (w.log() for w in fp8_stack.workers)
    assert "kv_scales_calibrated" in first and "kv_scales_calibrated" not in second
    # The worker's scales are calibrate()'s over the fixed text, here with the same fp32 weights.
    k, v = scales
    assert list(desc.kv_scales.k_scale) == pytest.approx(k.flatten().tolist(), rel=1e-4)
    assert list(desc.kv_scales.v_scale) == pytest.approx(v.flatten().tolist(), rel=1e-4)
    assert all(s > 0 for s in (*desc.kv_scales.k_scale, *desc.kv_scales.v_scale))


def _prompts(tokenizer) -> list[list[int]]:
    from pathlib import Path

    ids = tokenizer.encode((Path(__file__).resolve().parents[2] / "benchmarks" / "corpus.txt").read_text())
    starts = torch.Generator().manual_seed(0)
    return [ids[s : s + n] for n, s in zip(PROMPT_LENGTHS, torch.randint(0, len(ids) - 512, (len(PROMPT_LENGTHS),),
                                                                        generator=starts).tolist())]


def test_fp8_greedy_matches_float32_on_the_measured_share(fp8_stack, stack, hf_tokenizer):
    """The same prompts, greedy, on the session's float32 pool and on the fp8 pool (both workers)."""
    prompts = _prompts(hf_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=FIRST, ignore_eos=True)
    with Client(stack.memory.address, stack.worker_addresses) as c:
        ref = [o.outputs[0].token_ids for o in c.generate(prompts, params)]
    with Client(fp8_stack.memory.address, fp8_stack.worker_addresses) as c:
        got = [o.outputs[0].token_ids for o in c.generate(prompts, params)]
    assert all(len(r) == FIRST for r in ref) and all(len(g) == FIRST for g in got)
    same = sum(r == g for r, g in zip(ref, got))
    assert same / len(prompts) >= MIN_SHARE_FIRST_16, (same, list(zip(ref, got)))
    # Nothing is left held on the fp8 pool.
    with grpc.insecure_channel(fp8_stack.memory.address) as ch:
        s = mpb_grpc.MemoryServiceStub(ch).GetStats(mpb.GetStatsRequest(), timeout=10)
    assert s.used_blocks == 0 and s.kv_cache_dtype == FP8_DTYPE, s
