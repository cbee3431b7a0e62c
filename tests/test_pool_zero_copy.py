"""Zero-copy: a second process maps the cpu pool from the descriptor alone, writes, the first reads."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from compute_service.pool_map import map_pool
from pagedkv.memory.v1 import memory_service_pb2 as pb

WRITER = r"""
import sys, torch
from compute_service.pool_map import map_pool
from pagedkv.memory.v1 import memory_service_pb2 as pb
desc = pb.PoolDescriptor.FromString(sys.stdin.buffer.read())
pool = map_pool(desc)
block = pool.tensor[7]                       # [num_layers, 2, block_size, kv_heads, head_dim]
block.copy_(torch.arange(block.numel(), dtype=block.dtype).view_as(block))
print(pool.tensor.data_ptr() != 0)
"""


def test_second_process_writes_first_reads(memory_stub):
    desc = memory_stub.GetPoolDescriptor(pb.GetPoolDescriptorRequest()).pool
    mine = map_pool(desc)
    assert mine.tensor.shape == (64, 30, 2, 4, 3, 64) and mine.tensor.dtype == torch.float32
    before = mine.tensor[7].clone()
    out = subprocess.run([sys.executable, "-c", WRITER], input=desc.SerializeToString(), capture_output=True, check=True)
    assert out.stdout.strip() == b"True", out.stderr
    expected = torch.arange(before.numel(), dtype=torch.float32).view_as(before)
    torch.testing.assert_close(mine.tensor[7], expected, rtol=0, atol=0, msg="block 7 not seen by the first process")
    assert torch.count_nonzero(mine.tensor[6]) == 0 and torch.count_nonzero(mine.tensor[8]) == 0
    # K and V of layer 3 in block 7 through the per-layer views the kernels take.
    k, v = mine.tensor[:, 3, 0], mine.tensor[:, 3, 1]
    assert k.shape == (64, 4, 3, 64) and torch.equal(k[7], expected[3, 0]) and torch.equal(v[7], expected[3, 1])
    mine.tensor[7].zero_()
    mine.close()


def test_stale_pool_files_of_dead_owners_are_removed(tmp_path, monkeypatch):
    from memory_service.layout import PoolLayout
    from memory_service.pool import CpuPool

    monkeypatch.setenv("PAGEDKV_SHM_DIR", str(tmp_path))
    layout = PoolLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32", num_blocks=4)
    live = CpuPool(layout, pool_id="live")
    # A crashed owner leaves its file behind, unlocked (same pid: pids repeat in containers).
    crashed = tmp_path / f"pagedkv-crashed-g1-p{os.getpid()}.kv"
    crashed.write_bytes(b"\0" * 64)
    other = CpuPool(layout, pool_id="new")
    assert not crashed.exists() and live.path.exists() and other.path.exists()
    live.close()
    other.close()
    assert not list(tmp_path.glob("*.kv"))
