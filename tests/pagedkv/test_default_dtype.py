"""``--dtype auto`` (pagedkv.config.default_dtype) where it is decided: ``pagedkv serve`` for its
embedded services, and a memory service for its pool. The rule itself: tests/pagedkv/test_config.py."""

from __future__ import annotations

import grpc

from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.memory.v1 import memory_service_pb2_grpc as pb_grpc
from pagedkv.runtime.cpu_flags import computes_bf16

FP8_DTYPE = "fp8_e4m3"


def test_serve_resolves_the_auto_dtypes_and_hands_them_to_both_children():
    """`pagedkv serve`'s embedded services get explicit dtypes: ``auto`` is SmolLM2's bfloat16
    checkpoint dtype where this CPU computes it (AVX-512 BF16 or AMX), float32 elsewhere; a given
    pool dtype is the model's too (an fp8 pool aside)."""
    from client.serve.backends import embedded_args
    from client.serve.config import parse_args

    auto = "bfloat16" if computes_bf16() else "float32"
    for flags, cuda, want in [([], False, (auto, auto)), ([], True, ("bfloat16", "bfloat16")),
                              (["--kv-cache-dtype", "float32"], False, ("float32", "float32")),
                              (["--dtype", "float32"], False, ("float32", "float32")),
                              (["--kv-cache-dtype", "fp8"], False, (auto, FP8_DTYPE)),
                              (["--kv-cache-dtype", "fp8"], True, ("bfloat16", FP8_DTYPE))]:
        memory, worker = embedded_args(parse_args(flags), "cuda" if cuda else "cpu")
        assert (worker[worker.index("--dtype") + 1], memory[memory.index("--kv-cache-dtype") + 1]) == want, flags


def test_a_memory_service_with_auto_makes_the_checkpoints_pool_where_the_cpu_computes_it(start_service):

    svc = start_service(["memory", "--num-blocks", "8", "--kv-cache-dtype", "auto"], name="auto")
    with grpc.insecure_channel(svc.address) as channel:
        pool = pb_grpc.MemoryServiceStub(channel).GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool
    assert pool.layout.dtype == ("bfloat16" if computes_bf16() else "float32")
