"""How the memory service sizes its pool (memory_service.sizing): the flags of ``pagedkv memory``,
``up`` and ``serve`` (defaults on cpu and cuda, precedence, refusals), and a GPU pool sized by
``--gpu-memory-utilization`` on a fake device of known size, block for block."""

from __future__ import annotations

import json

import pytest
from helpers.toy_checkpoint import CONFIG, TOY_WEIGHTS, write_checkpoint

import memory_service.sizing as sizing
from memory_service.main import build_parser
from memory_service.spec import MemorySpec
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.model.source import resolve_model

GiB = 2**30
#: The toy's activation reserve at 32 tokens in bfloat16 (tests/pagedkv/test_gpu_sizing.py, by hand).
RESERVE_32_BF16 = 102400
#: Bytes of one block of the toy in bfloat16 at 16 tokens: 2 layers x K and V x 16 x 2 heads x 16 x 2 bytes.
BLOCK_BF16 = 2 * 2 * 16 * 2 * 16 * 2


def pool_spec(*argv: str):
    return MemorySpec.from_args(build_parser().parse_args(list(argv))).pool


def test_defaults_on_cpu_and_cuda_and_the_absolute_sizes_win():
    cpu = pool_spec()
    assert (cpu.sizing, cpu.kv_cache_memory, cpu.gpu_memory_utilization) == ("default", GiB, None)
    cuda = pool_spec("--device", "cuda")
    assert (cuda.sizing, cuda.gpu_memory_utilization, cuda.kv_cache_memory, cuda.num_blocks) == (
        "gpu_memory_utilization", 0.9, None, None)
    assert (cuda.workers_per_device, cuda.max_num_batched_tokens, cuda.max_model_len) == (1, 512, None)
    given = pool_spec("--device", "cuda:1", "--gpu-memory-utilization", "0.5", "--workers-per-device", "3",
                      "--max-num-batched-tokens", "2048", "--max-model-len", "4096")
    assert (given.gpu_memory_utilization, given.workers_per_device, given.max_num_batched_tokens,
            given.max_model_len, given.device_index) == (0.5, 3, 2048, 4096, 1)
    mem = pool_spec("--device", "cuda", "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "2GiB")
    assert (mem.sizing, mem.kv_cache_memory, mem.gpu_memory_utilization) == ("kv_cache_memory", 2 * GiB, None)
    blocks = pool_spec("--device", "cuda", "--gpu-memory-utilization", "0.5", "--num-blocks", "7")
    assert (blocks.sizing, blocks.num_blocks, blocks.gpu_memory_utilization) == ("num_blocks", 7, None)
    assert pool_spec("--kv-cache-memory", "64MiB").sizing == "kv_cache_memory"


def test_refusals(monkeypatch, capsys):
    with pytest.raises(ValueError, match="sizes a GPU pool.*--device cpu"):
        pool_spec("--gpu-memory-utilization", "0.5")
    for bad in ("0", "1.5", "abc"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--device", "cuda", "--gpu-memory-utilization", bad])
        assert "must be a fraction in (0, 1]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--workers-per-device must be >= 1"):
        pool_spec("--device", "cuda", "--workers-per-device", "0")
    monkeypatch.setenv("PAGEDKV_GPU_MEMORY_UTILIZATION", "1.5")  # argparse checks no default
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        pool_spec("--device", "cuda")
    monkeypatch.setenv("PAGEDKV_GPU_MEMORY_UTILIZATION", "0.7")
    assert pool_spec("--device", "cuda").gpu_memory_utilization == 0.7
    with pytest.raises(ValueError, match="PAGEDKV_GPU_MEMORY_UTILIZATION"):  # set for a cpu service: refused
        pool_spec()


def fake_device(monkeypatch, free: int, total: int) -> list[int]:
    asked: list[int] = []

    def device_memory(index: int) -> tuple[int, int]:
        asked.append(index)
        return free, total

    monkeypatch.setattr(sizing, "device_memory", device_memory)
    return asked


def test_a_gpu_pool_from_utilization_holds_exactly_the_expected_blocks(tmp_path, monkeypatch):
    """8 GiB device, F = 0.5, two workers, 32-token steps, the toy's float32 checkpoint: the workers
    run it in bfloat16 on a GPU, so its 69,952 weights take 2 bytes each."""
    write_checkpoint(tmp_path / "m")
    asked = fake_device(monkeypatch, 7 * GiB, 8 * GiB)
    spec = pool_spec("--device", "cuda:2", "--gpu-memory-utilization", "0.5", "--workers-per-device", "2",
                     "--max-num-batched-tokens", "32", "--model", str(tmp_path / "m"))
    plan = sizing.plan_pool(spec, resolve_model(str(tmp_path / "m"), files="config"))
    pool_bytes = 4 * GiB - 2 * (TOY_WEIGHTS * 2 + RESERVE_32_BF16)
    assert asked == [2]
    assert plan.layout.dtype.name == "bfloat16" and plan.layout.block_nbytes == BLOCK_BF16
    assert plan.layout.num_blocks == pool_bytes // BLOCK_BF16 == 1048457
    z = plan.sizing
    assert (z.source, z.requested_bytes, z.device_total_bytes, z.utilization, z.weight_bytes, z.reserve_bytes,
            z.workers_per_device, z.max_num_batched_tokens, z.weights_from) == (
        pb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION, pool_bytes, 8 * GiB, 0.5, 2 * TOY_WEIGHTS, RESERVE_32_BF16,
        2, 32, "safetensors")
    # A float32 pool (given): the workers run float32, 4 bytes a weight, and twice the reserve's 16-bit terms.
    spec32 = pool_spec("--device", "cuda", "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "32",
                       "--kv-cache-dtype", "float32")
    plan32 = sizing.plan_pool(spec32, resolve_model(str(tmp_path / "m"), files="config"))
    assert plan32.sizing.weight_bytes == 4 * TOY_WEIGHTS and plan32.layout.block_nbytes == 2 * BLOCK_BF16


def test_a_gpu_budget_too_small_or_larger_than_free_memory_is_refused(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "m")
    model = resolve_model(str(tmp_path / "m"), files="config")
    fake_device(monkeypatch, 2**20, 2**20)  # 1 MiB device
    with pytest.raises(ValueError, match=r"no room for the pool: 0.9 x 1.0 MiB device"):
        sizing.plan_pool(pool_spec("--device", "cuda"), model)
    fake_device(monkeypatch, GiB, 8 * GiB)
    with pytest.raises(ValueError, match="less than one sequence of 100000000 tokens"):
        sizing.plan_pool(pool_spec("--device", "cuda", "--max-model-len", "100000000"), model)
    with pytest.raises(ValueError, match=r"does not fit the 1.00 GiB free on cuda:0 now: other processes hold 7.00"):
        sizing.plan_pool(pool_spec("--device", "cuda"), model)


def test_absolute_sizes_never_ask_the_device(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "m")
    model = resolve_model(str(tmp_path / "m"), files="config")
    monkeypatch.setattr(sizing, "device_memory", lambda i: pytest.fail("asked the device"))
    plan = sizing.plan_pool(pool_spec("--device", "cuda", "--kv-cache-memory", "1MiB"), model)
    assert (plan.layout.num_blocks, plan.sizing.source, plan.sizing.requested_bytes) == (
        2**20 // BLOCK_BF16, pb.POOL_SIZING_SOURCE_KV_CACHE_MEMORY, 2**20)
    plan = sizing.plan_pool(pool_spec("--num-blocks", "5", "--kv-cache-dtype", "bfloat16"), model)
    assert (plan.layout.num_blocks, plan.sizing.source, plan.sizing.requested_bytes) == (
        5, pb.POOL_SIZING_SOURCE_NUM_BLOCKS, 5 * BLOCK_BF16)
    plan = sizing.plan_pool(pool_spec("--kv-cache-dtype", "bfloat16"), model)
    assert (plan.layout.num_blocks, plan.sizing.source) == (GiB // BLOCK_BF16, pb.POOL_SIZING_SOURCE_DEFAULT)


def test_up_and_serve_pass_the_utilization_on(monkeypatch):
    """``pagedkv serve`` hands its embedded memory service --gpu-memory-utilization, --max-model-len and
    --max-num-batched-tokens (its workers the last too); on a cpu device it refuses the first, as ``up`` does."""
    from client.ops import launcher
    from client.ops.cli import build_parser as cli_parser
    from client.serve.backends import embedded_args
    from client.serve.config import parse_args

    memory, worker = embedded_args(parse_args(["--gpu-memory-utilization", "0.8", "--max-model-len", "4096",
                                               "--max-num-batched-tokens", "1024"]), "cuda")
    assert memory[memory.index("--gpu-memory-utilization") + 1] == "0.8"
    assert memory[memory.index("--max-model-len") + 1] == "4096"
    assert memory[memory.index("--max-num-batched-tokens") + 1] == worker[worker.index("--max-num-batched-tokens")
                                                                           + 1] == "1024"
    memory, _ = embedded_args(parse_args([]), "cuda")
    assert "--gpu-memory-utilization" not in memory and "--kv-cache-memory" not in memory  # the service's 0.9
    with pytest.raises(ValueError, match="sizes a GPU pool"):
        embedded_args(parse_args(["--gpu-memory-utilization", "0.8"]), "cpu")
    with pytest.raises(SystemExit):
        parse_args(["--gpu-memory-utilization", "0"])
    args = cli_parser().parse_args(["up", "--gpu-memory-utilization", "0.6"])
    assert args.gpu_memory_utilization == 0.6
    monkeypatch.setattr(launcher, "read_state", lambda: pytest.fail("started"))
    with pytest.raises(ValueError, match="sizes a GPU pool"):
        launcher.up(device="cpu", gpu_memory_utilization=0.6)


def test_a_gpu_config_without_weights_sizes_from_its_parameter_count(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    fake_device(monkeypatch, 8 * GiB, 8 * GiB)
    plan = sizing.plan_pool(pool_spec("--device", "cuda", "--max-num-batched-tokens", "32"),
                            resolve_model(str(tmp_path), files="config"))
    assert (plan.sizing.weights_from, plan.sizing.weight_bytes) == ("config", 2 * TOY_WEIGHTS)
    assert plan.sizing.requested_bytes == int(0.9 * 8 * GiB) - (2 * TOY_WEIGHTS + RESERVE_32_BF16)


def test_pagedkv_stats_shows_the_sizing():
    from rich.console import Console

    from client.ops.report import print_stats

    def shown(sizing: pb.PoolSizing) -> str:
        console = Console(width=200, record=True)
        stats = pb.GetStatsResponse(total_blocks=1000, block_size=16, token_capacity=16000, pool_bytes=3 * GiB,
                                    sizing=sizing)
        print_stats(stats, [], console=console)
        return console.export_text()

    text = shown(pb.PoolSizing(source=pb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION, device_total_bytes=80 * GiB,
                               utilization=0.9, weight_bytes=16 * GiB, reserve_bytes=GiB // 2, workers_per_device=2,
                               max_num_batched_tokens=512, weights_from="safetensors"))
    row = next(line for line in text.splitlines() if "gpu_memory_utilization" in line).split()
    assert row[2:] == ["│", "1000", "│", "16000", "│", "3.00", "│", "0.9", "│", "80.00", "│", "2", "│", "16.00",
                       "(safetensors)", "│", "0.50", "│", "512", "│"], row
    text = shown(pb.PoolSizing(source=pb.POOL_SIZING_SOURCE_NUM_BLOCKS))
    assert "num_blocks" in text and "device GiB" not in text


def test_the_dashboard_sends_the_sizing_and_nodes_drop_it():
    from client.backend import total_pool_stats
    from client.serve.dashboard.snapshot import stats_dict

    z = pb.PoolSizing(source=pb.POOL_SIZING_SOURCE_GPU_MEMORY_UTILIZATION, utilization=0.9, weights_from="gguf",
                      weight_bytes=7)
    a, b = pb.GetStatsResponse(total_blocks=8, sizing=z), pb.GetStatsResponse(total_blocks=4, sizing=z)
    d = stats_dict(a)["sizing"]
    assert (d["source"], d["utilization"], d["weights_from"], d["weight_bytes"]) == (3, 0.9, "gguf", 7)
    json.dumps(stats_dict(a))
    total = total_pool_stats([a, b])
    assert total.total_blocks == 12 and not total.HasField("sizing")  # one pool's terms, never a sum
