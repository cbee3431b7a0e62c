"""The worker's per-step paths outside the forward, against per-sequence references.

`build_step_inputs` (vectorised over the batch) against the slot formula computed token by
token; its refusals name the first violation in batch order; `row_argmax` against
`torch.argmax`; receipts signed from `check_grants`' return equal receipts signed from the grants.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compute_service.grant_check import check_grants, sign_receipts
from compute_service.sampling import row_argmax
from compute_service.step_inputs import build_step_inputs
from pagedkv.compute.v1 import compute_service_pb2 as pb
from pagedkv.grant.v1 import grant_pb2
from pagedkv.runtime.errors import InvalidArgumentError
from pagedkv.runtime.grants import receipt_signed, sign_grant, token_digest

BS, NB, VOCAB = 4, 32, 50
KEY = bytes(range(32))


def seq(i, start, tokens, table, **kw):
    return pb.StepSequence(seq_id=i, token_ids=tokens, positions=range(start, start + len(tokens)), block_ids=table,
                           output_index=0, **kw)


def build(*seqs, copies=()):
    req = pb.StepRequest(sequences=seqs, copies=[pb.BlockCopy(src=s, dst=d) for s, d in copies])
    return build_step_inputs(req, block_size=BS, num_blocks=NB, vocab_size=VOCAB, device="cpu")


def test_mixed_batch_matches_the_per_token_formula():
    batch = [seq(0, 5, [7], [3, 9]),  # decode mid-block
             seq(1, 2, [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 30], skip_sampling=True),  # chunk over 3 blocks
             seq(2, 0, [4, 4, 4], [20]),  # prompt in one block
             seq(3, 8, [9], [1, 2, 0, 5])]  # decode at a block start; table longer than needed
    got = build(*batch, copies=[(3, 31)])
    tokens, positions, slots, tables = [], [], [], []
    for s in batch:
        ps = list(s.positions)
        need = -(-(ps[-1] + 1) // BS)
        tokens += list(s.token_ids)
        positions += ps
        slots += [s.block_ids[p // BS] * BS + p % BS for p in ps]
        tables.append(list(s.block_ids[:need]) + [0] * (3 - need))
    assert got.token_ids.tolist() == tokens and got.positions.tolist() == positions
    assert got.slot_mapping.tolist() == slots and got.slot_mapping.dtype == torch.int64
    assert got.block_tables.tolist() == tables and got.block_tables.dtype == torch.int32
    assert got.host_query_start_loc.tolist() == [0, 1, 8, 11, 12] and got.host_seq_lens.tolist() == [6, 9, 3, 9]
    assert got.sample_rows == [0, 2, 3] and got.logits_indices.tolist() == [0, 10, 11]
    assert all(p.greedy for p in got.sampling)


@pytest.mark.parametrize("bad, message", [
    (seq(5, 0, [1], [1]), "seq_id appears twice"),
    (seq(6, 0, [], [1]), "token_ids is empty"),
    (pb.StepSequence(seq_id=6, token_ids=[1, 2], positions=[0, 2], block_ids=[1]), "consecutive"),
    (seq(6, 0, [VOCAB], [1]), "vocabulary"),
    (seq(6, 3, [1, 2], [1]), "block table has 1 blocks"),
    (seq(6, 0, [1], [NB]), "outside the pool"),
    (seq(6, 0, [1], [2]), "same KV slot"),
    (seq(6, 0, [1], [7], sampling=pb.SamplingParams(top_p=2.0)), "bad sampling parameters"),
])
def test_refusals_name_the_violation(bad, message):
    with pytest.raises(InvalidArgumentError, match=message):
        build(seq(5, 0, [1], [2]), bad)


def test_first_violation_in_batch_order():
    """Two bad sequences: the refusal names the earlier one, whatever its kind."""
    with pytest.raises(InvalidArgumentError, match=r"sequence 1 .*vocabulary"):
        build(seq(0, 0, [1], [2]), seq(1, 0, [VOCAB], [3]), seq(2, 0, [1], [NB]))
    with pytest.raises(InvalidArgumentError, match=r"sequence 1 .*bad sampling"):
        build(seq(1, 0, [1], [3], sampling=pb.SamplingParams(temperature=-1.0)), seq(2, 0, [VOCAB], [4]))
    with pytest.raises(InvalidArgumentError, match="two different blocks"):
        build(seq(0, 0, [1], [2]), copies=[(4, 4)])


def test_row_argmax_equals_torch_argmax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1000, generator=g)
    x[1, 10] = x[1, 500] = 100.0  # a tie: the first
    x[2, 3] = float("nan")  # NaN counts as the largest
    x[3] = 0.0  # all equal: index 0
    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.tolist() == x.argmax(dim=-1).tolist()
    assert got[1] == 10 and got[2] == 3 and got[3] == 0
    assert row_argmax(x.double()).tolist() == got.tolist()
    assert row_argmax(x.to(torch.bfloat16)).tolist() == x.to(torch.bfloat16).argmax(dim=-1).tolist()


def test_receipts_from_check_equal_receipts_from_grants():
    epochs = np.arange(NB, dtype=np.int64) % 3 + 1
    seqs = []
    for i, (start, toks, table,
            with_digest) in enumerate([(0, [1, 2, 3, 4, 5], [4, 6], True), (6, [9], [7, 8], False)]):
        end = start + len(toks)
        g = sign_grant(KEY, grant_pb2.StepGrant(
            pool_generation=3, seq_id=i, block_ids=table, block_epochs=epochs[table].tolist(), readable_tokens=start,
            write_end=end, token_digest=token_digest(toks) if with_digest else b"", expires_at=2e9))
        seqs.append(seq(i, start, toks, table, grant=g))
    req = pb.StepRequest(pool_generation=3, sequences=seqs)
    checked = check_grants(req, KEY, 3, epochs)
    fast = [pb.StepResult(seq_id=s.seq_id) for s in seqs]
    slow = [pb.StepResult(seq_id=s.seq_id) for s in seqs]
    sign_receipts(req, fast, KEY, BS, checked)
    sign_receipts(req, slow, KEY, BS)
    assert [r.receipt for r in fast] == [r.receipt for r in slow]
    assert all(receipt_signed(KEY, r.receipt) for r in fast)
    second = fast[1].receipt
    assert (second.start, second.end, list(second.block_ids), list(second.block_epochs)) == (6, 7, [8], [epochs[8]])
    assert second.token_digest == token_digest([9])


def test_one_packed_copy_gives_the_same_inputs():
    """The step's metadata packed into one buffer and copied at once (compute_service.step_upload:
    the CUDA path, staged here on the CPU) is the same tensors as one copy each: values, dtypes,
    shapes; and the host buffer is reused without changing an earlier step's inputs."""
    from compute_service.step_upload import ALIGN, StepUpload

    batch = [seq(0, 5, [7], [3, 9]), seq(1, 2, [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 30], skip_sampling=True),
             seq(2, 0, [4, 4, 4], [20]), seq(3, 8, [9], [1, 2, 0, 5])]
    req = pb.StepRequest(sequences=batch)
    upload = StepUpload("cpu", staged=True)
    direct = build_step_inputs(req, block_size=BS, num_blocks=NB, vocab_size=VOCAB, device="cpu")
    packed = build_step_inputs(req, block_size=BS, num_blocks=NB, vocab_size=VOCAB, device="cpu", upload=upload)
    names = ("token_ids", "positions", "slot_mapping", "block_tables", "query_start_loc", "seq_lens", "logits_indices")
    for name in names:
        a, b = getattr(direct, name), getattr(packed, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        assert b.data_ptr() % ALIGN == 0, name
    before = {name: getattr(packed, name).clone() for name in names}
    build_step_inputs(pb.StepRequest(sequences=[seq(9, 0, [1, 2], [4])]), block_size=BS, num_blocks=NB,
                      vocab_size=VOCAB, device="cpu", upload=upload)  # the next step, same host buffer
    assert all(torch.equal(before[name], getattr(packed, name)) for name in names)
    odd = upload([np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int64).reshape(5, 1), np.zeros(0, np.int64)])
    assert [t.tolist() for t in odd] == [[0, 1, 2], [[0], [1], [2], [3], [4]], []]
    assert [t.dtype for t in odd] == [torch.int32, torch.int64, torch.int64]
