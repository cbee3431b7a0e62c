"""A property of the worker's grant check (compute_service.grant_check), over random steps: of a
batch whose sequences each may carry one violation of its grant, exactly the violating sequences
are refused, each alone; the others are accepted with receipts that the memory service takes, and
the step's copy plan holds only the accepted sequences' copies-on-write.

`make test` runs a short search; PAGEDKV_TEST_FULL=1 a long one.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compute_service.grant_check import check_grants, sign_receipts
from memory_service.manager.block_manager import BlockManager
from memory_service.manager.requests import Allocation, Append, Commit
from memory_service.step_grants import GrantSigner
from pagedkv.compute.v1 import compute_service_pb2 as cpb

KEY, NOW, BS = bytes(range(32)), 1_000_000.0, 4
#: Each sequence's violation (None: an honest sequence).
VIOLATIONS = [None, "no grant", "forged", "expired grant", "start", "past write_end", "other table", "other tokens",
              "stale epoch"]


def _plane():
    epochs = np.zeros(64, dtype=np.int64)
    m = BlockManager(64, BS, lease_ttl=30.0, epochs=epochs)
    signer = GrantSigner(KEY, generation=7, epochs=epochs, wall_clock=lambda: NOW)
    return m, signer, epochs, m.leases.create().lease_id


@settings(max_examples=400 if os.environ.get("PAGEDKV_TEST_FULL") == "1" else 40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(VIOLATIONS), st.integers(1, 9), st.booleans()), min_size=1, max_size=6))
def test_exactly_the_sequences_outside_their_grants_are_refused_each_alone(batch):
    m, signer, epochs, lease = _plane()
    sequences = []
    for what, n, fork in batch:
        toks = list(range(100 + len(sequences) * 16, 100 + len(sequences) * 16 + n))
        (seq,) = m.allocate(lease, [Allocation(n, tuple(toks))])
        copies = []
        if fork:  # a forked child appending into its shared, partly filled block: one copy-on-write
            m.commit_computed(lease, [Commit(seq.seq_id, n)])
            (seq,) = m.fork(lease, [seq.seq_id])
            result = m.append_slots(lease, [Append(seq.seq_id, 1, (7,))])
            copies = result.copies
            toks = [*toks, 7]
        grant = signer.grant(seq, 30.0, copies)
        start = seq.num_proven
        s = cpb.StepSequence(seq_id=seq.seq_id, token_ids=toks[start:], positions=range(start, len(toks)),
                             block_ids=seq.block_ids, grant=grant)
        sequences.append((what, s, [(c.src, c.dst) for c in copies]))
    for what, s, _ in sequences:
        _violate(what, s, sequences, epochs)
    request = cpb.StepRequest(pool_generation=7, sequences=[s for _, s, _ in sequences],
                              copies=[cpb.BlockCopy(src=a, dst=b) for _, _, cs in sequences for a, b in cs])
    checked = check_grants(request, KEY, 7, epochs, now=NOW)
    bad = {i for i, (what, _, _) in enumerate(sequences) if what is not None}
    assert set(checked.refused) == bad
    assert all((c is None) == (i in bad) for i, c in enumerate(checked))
    assert sorted(checked.plan.copy_on_write) == sorted(p for i, (_, _, cs) in enumerate(sequences) if i not in bad
                                                        for p in cs)
    kept = [s for i, (_, s, _) in enumerate(sequences) if i not in bad]
    if kept:  # the accepted sequences' receipts are the memory service's to take
        run = cpb.StepRequest(pool_generation=7, sequences=kept)
        results = [cpb.StepResult(seq_id=s.seq_id) for s in kept]
        sign_receipts(run, results, KEY, BS, [c for c in checked if c is not None])
        assert len(m.commit_receipts(lease, signer.receipts([r.receipt for r in results])).accepted) == len(kept)


def _violate(what, s: cpb.StepSequence, sequences, epochs) -> None:
    """Give ``s`` the violation ``what`` of its grant."""
    if what == "no grant":
        s.ClearField("grant")
    elif what == "forged":
        s.grant.write_end += 1
    elif what == "expired grant":
        s.grant.expires_at = NOW - 1  # the signature no longer covers it either
    elif what == "start":
        s.positions[:] = [p + 1 for p in s.positions]
    elif what == "past write_end":
        s.token_ids.append(1)
        s.positions.append(s.positions[-1] + 1)
    elif what == "other table":
        s.block_ids[:] = [*s.block_ids[:-1], max(b for _, o, _ in sequences for b in o.block_ids) + 1]
    elif what == "other tokens":
        s.token_ids[-1] += 1
    elif what == "stale epoch":
        epochs[s.block_ids[-1]] += 1  # handed out anew since its grant
