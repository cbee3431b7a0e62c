"""fp8 pools on the memory service: capacity, SetKvScales (signed, first wins) and --kv-scales-file.

No model runs here; the worker side (calibration, generation) is in tests/system/test_fp8_e2e.py.
"""

from __future__ import annotations

import json
import math

import grpc
import pytest

from client.errors import error_info
from memory_service.main import build_parser, create_pool
from memory_service.spec import MemorySpec
from pagedkv.config import BFLOAT16, FP8
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.runtime.kv_scales import load_scales_file, scales_document, sign_scales
from pagedkv.runtime.pool_socket import receive_handle
from tests.conftest import local_stack

C = grpc.StatusCode
#: The wire name of fp8 (PoolLayout.dtype, GetStats.kv_cache_dtype).
FP8_DTYPE = FP8.name
L, H = 30, 3  # SmolLM2's layers and KV heads
#: SmolLM2's KV bytes per token in float32: layers x K,V x KV heads x head_dim x 4 bytes.
FP32_BYTES_PER_TOKEN = L * 2 * H * 64 * 4


def _scales(k=0.5, v=0.25, source="test") -> pb.KvScales:
    return pb.KvScales(k_scale=[k + i / 1000 for i in range(L * H)], v_scale=[v] * (L * H), source=source)


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """Memory services of one size (8 MiB) in float32, bfloat16 and fp8."""
    tmp = tmp_path_factory.mktemp("kv_scales")
    stacks = {d: local_stack(tmp, ["--kv-cache-memory", "8MiB", "--block-size", "16", "--kv-cache-dtype", d],
                             num_workers=0, name=f"mem-{d}") for d in ("float32", "bfloat16", "fp8")}
    for s in stacks.values():
        s.start()
    yield {d: s.memory for d, s in stacks.items()}
    for s in stacks.values():
        s.stop()


def _stub(svc):
    return pb_grpc.MemoryServiceStub(grpc.insecure_channel(svc.address))


def test_fp8_pool_holds_4x_the_tokens_of_float32_in_the_same_memory(pools):
    stats = {d: _stub(s).GetStats(pb.GetStatsRequest(), timeout=10) for d, s in pools.items()}
    for dtype, size, name in (("float32", 4, "float32"), ("bfloat16", 2, "bfloat16"), ("fp8", 1, FP8_DTYPE)):
        s = stats[dtype]
        assert s.kv_cache_dtype == name
        assert s.kv_bytes_per_token == FP32_BYTES_PER_TOKEN // 4 * size
        blocks = (8 << 20) // (16 * s.kv_bytes_per_token)
        assert (s.total_blocks, s.token_capacity,
                s.pool_bytes) == (blocks, blocks * 16, blocks * 16 * s.kv_bytes_per_token)
    assert stats["fp8"].token_capacity // stats["float32"].token_capacity == 4
    assert stats["fp8"].token_capacity // stats["bfloat16"].token_capacity == 2
    desc = _stub(pools["fp8"]).GetPoolDescriptor(pb.GetPoolDescriptorRequest(), timeout=10).pool
    assert desc.layout.dtype == FP8_DTYPE and desc.block_nbytes == 16 * FP32_BYTES_PER_TOKEN // 4
    assert not desc.HasField("kv_scales")  # no worker calibrated yet


def _set(stub, generation, scales, key):
    return stub.SetKvScales(pb.SetKvScalesRequest(pool_generation=generation, scales=scales,
                                                  signature=sign_scales(key, generation, scales)), timeout=10)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value


def test_set_kv_scales_needs_the_plane_key_and_keeps_the_first(pools):
    """Only a worker of the pool (it holds the plane key) sets scales; bad ones change nothing; the
    first accepted set stays for the generation and later callers get it back."""
    svc = pools["fp8"]
    stub = _stub(svc)
    desc = stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest(), timeout=10).pool
    handle = receive_handle(desc.worker_socket)
    key, gen = handle.plane_key, desc.generation
    handle.close()
    good = _scales()
    # Not signed with the plane key: an outsider (another tenant on the host) cannot poison the pool.
    e = _refused(lambda: _set(stub, gen, good, b"\x00" * 32))
    assert e.code() == C.PERMISSION_DENIED and "plane key" in e.details()
    forged = pb.SetKvScalesRequest(pool_generation=gen, scales=good, signature=sign_scales(key, gen, _scales(k=9)))
    assert _refused(lambda: stub.SetKvScales(forged, timeout=10)).code() == C.PERMISSION_DENIED
    e = _refused(lambda: _set(stub, gen + 1, good, key))
    assert e.code() == C.FAILED_PRECONDITION and "generation" in e.details()
    for bad, why in ((pb.KvScales(k_scale=[1.0] * (L * H - 1), v_scale=[1.0] * (L * H)), "90 values, got 89"),
                     (pb.KvScales(k_scale=[1.0] * (L * H), v_scale=[0.0] * (L * H)), "finite and > 0"),
                     (pb.KvScales(k_scale=[math.nan] * (L * H), v_scale=[1.0] * (L * H)), "finite and > 0"),
                     (pb.KvScales(k_scale=[1.0] * (L * H), v_scale=[-math.inf] * (L * H)), "finite and > 0")):
        e = _refused(lambda bad=bad: _set(stub, gen, bad, key))
        assert e.code() == C.INVALID_ARGUMENT and why in e.details(), e.details()
        assert error_info(e)[0] == "INVALID_ARGUMENT"
    assert not stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest(), timeout=10).pool.HasField("kv_scales")

    first = _set(stub, gen, good, key)
    assert first.accepted and list(first.scales.k_scale) == pytest.approx(list(good.k_scale))
    second = _set(stub, gen, _scales(k=2.0, source="late"), key)
    assert not second.accepted and second.scales == first.scales  # the first stays: KV was written with it
    kept = stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest(), timeout=10).pool.kv_scales
    assert kept == first.scales and kept.source == "test"
    # A worker mapping the pool from now on gets them over the socket too.
    handle = receive_handle(desc.worker_socket)
    try:
        assert handle.descriptor.kv_scales == kept
    finally:
        handle.close()


def test_a_pool_that_is_not_fp8_takes_no_scales(pools):
    stub = _stub(pools["float32"])
    desc = stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest(), timeout=10).pool
    handle = receive_handle(desc.worker_socket)
    key = handle.plane_key
    handle.close()
    e = _refused(lambda: _set(stub, desc.generation, _scales(), key))
    assert e.code() == C.FAILED_PRECONDITION and "float32" in e.details() and "fp8" in e.details()
    assert not stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest(), timeout=10).pool.HasField("kv_scales")


def test_kv_scales_file_round_trip_and_its_refusals(tmp_path):
    scales = _scales(source="x")
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(scales_document(scales, H)))
    got = load_scales_file(path, L, H)
    assert list(got.k_scale) == pytest.approx(list(scales.k_scale)) and got.source == f"file:{path}"
    for doc, why in (({"k_scale": [[1.0] * H] * L}, "v_scale must be a [30][3]"),
                     ({"k_scale": [[1.0] * H] * (L - 1), "v_scale": [[1.0] * H] * L}, "k_scale must be a [30][3]"),
                     ({"k_scale": [[1.0] * H] * L, "v_scale": [[0.0] * H] * L}, "finite and > 0"),
                     ({"k_scale": [["1"] * H] * L, "v_scale": [[1.0] * H] * L}, "numbers"),
                     ([1, 2], "an object")):
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
            load_scales_file(path, L, H)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_scales_file(path, L, H)


def _pool_args(*flags: str) -> MemorySpec:
    return MemorySpec.from_args(build_parser().parse_args(["--num-blocks", "4", "--block-size", "16", *flags]))


def test_kv_scales_file_sets_the_pool_at_start(tmp_path):
    path = tmp_path / "scales.json"
    path.write_text(json.dumps(scales_document(_scales(), H)))
    pool = create_pool(_pool_args("--kv-cache-dtype", "fp8", "--kv-scales-file", str(path)))
    try:
        d = pool.descriptor()
        assert d.layout.dtype == FP8_DTYPE and d.kv_scales.source == f"file:{path}"
        assert list(d.kv_scales.v_scale) == [0.25] * (L * H)
    finally:
        pool.close()
    with pytest.raises(ValueError, match="--kv-scales-file is for an fp8 pool"):
        create_pool(_pool_args("--kv-scales-file", str(path)))
    with pytest.raises(ValueError, match="--kv-scales-file .*missing.json: cannot read it: No such file"):
        create_pool(_pool_args("--kv-cache-dtype", "fp8", "--kv-scales-file", str(tmp_path / "missing.json")))


@pytest.mark.parametrize(("argv", "pool", "model"), [
    (["--kv-cache-dtype", "fp8"], FP8, None),
    (["--kv-cache-dtype", "fp8_e4m3", "--dtype", "bfloat16"], FP8, BFLOAT16),
    (["--dtype", "bfloat16"], BFLOAT16, BFLOAT16),
    ([], None, None),
])
def test_serve_takes_an_fp8_pool_beside_any_model_dtype(argv, pool, model):
    from client.serve.config import parse_args

    args = parse_args(argv)
    assert (args.pool_dtype, args.model_dtype) == (pool, model)


def test_serve_refuses_a_model_dtype_other_than_a_full_precision_pool(capsys):
    from client.serve.config import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--dtype", "bfloat16", "--kv-cache-dtype", "float32"])
    assert "fp8 pools aside" in capsys.readouterr().err


def test_a_worker_runs_its_model_in_the_pool_dtype_unless_the_pool_is_fp8():
    import torch

    from compute_service.main import model_dtype

    def desc(dtype, backend=pb.POOL_BACKEND_CPU):
        return pb.PoolDescriptor(layout=pb.PoolLayout(dtype=dtype), backend=backend)

    assert model_dtype("auto", desc(FP8_DTYPE)) == torch.float32
    assert model_dtype("auto", desc(FP8_DTYPE, pb.POOL_BACKEND_CUDA)) == torch.bfloat16
    assert model_dtype("bfloat16", desc(FP8_DTYPE)) == torch.bfloat16
    assert model_dtype("auto", desc("bfloat16")) == torch.bfloat16
    with pytest.raises(ValueError, match="runs in the pool's dtype"):
        model_dtype("bfloat16", desc("float32"))


def test_serve_hands_a_scales_file_to_its_embedded_memory_service(capsys):
    from client.serve.backends import embedded_args
    from client.serve.config import parse_args

    args = parse_args(["--kv-cache-dtype", "fp8", "--dtype", "bfloat16", "--kv-scales-file", "/s.json"])
    memory, worker = embedded_args(args)
    assert memory[memory.index("--kv-cache-dtype") + 1] == FP8_DTYPE
    assert memory[memory.index("--kv-scales-file") + 1] == "/s.json"
    assert worker == ["--dtype", "bfloat16", "--max-num-batched-tokens", "512"]
    with pytest.raises(SystemExit):
        parse_args(["--kv-scales-file", "/s.json"])
    assert "add --kv-cache-dtype fp8" in capsys.readouterr().err

