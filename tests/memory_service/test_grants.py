"""Grants and receipts in process: the memory service's signer, the worker's check, the block manager's receipts.

DESIGN.md, "Trust model": a step touches only what its grant allows; a position counts as
computed (and a block enters the prefix cache) only with a worker's receipt for exactly its tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.refusals import refusal

from compute_service.grant_check import check_grants, sign_receipts
from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Append
from memory_service.step_grants import GrantSigner
from pagedkv.compute.v1 import compute_service_pb2 as cpb
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime.block_hash import CacheKey
from pagedkv.runtime.errors import PermissionDeniedError
from pagedkv.runtime.grants import grant_message, grant_signed, receipt_signed, sign_grant, token_digest

KEY = bytes(range(32))
NOW = 1_000_000.0
BS = 4


@pytest.fixture
def plane():
    epochs = np.zeros(16, dtype=np.int64)
    m = BlockManager(16, BS, lease_ttl=30.0, epochs=epochs)
    signer = GrantSigner(KEY, generation=7, epochs=epochs, wall_clock=lambda: NOW)
    lease = m.leases.create().lease_id
    return m, signer, epochs, lease


def step_of(seq_id: int, tokens: list[int], start: int, grant, block_ids=None) -> cpb.StepRequest:
    return cpb.StepRequest(pool_generation=7, sequences=[cpb.StepSequence(
        seq_id=seq_id, token_ids=tokens, positions=range(start, start + len(tokens)),
        block_ids=grant.block_ids if block_ids is None else block_ids, grant=grant)])


def run(m, signer, lease, request):
    """The worker's check and receipts (no model), then CommitComputedTokens; returns the new grants."""
    check_grants(request, KEY, 7, signer.epochs, now=NOW)
    results = [cpb.StepResult(seq_id=s.seq_id) for s in request.sequences]
    sign_receipts(request, results, KEY, BS)
    result = m.commit_receipts(lease, signer.receipts([r.receipt for r in results]))
    ttl = m.leases.lookup(lease).ttl
    return result, [signer.grant(s, ttl) for s in result.accepted]


def test_signatures_cover_every_field_and_kind():
    g = sign_grant(KEY, grant_pb2.StepGrant(pool_generation=1, seq_id=2, block_ids=[3, 4], block_epochs=[1, 1],
                                            readable_tokens=0, write_end=8, token_digest=token_digest(range(8)),
                                            expires_at=NOW))
    assert grant_signed(KEY, g) and not grant_signed(bytes(32), g)
    for field, value in [("seq_id", 3), ("write_end", 9), ("readable_tokens", 1), ("expires_at", NOW + 1),
                         ("pool_generation", 2), ("token_digest", token_digest(range(1, 9)))]:
        t = grant_pb2.StepGrant()
        t.CopyFrom(g)
        setattr(t, field, value)
        assert not grant_signed(KEY, t), field
    t = grant_pb2.StepGrant()
    t.CopyFrom(g)
    t.block_ids[1] = 5
    assert not grant_signed(KEY, t)
    # A grant's signature is never a receipt's (domain separation).
    r = grant_pb2.StepReceipt(pool_generation=1, seq_id=2, signature=g.signature)
    assert not receipt_signed(KEY, r) and grant_message(g).startswith(b"pagedkv.grant.v1.StepGrant\x00")


def test_allocation_grant_then_receipts_prove_and_cache(plane):
    m, signer, epochs, lease = plane
    toks = list(range(100, 110))
    (seq,) = m.allocate(lease, [Allocation(10, tuple(toks), CacheKey("m"))])
    g = signer.grant(seq, 30.0)
    assert (list(g.block_ids), list(g.block_epochs), g.readable_tokens, g.write_end) == ([0, 1, 2], [1, 1, 1], 0, 10)
    assert g.token_digest == token_digest(toks) and g.expires_at == NOW + 30.0
    result, (g2,) = run(m, signer, lease, step_of(seq.seq_id, toks, 0, g))
    assert (result.blocks_registered, result.skipped, seq.num_proven) == (2, 0, 10)
    assert (g2.readable_tokens, g2.write_end, g2.token_digest) == (10, 10, b"")
    # A second sequence with the same prompt hits the two proven blocks.
    (hit,) = m.allocate(lease, [Allocation(10, tuple(toks), CacheKey("m"))])
    assert hit.block_ids[:2] == [0, 1] and hit.num_proven == 8 and signer.grant(hit, 30.0).readable_tokens == 8


def test_receipt_for_other_tokens_never_enters_the_cache(plane):
    m, signer, epochs, lease = plane
    france, japan = list(range(200, 208)), list(range(300, 308))
    (seq,) = m.allocate(lease, [Allocation(8, tuple(france), CacheKey("m"))])
    g = signer.grant(seq, 30.0)
    # The grant binds the tokens: the worker refuses other ones.
    assert "tokens are not the ones" in refusal(lambda: check_grants(step_of(seq.seq_id, japan, 0, g), KEY, 7, epochs,
                                                                     now=NOW))
    # A grant without a digest (tokens unknown) lets the step write any tokens, but then the
    # receipt's digest differs from what the sequence claims and nothing is cached.
    g.token_digest = b""
    sign_grant(KEY, g)
    result, _ = run(m, signer, lease, step_of(seq.seq_id, japan, 0, g))
    assert (result.blocks_registered, seq.num_proven, seq.token_ids) == (0, 8, None)
    (other,) = m.allocate(lease, [Allocation(8, tuple(france), CacheKey("m"))])
    assert other.num_cached_tokens == 0


REASONS = {
    "no grant": "has no grant",
    "forged": "not the memory service's grant",
    "other key": "not the memory service's",
    "expired": "expired 1.0 s ago",
    "other generation": "in pool generation 8",
    "start": "writes positions [1, 6)",
    "past write_end": "allows [0, 6)",
    "other table": "block table is not",
    "stale epoch": "handed out anew",
    "copy not granted": "is in no grant",
}


@pytest.mark.parametrize("what", list(REASONS))
def test_step_outside_its_grant_is_refused(plane, what):
    m, signer, epochs, lease = plane
    (seq, victim) = m.allocate(lease, [Allocation(6), Allocation(6)])
    g = signer.grant(seq, 30.0)
    toks, start, table, key, gen, now = [1, 2, 3, 4, 5, 6], 0, None, KEY, 7, NOW
    if what == "no grant":
        table = seq.block_ids
    elif what == "forged":
        g.write_end = 7
    elif what == "other key":
        key = bytes(32)
    elif what == "expired":
        now = NOW + 31
    elif what == "other generation":
        gen = 8
    elif what == "start":
        toks, start = [2, 3, 4, 5, 6], 1
    elif what == "past write_end":
        toks = toks + [7]
    elif what == "other table":
        table = victim.block_ids
    elif what == "stale epoch":  # freed and handed out anew: the old grant names an old epoch
        m.free(lease, [seq.seq_id])
        m.allocate(lease, [Allocation(8)])
    request = step_of(seq.seq_id, toks, start, g, table)
    if what == "no grant":
        request.sequences[0].ClearField("grant")
    if what == "copy not granted":
        request.copies.add(src=victim.block_ids[0], dst=seq.block_ids[0])
    message = refusal(lambda: check_grants(request, key, gen, epochs, now=now))
    assert "nothing was read or written" in message and REASONS[what] in message


def test_copy_on_write_is_granted_and_stale_receipts_are_skipped(plane):
    m, signer, epochs, lease = plane
    (parent,) = m.allocate(lease, [Allocation(6, tuple(range(6)))])
    run(m, signer, lease, step_of(parent.seq_id, list(range(6)), 0, signer.grant(parent, 30.0)))
    (child,) = m.fork(lease, [parent.seq_id])
    assert child.num_proven == 6
    result = m.append_slots(lease, [Append(child.seq_id, 1, [9])])
    (copy,) = result.copies
    g = signer.grant(child, 30.0, result.copies)
    assert [(c.src, c.dst) for c in g.copies] == [(copy.src, copy.dst)] and g.readable_tokens == 6
    request = step_of(child.seq_id, [9], 6, g)
    request.copies.add(src=copy.src, dst=copy.dst)
    check_grants(request, KEY, 7, epochs, now=NOW)
    results = [cpb.StepResult(seq_id=child.seq_id)]
    sign_receipts(request, results, KEY, BS)
    receipts = signer.receipts([results[0].receipt])
    assert m.commit_receipts(lease, receipts).accepted == (child,)
    # The grant is spent: replaying it (its copy would re-copy the source, which its parent may have
    # written since, over positions now proven) is refused, since the receipt gave the block a new epoch.
    assert "handed out anew" in refusal(lambda: check_grants(request, KEY, 7, epochs, now=NOW))
    # The same receipt again is stale (it does not continue the sequence): skipped, nothing changes.
    again = m.commit_receipts(lease, receipts)
    assert (again.skipped, again.accepted, child.num_proven) == (1, (), 7)


def test_forged_receipt_is_refused(plane):
    m, signer, epochs, lease = plane
    (seq,) = m.allocate(lease, [Allocation(4, (1, 2, 3, 4))])
    fake = grant_pb2.StepReceipt(
        pool_generation=7,
        seq_id=seq.seq_id,
        start=0,
        end=4,
        token_digest=token_digest([1, 2, 3, 4]),
        block_ids=seq.block_ids,
        block_epochs=[1],
        signature=b"\0" * 32,
    )
    with pytest.raises(PermissionDeniedError, match="not a worker's receipt"):
        signer.receipts([fake])
    assert seq.num_proven == 0


def test_one_sequence_outside_its_grant_is_refused_alone(plane):
    m, signer, epochs, lease = plane
    (parent, victim) = m.allocate(lease, [Allocation(6, tuple(range(6))), Allocation(4)])
    run(m, signer, lease, step_of(parent.seq_id, list(range(6)), 0, signer.grant(parent, 30.0)))
    (child,) = m.fork(lease, [parent.seq_id])
    result = m.append_slots(lease, [Append(child.seq_id, 1, [9])])
    (copy,) = result.copies
    good = step_of(child.seq_id, [9], 6, signer.grant(child, 30.0, result.copies)).sequences[0]
    forged = signer.grant(victim, 30.0)
    forged.write_end = 9
    bad = step_of(victim.seq_id, [1, 2, 3, 4], 0, forged).sequences[0]
    request = cpb.StepRequest(pool_generation=7, sequences=[bad, good], copies=[cpb.BlockCopy(src=copy.src,
                                                                                              dst=copy.dst)])
    checked = check_grants(request, KEY, 7, epochs, now=NOW)
    assert list(checked.refused) == [0] and "not the memory service's grant" in checked.refused[0].message
    assert checked[0] is None and checked[1].block_ids == list(child.block_ids)
    assert checked.plan.copy_on_write == [(copy.src, copy.dst)]
    # A copy into the refused sequence's blocks goes with it; one into the computed one's must be granted.
    request.copies.add(src=parent.block_ids[0], dst=victim.block_ids[0])
    assert list(check_grants(request, KEY, 7, epochs, now=NOW).refused) == [0]
    request.copies.add(src=parent.block_ids[0], dst=copy.dst)
    with pytest.raises(PermissionDeniedError, match="is in no grant"):
        check_grants(request, KEY, 7, epochs, now=NOW)
