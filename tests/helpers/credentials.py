"""Credentials (and a worker-computed sequence) for tests that call the services' stubs directly
(memory_service/authz.py).

    lease, md = new_lease(stub)                     # md: the lease's secret as call metadata
    stub.KeepAlive(pb.KeepAliveRequest(lease_id=lease), metadata=md)
    stub.ListSequences(pb.ListSequencesRequest(), metadata=admin_md(memory_service))
"""

from __future__ import annotations

from pathlib import Path

import grpc

from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.compute.v1 import compute_service_pb2_grpc as cpb_grpc
from pagedkv.memory.v1 import memory_service_pb2 as pb
from pagedkv.runtime.credentials import LEASE_SECRET_METADATA

LEASE_SECRET = LEASE_SECRET_METADATA


def lease_md(secret: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a lease's secret."""
    return ((LEASE_SECRET, secret),)


def new_lease(stub, metadata=(), **kwargs) -> tuple[str, tuple[tuple[str, str], ...]]:
    """CreateLease(**kwargs) on ``stub`` with call ``metadata`` (``admin_md(service)``: the admin's lease,
    exempt from the per-lease block quota): (lease id, metadata with its secret)."""
    resp = stub.CreateLease(pb.CreateLeaseRequest(**kwargs), metadata=metadata)
    return resp.lease_id, lease_md(resp.lease_secret)


def admin_token(service) -> str:
    """The admin token of a started memory service (a ServiceProcess; its ready file names the file)."""
    return Path(service.info["admin_token_file"]).read_text().strip()


def admin_md(service) -> tuple[tuple[str, str], ...]:
    """Call metadata making the caller the admin of ``service``."""
    return (("authorization", f"Bearer {admin_token(service)}"),)


def computed(stack, stub, lease: str, md, tokens: list[int], salt: str):
    """Allocate ``tokens`` on ``lease`` of ``stack``'s memory service, compute them on its first worker and
    hand in the receipt (so their full blocks enter the prefix cache); returns the sequence's block table."""
    resp = stub.AllocateSequences(pb.AllocateSequencesRequest(lease_id=lease, sequences=[
        pb.SequenceAllocation(num_tokens=len(tokens), token_ids=tokens, cache_salt=salt)]), metadata=md)
    (seq,), (grant,) = resp.sequences, resp.grants
    with grpc.insecure_channel(stack.worker_addresses[0]) as ch:
        (result,) = cpb_grpc.ComputeServiceStub(ch).Step(cpb.StepRequest(
            pool_generation=grant.pool_generation, sequences=[cpb.StepSequence(
                seq_id=seq.seq_id, token_ids=tokens, positions=range(len(tokens)), block_ids=seq.block_ids,
                grant=grant)])).results
    stub.CommitComputedTokens(pb.CommitComputedTokensRequest(lease_id=lease, receipts=[result.receipt]), metadata=md)
    return seq
