"""Torch path of the paged kernels over the full grid, against the dense fp64 reference.

Grid: (num_q_heads, num_kv_heads) (GQA ratios 1 to 32) x head_dim x block_size (incl. 1 and the
non-power-of-two 24) x dtype (fp32, fp16, bf16); each case is a batch holding every context
length of interest, in shuffled blocks with NaN in every unused slot, block and table entry.
Every call goes through the one op the model uses: `plan_attention` once, then
`paged_attention`. The plan's kernel choice is checked for the Triton backend too, on CPU
tensors: planning launches nothing.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch
from helpers.kernel_reference import make_case, ref_attention, run_int64_case, tolerance

import kernels
from kernels import plan as plan_mod
from kernels import torch_groups, torch_impl, torch_planned
from kernels.cpu import native as cpu_native


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Many small ops: one intra-op thread is several times faster on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


HEADS = [(9, 3), (8, 8), (32, 1), (28, 4)]
HEAD_DIMS = [64, 80, 128]
BLOCK_SIZES = [1, 8, 16, 32, 24]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LONG = 1100  # long context


def context_lengths(block_size: int) -> list[int]:
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 257, LONG]
    return [n for n in lens if n >= 1]


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.dtype == dtype, f"{what}: output dtype {out.dtype}, want {dtype}"
    assert not out.isnan().any(), f"{what}: NaN reached the output"
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype), msg=lambda m: f"{what}: {m}")


def reference(case) -> torch.Tensor:
    return ref_attention(
        case.query, case.key_cache, case.value_cache, case.block_tables,
        case.query_start_loc, case.seq_lens, case.scale,
    )  # fmt: skip


def plan_case(case, **kw) -> kernels.AttentionPlan:
    block_size = case.key_cache.shape[1]
    return kernels.plan_attention(case.block_tables, case.query_start_loc, case.seq_lens, block_size, **kw)


def attend(case, plan=None, **kw) -> torch.Tensor:
    """The model's call sequence: one plan, then the attention op."""
    plan = plan_case(case, **kw) if plan is None else plan
    return kernels.paged_attention(case.query, case.key_cache, case.value_cache, plan, case.scale)


@pytest.fixture(params=[True, False], ids=["native", "gather"])
def native(request):
    """Both CPU decode paths: the native kernel (when built) and the gather + SDPA path. With a
    non-fp32 cache the native plan falls back to gathering its decode rows."""
    if request.param and not cpu_native.available():
        pytest.skip(f"native CPU decode kernel unavailable: {cpu_native.unavailable_reason}")
    with cpu_native.use_native(request.param):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_torch(heads, head_dim, block_size, dtype, native):
    lens = context_lengths(block_size)
    case = make_case(lens, [1] * len(lens), *heads, head_dim, block_size, dtype, seed=block_size)
    plan = plan_case(case, backend="torch")
    assert plan.kernel == "torch" and plan.decode_only
    assert (plan.decode is not None) == native and (plan.groups == []) == native
    check(attend(case, plan), reference(case), dtype, f"decode lens={lens}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_prefill_mixed_batch_torch(heads, head_dim, block_size, dtype, native):
    b = block_size
    # (seq_len, new tokens): cached prefix + chunk; prompt without prefix (3 query tiles);
    # decode tokens at and around block boundaries; a chunk ending exactly on a block.
    batch = [(3 * b + 4, b + 1), (257, 257), (1, 1), (b, 1), (2 * b + 3, 1), (2 * b, b)]
    lens, q_lens = [s for s, _ in batch], [n for _, n in batch]
    case = make_case(lens, q_lens, *heads, head_dim, block_size, dtype, seed=b + 1)
    plan = plan_case(case, backend="torch")
    assert plan.kernel == "torch" and not plan.decode_only
    check(attend(case, plan), reference(case), dtype, f"prefill batch={batch}")


# (seq_len, new tokens) of a chunked-prefill step: whole prompts of varied lengths (two of one
# length: one causal group), chunks after cached prefixes (two of one shape: one shared mask; one
# ending on no block boundary), short chunks that are padded together, decode rows, a sequence
# without new tokens.
PREFILL_STEP = [
    (37, 37), (50, 50), (50, 50), (64, 64), (33, 33),
    (128 + 40, 40), (128 + 40, 40), (75 + 57, 57),
    (20, 3), (21, 4), (300, 1), (47, 1), (90, 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 24, 32])
@pytest.mark.parametrize("heads", [(9, 3), (8, 8)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_prefill_step_exact_groups(heads, block_size, dtype):
    # Prefill sequences are grouped by exact shape only, their context aligned to CTX_ALIGN:
    # whole prompts causal without a mask, equal chunks after a prefix under one shared mask.
    lens, q_lens = [s for s, _ in PREFILL_STEP], [n for _, n in PREFILL_STEP]
    case = make_case(lens, q_lens, *heads, 64, block_size, dtype, seed=block_size)
    plan = plan_case(case)
    align, exact = torch_groups.CTX_ALIGN, torch_groups.EXACT_GROUP_MIN_TOKENS
    for g in plan.groups:
        if g.q_pad < exact:
            continue
        lens_in = {len_ for len_, q in PREFILL_STEP if q == g.q_pad}
        assert g.ctx_pad % align == 0 and g.ctx_pad - align < min(lens_in), (g.q_pad, g.ctx_pad)
        whole = g.q_pad in lens_in
        assert g.is_causal == whole and (g.mask is None) == whole
        if g.mask is not None:
            assert g.mask.shape == (1, 1, g.q_pad, g.ctx_pad)  # one shape: one mask
    shapes = sorted((g.num_seqs, g.q_pad) for g in plan.groups if g.q_pad >= exact)
    assert shapes == [(1, 33), (1, 37), (1, 57), (1, 64), (2, 40), (2, 50)], shapes
    check(attend(case, plan), reference(case), dtype, f"prefill step {PREFILL_STEP}")
    # The same plan on another layer, with row-strided queries (a view of a fused QKV output).
    case.layer = 0
    wide = torch.full((case.query.shape[0], 2 * heads[0], 64), math.nan, dtype=dtype)
    wide[:, : heads[0]] = case.query
    case.query = wide[:, : heads[0]]
    check(attend(case, plan), reference(case), dtype, "prefill step, layer 0, strided query")


def test_sdpa_dtype():
    # bf16 runs SDPA in bf16 (fp32 accumulation inside); every other mix in fp32.
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert torch_planned.sdpa_dtype(bf16, bf16) == bf16
    assert [torch_planned.sdpa_dtype(a, b) for a, b in ((f16, f16), (f32, f32), (bf16, f32))] == [f32] * 3


def test_small_memory_budget_chunks_and_groups(monkeypatch):
    # A tiny budget forces many tile groups and context chunks: results must not change.
    # (A planned workspace too large for its budget falls back to this chunked path.)
    monkeypatch.setattr(torch_planned, "PLANNED_MAX_GATHER_ELEMS", 0)
    monkeypatch.setattr(torch_impl, "GATHER_BUDGET_ELEMS", 1 << 12)
    monkeypatch.setattr(torch_impl, "MIN_KV_CHUNK", 8)
    monkeypatch.setattr(torch_impl, "Q_TILE", 16)
    batch = [(70, 70), (90, 13), (33, 1), (3, 1), (200, 1)]
    case = make_case([s for s, _ in batch], [n for _, n in batch], 28, 4, 64, 8, torch.float32)
    check(attend(case), reference(case), torch.float32, "prefill under a small gather budget")


MIXED = [(70, 70), (90, 13), (33, 1), (3, 1), (200, 1), (200, 1), (17, 1), (64, 0), (41, 2)]


@pytest.mark.parametrize("group_tokens", [1, 64, torch_groups.GROUP_TOKENS])
def test_plan_shared_by_layers(monkeypatch, group_tokens):
    # One plan, two layers of the pool (as the model uses it); sequence 7 has no new token;
    # groups of one sequence each up to one group for all decode tokens.
    monkeypatch.setattr(torch_groups, "GROUP_TOKENS", group_tokens)
    lens, q_lens = [s for s, _ in MIXED], [n for _, n in MIXED]
    case = make_case(lens, q_lens, 9, 3, 64, 16, torch.float32, seed=3)
    plan = plan_case(case)
    assert plan.backend == "torch" and plan.total_q == sum(q_lens)
    for layer in (1, 0):
        case.layer = layer
        check(attend(case, plan), reference(case), torch.float32, f"planned layer {layer} batch={MIXED}")


def metadata(q_lens: list[int], seq_lens: list[int], block_size: int, device: str = "cpu"):
    """(block_tables, query_start_loc, seq_lens) of a batch, without a pool."""
    blocks = [-(-n // block_size) for n in seq_lens]
    tables = torch.arange(len(seq_lens) * max(blocks), dtype=torch.int32).view(len(seq_lens), -1)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return tables.to(device), qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)


def test_plan_picks_the_kernel():
    # Triton backend, planned on CPU tensors (nothing is launched): decode-only batches get the
    # split-KV decode kernel with its split count fixed now, any other batch the prefill kernel.
    meta = metadata([1, 1, 1], [5, 40, 17], 16)
    dec = kernels.plan_attention(*meta, 16, backend="triton", num_kv_heads=8)
    assert (dec.kernel, dec.decode_only, dec.num_splits, dec.max_seq_len) == ("triton_decode", True, 1, 40)
    assert dec.groups == [] and dec.decode is None
    mixed = kernels.plan_attention(*metadata([1, 7, 1], [5, 40, 17], 16), 16, backend="triton")
    assert (mixed.kernel, mixed.decode_only, mixed.num_splits, mixed.total_q) == ("triton_prefill", False, None, 9)
    with pytest.raises(ValueError, match="num_splits applies to the triton decode kernel only"):
        kernels.plan_attention(*metadata([1, 7, 1], [5, 40, 17], 16), 16, backend="triton", num_splits=2)
    # Llama-3-8B-like decode: 64 sequences x 8 KV heads fill 132 SMs twice over -> no split (policy).
    long = kernels.plan_attention(*metadata([1] * 64, [4096] * 64, 16), 16, backend="triton", num_kv_heads=8)
    assert long.kernel == "triton_decode" and long.num_splits == plan_mod.default_num_splits(64, 8, 4096) == 1
    # Without num_kv_heads the split count is decided at the first call from the cache's shape.
    late = kernels.plan_attention(*metadata([1], [4096], 16), 16, backend="triton")
    assert late.num_splits is None and late.splits_for(8) == 32 and late.num_splits == 32
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 64\]"):
        kernels.plan_attention(*meta, 16, backend="triton", num_kv_heads=8, num_splits=65)
    forced = kernels.plan_attention(*meta, 16, backend="triton", num_kv_heads=8, num_splits=5)
    assert forced.num_splits == 5
    # CPU: the torch path, decode rows to the native kernel when it is built.
    cpu = kernels.plan_attention(*meta, 16)
    assert cpu.kernel == "torch" and cpu.decode_only
    assert (cpu.decode is not None) == cpu_native.available()


def test_plan_reads_only_host_lengths():
    # Metadata on the meta device cannot be read at all: planning must use the host copies
    # (tensors or lists) and only queue conversions of the device tensors.
    meta = metadata([1, 1], [5, 40], 16, device="meta")
    plan = kernels.plan_attention(*meta, 16, backend="triton", host_query_start_loc=[0, 1, 2],
                                  host_seq_lens=torch.tensor([5, 40]), num_kv_heads=2)  # fmt: skip
    assert plan.kernel == "triton_decode" and plan.max_seq_len == 40 and plan.total_q == 2
    assert plan.block_tables.device.type == "meta" and plan.block_tables.dtype == torch.int32
    mixed = kernels.plan_attention(*meta, 16, backend="triton", host_query_start_loc=[0, 2, 3],
                                   host_seq_lens=[5, 40])  # fmt: skip
    assert mixed.kernel == "triton_prefill" and mixed.total_q == 3
    with pytest.raises(ValueError, match="host_seq_lens"):
        kernels.plan_attention(*meta, 16, backend="triton", host_query_start_loc=[0, 1, 2])
    with pytest.raises(ValueError, match="host_query_start_loc must be"):
        kernels.plan_attention(*meta, 16, host_query_start_loc=[0, 1], host_seq_lens=[5, 40])
    with pytest.raises(ValueError, match="capacity"):  # the host values are checked
        kernels.plan_attention(*meta, 16, host_query_start_loc=[0, 1, 2], host_seq_lens=[5, 400])
    with pytest.raises(ValueError, match="must be int32"):
        kernels.plan_attention(meta[0].long(), *meta[1:], 16, host_query_start_loc=[0, 1, 2], host_seq_lens=[5, 40])


def test_plan_room_for_sliding_window():
    # Accepted as None only; a set value is refused clearly, a malformed one is a ValueError.
    # (fp8 KV scales are no plan metadata: they go to each op, tests/kernels/test_kernels_fp8.py.)
    meta = metadata([1, 3], [5, 40], 16)
    plan = kernels.plan_attention(*meta, 16, sliding_window=None)
    assert plan.sliding_window is None
    with pytest.raises(NotImplementedError, match="sliding-window"):
        kernels.plan_attention(*meta, 16, sliding_window=128)
    with pytest.raises(ValueError, match="sliding_window must be"):
        kernels.plan_attention(*meta, 16, sliding_window=0)
    with pytest.raises(TypeError, match="k_scale"):
        kernels.plan_attention(*meta, 16, k_scale=torch.ones(4))


def test_plan_groups_pad_and_mask():
    # Decode tokens of close lengths share a group; unequal lengths need a mask, equal ones not;
    # a whole prompt alone is plain causal.
    case = make_case([40, 41, 40, 300, 8], [1, 1, 1, 1, 8], 9, 3, 64, 16, torch.float32)
    with cpu_native.use_native(False):
        plan = plan_case(case)
    assert plan.decode is None
    shapes = [
        (g.num_seqs, g.q_pad, g.ctx_pad, g.mask is not None, g.is_causal) for g in plan.groups
    ]
    # Masked and causal groups gather a context aligned to CTX_ALIGN positions.
    align = torch_groups.CTX_ALIGN
    assert shapes == [(3, 1, align * -(-41 // align), True, False), (1, 1, 300, False, False),
                      (1, 8, align, False, True)]
    assert plan.decode_only is False
    # Sorted by length: sequences 0, 2 (40 tokens), 1 (41). Position 40 of a 40-token sequence
    # is clamped to its position 39: a slot past a sequence's length is never gathered.
    g = plan.groups[0]
    assert g.q_rows.tolist() == [0, 2, 1]
    last_block, last_off = g.blocks.view(3, -1)[:, 40], g.offsets.view(3, -1)[:, 40]
    want = case.block_tables[[0, 2, 1], [39 // 16, 39 // 16, 40 // 16]].long()
    assert torch.equal(last_block, want), (last_block, want)
    assert last_off.tolist() == [39 % 16, 39 % 16, 40 % 16]


def test_native_kernel_builds_where_a_compiler_exists():
    # A broken build must not hide behind the torch fallback on a machine that can build it.
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    assert cpu_native.available(), cpu_native.unavailable_reason


@pytest.fixture
def native_only():
    if not cpu_native.available():
        pytest.skip(f"native CPU decode kernel unavailable: {cpu_native.unavailable_reason}")


def test_plan_native_decode_rows(native_only):
    # With the native kernel, one-token sequences are listed, not grouped; the prompt still is.
    case = make_case([40, 41, 40, 300, 8], [1, 1, 1, 1, 8], 9, 3, 64, 16, torch.float32)
    plan = plan_case(case)
    assert plan.decode.seq_index.tolist() == [0, 2, 1, 3]  # sorted by length, as groups are
    assert plan.decode.q_index.tolist() == [0, 2, 1, 3]
    shapes = [(g.num_seqs, g.q_pad, g.ctx_pad, g.is_causal) for g in plan.groups]
    assert shapes == [(1, 8, torch_groups.CTX_ALIGN, True)]  # aligned, hidden by causality
    check(attend(case, plan), reference(case), torch.float32, "native decode rows + gathered prompt")
    # An fp16 call with the same plan gathers the decode rows instead (built on demand).
    half = make_case([40, 41, 40, 300, 8], [1, 1, 1, 1, 8], 9, 3, 64, 16, torch.float16)
    hplan = plan_case(half)
    assert hplan.decode is not None
    check(attend(half, hplan), reference(half), torch.float16, "fp16 through a native plan")
    assert [g.num_seqs for g in hplan.decode.gather_groups()] == [3, 1]


@pytest.mark.parametrize("block_size", [1, 16, 24, 32])
def test_native_decode_bf16(native_only, monkeypatch, block_size):
    # bf16 decode rows go to the native kernel itself (not the gather fallback) once it has bf16.
    case = make_case([1, 15, 16, 17, 300], [1] * 5, 32, 1, 64, block_size, torch.bfloat16, seed=block_size)
    if not cpu_native.supports(case.query, case.key_cache, case.value_cache):
        pytest.skip("the native CPU decode kernel has no bf16 yet (cpu_native.supports)")
    calls = []
    real = cpu_native.paged_decode
    monkeypatch.setattr(cpu_native, "paged_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    plan = plan_case(case)
    check(attend(case, plan), reference(case), torch.bfloat16, f"native bf16 decode bs={block_size}")
    assert calls and plan.groups == [], "bf16 decode rows did not reach the native kernel"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [1, 3, 9])
def test_native_decode_threads_and_odd_head_dim(native_only, threads, num_seqs):
    # head_dim 20: the 8-wide vector loops' scalar tails; 1 sequence: work split by KV head;
    # 9 sequences: whole sequences per item; 2 threads: the OpenMP team.
    lens = [1, 7, 8, 9, 33, 130, 2, 64, 65][:num_seqs]
    case = make_case(lens, [1] * num_seqs, 12, 4, 20, 8, torch.float32, seed=num_seqs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attend(case)
    finally:
        torch.set_num_threads(before)
    check(out, reference(case), torch.float32, f"native decode lens={lens} threads={threads}")


def test_native_decode_strided_query_and_bad_block(native_only):
    # The model passes query rows that are views into its fused QKV output.
    case = make_case([5, 40, 17], [1, 1, 1], 9, 3, 64, 8, torch.float32)
    wide = torch.randn(3, 15, 64)
    wide[:, :9] = case.query
    q = wide[:, :9]
    assert not q.is_contiguous()
    plan = plan_case(case)
    out = kernels.paged_attention(q, case.key_cache, case.value_cache, plan, case.scale)
    check(out, reference(case), torch.float32, "row-strided query")
    bad = case.block_tables.clone()
    bad[1, 0] = case.key_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="outside the cache"):
        plan = kernels.plan_attention(bad, case.query_start_loc, case.seq_lens, 8)
        kernels.paged_attention(case.query, case.key_cache, case.value_cache, plan, case.scale)


def test_plan_is_its_own_copy_and_calls_must_fit_it():
    case = make_case([5, 40, 17], [1, 1, 1], 9, 3, 64, 8, torch.float32)
    plan = plan_case(case)
    assert plan.decode_only
    case.seq_lens[1] = 1  # the caller's tensors change after planning: the plan keeps its copy
    case.block_tables[0, 0] = 0
    assert plan.seq_lens.tolist() == [5, 40, 17] and plan.block_tables[0, 0] != 0
    case = make_case([5, 40, 17], [1, 1, 1], 9, 3, 64, 8, torch.float32)
    check(attend(case, plan), reference(case), torch.float32, "planned decode")
    kc, vc = case.key_cache, case.value_cache
    with pytest.raises(ValueError, match="do not fit the plan"):
        kernels.paged_attention(case.query[:2], kc, vc, plan, 1.0)  # 2 query rows, plan has 3
    with pytest.raises(ValueError, match="do not fit the plan"):
        other = kernels.plan_attention(case.block_tables, case.query_start_loc, case.seq_lens, 16)
        kernels.paged_attention(case.query, kc, vc, other, 1.0)  # planned for block size 16, cache has 8
    with pytest.raises(ValueError, match="do not fit the plan"):
        kernels.paged_attention(case.query[:, :7], kc, vc, plan, 1.0)  # 7 q heads over 3 KV heads
    with pytest.raises(ValueError, match="do not fit the plan"):
        kernels.paged_attention(case.query, kc, vc.half(), plan, 1.0)
    with pytest.raises(ValueError, match="new tokens"):
        bad = torch.tensor([0, 2, 3], dtype=torch.int32)  # 2 new tokens, 1 in cache
        kernels.plan_attention(case.block_tables[:2], bad, torch.tensor([1, 9]), 8)
    with pytest.raises(ValueError, match="start at 0"):
        kernels.plan_attention(case.block_tables[:2], bad + 1, torch.tensor([9, 9]), 8)


def test_planned_path_without_row_view_falls_back():
    # Caches whose blocks are not contiguous rows (heads outermost) take the chunked path.
    case = make_case([5, 40, 17], [1, 3, 17], 8, 2, 64, 8, torch.float32)
    kc = case.key_cache.transpose(1, 2).contiguous().transpose(1, 2)  # [NB, B, Hk, D] strided
    vc = case.value_cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch_impl.row_view(kc) is None
    out = kernels.paged_attention(case.query, kc, vc, plan_case(case), case.scale)
    check(out, reference(case), torch.float32, "strided cache")


def test_default_split_policy():
    # Split by occupancy: until sequences x KV heads x splits fill the SMs twice (264 programs on
    # 132 SMs), each split at least 128 context positions, at most 64 splits.
    split = plan_mod.default_num_splits
    assert split(1, 3, 256) == 2  # SmolLM2 at batch 1: 6 programs, not 3
    assert split(1, 3, 1000) == 7  # by length: 1000 // 128
    assert split(1, 3, 16384) == 64  # by the cap (88 would fill the SMs)
    assert split(1, 8, 32768) == 33  # by occupancy: ceil(264 / 8)
    assert split(8, 8, 4096) == 5  # ceil(264 / 64)
    assert split(33, 8, 100_000) == split(64, 8, 4096) == split(512, 8, 100_000) == 1  # the SMs are full
    assert split(1, 3, 100) == 1  # under one split's worth of context
    assert split(1, 8, 4096, num_sms=16) == 4  # a smaller GPU: 32 programs
    assert plan_mod.num_sms(torch.device("cpu")) == plan_mod.DEFAULT_NUM_SMS == 132


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 16, 24])
def test_reshape_and_cache_round_trip_torch(block_size, dtype, native):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim = 12, 3, 80
    pool = torch.full((num_blocks, 2, 2, block_size, heads, dim), math.nan, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:9].to(torch.int64)
    # fp32, cast on write; keys are row-strided views (as the model's fused QKV output gives)
    key = torch.randn(9, heads + 2, dim, generator=gen)[:, 1 : heads + 1]
    value = torch.randn(9, heads, dim, generator=gen)
    before = pool.clone()
    bad = slots.clone()
    bad[4] = num_blocks * block_size
    with pytest.raises(ValueError, match="slot_mapping values"):
        kernels.reshape_and_cache(key, value, pool[:, 1, 0], pool[:, 1, 1], bad, backend="torch")
    assert torch.equal(pool.isnan(), before.isnan()), "a rejected write changed the cache"
    kernels.reshape_and_cache(key, value, pool[:, 1, 0], pool[:, 1, 1], slots, backend="torch")
    blocks, offs = slots // block_size, slots % block_size
    assert torch.equal(pool[blocks, 1, 0, offs], key.to(dtype)), "keys not in their slots"
    assert torch.equal(pool[blocks, 1, 1, offs], value.to(dtype)), "values not in their slots"
    pool[blocks, 1, :, offs] = before[blocks, 1, :, offs]
    assert torch.equal(pool.isnan(), before.isnan()), "a write landed outside its slot"


def test_copy_blocks_round_trip_torch():
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(10, 3, 2, 24, 2, 64, generator=gen)
    before = pool.clone()
    pairs = torch.tensor([[1, 7], [4, 2], [1, 9]], dtype=torch.int64)
    kernels.copy_blocks(pool, pairs, backend="torch")
    for src, dst in pairs.tolist():
        assert torch.equal(pool[dst], before[src]), f"block {dst} is not a copy of {src}"
    untouched = [b for b in range(10) if b not in (7, 2, 9)]
    assert torch.equal(pool[untouched], before[untouched]), "a block outside dst changed"


def big_pool(num_blocks: int) -> torch.Tensor:
    """A pool whose last blocks start past element 2**31 (untouched: virtual memory only)."""
    pool = torch.empty(num_blocks, 1, 2, 16, 1, 64, dtype=torch.float16)
    assert pool.stride(0) * (num_blocks - 4) > 2**31
    return pool


def test_int64_offsets_torch():
    run_int64_case(big_pool((1 << 20) + 64), backend="torch")


def test_errors_are_value_errors(monkeypatch):
    case = make_case([5, 9], [1, 1], 8, 8, 64, 8, torch.float32)
    kc, vc, bt, sl, qsl = case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.query_start_loc
    q = case.query
    with pytest.raises(ValueError, match="backend"):
        kernels.plan_attention(bt, qsl, sl, 8, backend="cuda")
    with pytest.raises(ValueError, match="seq_lens must be >= 1"):
        kernels.plan_attention(bt, qsl, torch.zeros_like(sl), 8)
    with pytest.raises(ValueError, match="capacity"):
        kernels.plan_attention(bt[:, :1], qsl, sl, 8)
    with pytest.raises(ValueError, match="num_splits"):
        kernels.plan_attention(bt, qsl, sl, 8, backend="triton", num_splits=0)
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.plan_attention(bt, qsl[:2], sl, 8)
    with pytest.raises(ValueError, match="new tokens"):
        bad_qsl = torch.tensor([0, 2, 2], dtype=torch.int32)  # 2 new tokens, 1 in cache
        kernels.plan_attention(bt, bad_qsl, torch.tensor([1, 9]), 8)
    with pytest.raises(ValueError, match="slot_mapping values"):
        k = torch.zeros(1, 8, 64)
        kernels.reshape_and_cache(k, k, kc, vc, torch.tensor([10**6]))
    with pytest.raises(ValueError, match="race"):
        kernels.copy_blocks(case.pool, torch.tensor([[0, 1], [1, 2]]))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plan = kernels.plan_attention(bt, qsl, sl, 8, backend="triton")  # planning needs no GPU
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kernels.paged_attention(q, kc, vc, plan, 1.0)


def test_kernels_import_without_triton():
    # Neither the torch path nor planning for the Triton kernels imports triton.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "q = torch.randn(1, 2, 64); kc = torch.randn(2, 4, 2, 64)\n"
        "bt = torch.tensor([[1, 0]], dtype=torch.int32); sl = torch.tensor([6], dtype=torch.int32)\n"
        "qsl = torch.tensor([0, 1], dtype=torch.int32)\n"
        "kernels.paged_attention(q, kc, kc, kernels.plan_attention(bt, qsl, sl, 4), 0.125)\n"
        "assert kernels.plan_attention(bt, qsl, sl, 4, backend='triton').kernel == 'triton_decode'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_native_edges_fall_back_or_match_the_torch_path(native_only):
    # Inputs the native kernels must not mishandle: each gives the torch path's answer or its error.
    gen = torch.Generator().manual_seed(11)
    pool = torch.randn(6, 1, 2, 4, 2, 8, generator=gen)
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    # Values whose heads are not dense: the cache write falls back to the torch path.
    key = torch.randn(3, 2, 8, generator=gen)
    value = torch.randn(3, 2, 2, 8, generator=gen)[:, :, 0]
    slots = torch.tensor([0, 5, 22])
    kernels.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(vc[slots // 4, slots % 4], value)
    # One query head with a transposed head stride.
    one = make_case([6, 3], [1, 1], 1, 1, 8, 4, torch.float32, seed=2)
    q = torch.empty_strided((2, 1, 8), (8, 16, 1)).copy_(one.query)
    assert q.stride(1) != q.shape[2]
    out = kernels.paged_attention(q, one.key_cache, one.value_cache, plan_case(one), one.scale)
    check(out, reference(one), torch.float32, "single head, strided")
    # An int64 block id that an int32 copy would wrap onto a valid block.
    bt = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    sl = torch.tensor([6, 3], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    wide = bt.long()
    wide[0, 0] = 2**32 + 1
    with pytest.raises(ValueError, match="int32"):
        kernels.plan_attention(wide, qsl, sl, 4)
    # A first block whose scores all overflow to -inf weighs 0 (no NaN), as on the torch path.
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[1] = -1e30
    q = torch.full((2, 2, 8), 1e30)
    got = kernels.paged_attention(q, kc2, vc2, kernels.plan_attention(bt, qsl, sl, 4), 1.0)
    with cpu_native.use_native(False):
        want = kernels.paged_attention(q, kc2, vc2, kernels.plan_attention(bt, qsl, sl, 4), 1.0)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want)
