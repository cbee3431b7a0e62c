"""Zero-copy: two processes map the cpu pool through the worker socket; one writes, the other reads."""

from __future__ import annotations

import subprocess
import sys

import torch

from compute_service.pool_map import map_pool
from pagedkv.memory.v1 import memory_service_pb2 as pb

WRITER = r"""
import sys, torch
from compute_service.pool_map import map_pool
from pagedkv.memory.v1 import memory_service_pb2 as pb
desc = pb.PoolDescriptor.FromString(sys.stdin.buffer.read())   # the public one: layout + socket
pool = map_pool(desc)
block = pool.tensor[7]                       # [num_layers, 2, block_size, kv_heads, head_dim]
block.copy_(torch.arange(block.numel(), dtype=block.dtype).view_as(block))
print(pool.tensor.data_ptr() != 0, pool.plane_key.hex())
"""


def test_second_process_writes_first_reads(memory_stub):
    desc = memory_stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool
    assert desc.shm_path == "" and desc.worker_socket  # no handle over gRPC: the socket has it
    mine = map_pool(desc)
    assert mine.tensor.shape == (64, 30, 2, 4, 3, 64) and mine.tensor.dtype == torch.float32
    before = mine.tensor[7].clone()
    out = subprocess.run([sys.executable, "-c", WRITER], input=desc.SerializeToString(), capture_output=True,
                         check=True)
    ok, key = out.stdout.split()
    assert ok == b"True", out.stderr
    assert key.decode() == mine.plane_key.hex()  # one key per generation, the same for every worker
    expected = torch.arange(before.numel(), dtype=torch.float32).view_as(before)
    torch.testing.assert_close(mine.tensor[7], expected, rtol=0, atol=0, msg="block 7 not seen by the first process")
    assert torch.count_nonzero(mine.tensor[6]) == 0 and torch.count_nonzero(mine.tensor[8]) == 0
    # K and V of layer 3 in block 7 through the per-layer views the kernels take.
    k, v = mine.tensor[:, 3, 0], mine.tensor[:, 3, 1]
    assert k.shape == (64, 4, 3, 64) and torch.equal(k[7], expected[3, 0]) and torch.equal(v[7], expected[3, 1])
    mine.tensor[7].zero_()
    mine.close()
