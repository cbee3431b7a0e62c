"""Dense, deliberately slow reference for the paged kernels, and builders of paged test cases.

The reference walks the block table one position at a time, builds each sequence's dense K/V,
repeats KV heads for GQA and takes the softmax in fp64. It shares no code with `kernels/`.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass
class PagedCase:
    """A batch laid out in a block-major pool with scattered blocks and NaN everywhere unused."""

    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int  # layer whose views are used
    query: torch.Tensor  # [total_new_tokens, num_q_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float

    @property
    def key_cache(self) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
        return self.pool[:, self.layer, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 1]


def make_case(
    seq_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    num_layers: int = 2,
    extra_blocks: int = 3,
) -> PagedCase:
    """Random keys/values in shuffled blocks; unused slots, blocks and table entries hold NaN
    (table entries past a sequence's last block point at an all-NaN block)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + sum(blocks_per_seq) // 4 + extra_blocks  # some unused
    pool = torch.full(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), math.nan, dtype=dtype
    )
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm[sum(blocks_per_seq)]  # an unused (all-NaN) block
    max_blocks = max(blocks_per_seq) + 2
    tables = torch.full((len(seq_lens), max_blocks), spare, dtype=torch.int32)
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = perm[used : used + nb]
        used += nb
        tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        kv = torch.randn(n, num_layers, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
        for i, blk in enumerate(ids):  # block i holds positions i*block_size ...
            rows = kv[i * block_size : (i + 1) * block_size]  # [<=block_size, L, 2, Hk, D]
            pool[blk, :, :, : rows.shape[0]] = rows.permute(1, 2, 0, 3, 4)
    total_q = sum(q_lens)
    query = torch.randn(total_q, num_q_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return PagedCase(
        pool=pool,
        layer=num_layers - 1,
        query=query,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        scale=head_dim**-0.5,
    )


E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` [..., H, D] stored as float8_e4m3fn with per-head `scale` [H]: x / scale in fp32,
    saturated to ±448, rounded to nearest even (vLLM's static fp8 KV quantization; written here
    from that definition, not taken from `kernels`)."""
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def from_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp64 values of e4m3 `x` [..., H, D] with per-head `scale` [H]: x * scale (the product in
    fp32, as the kernels' fp8 contract defines it, then widened)."""
    return (x.float() * scale[:, None]).double()


@dataclasses.dataclass
class Fp8Case:
    """A paged batch whose caches are fp8 (e4m3) with per-(layer, KV head) scales, beside the
    unquantized values they were made from (`make_fp8_case`)."""

    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, Hk, D] float8_e4m3fn
    exact: torch.Tensor  # the same shape, fp32: the values before quantization (NaN unused)
    scales: torch.Tensor  # [num_layers, 2, Hk] fp32: k (0) and v (1) scales per layer
    layer: int
    query: torch.Tensor  # [total_q, Hq, D]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float

    @property
    def key_cache(self) -> torch.Tensor:  # [num_blocks, block_size, Hk, D] fp8
        return self.pool[:, self.layer, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 1]

    @property
    def k_scale(self) -> torch.Tensor:  # [Hk] fp32 contiguous
        return self.scales[self.layer, 0].contiguous()

    @property
    def v_scale(self) -> torch.Tensor:
        return self.scales[self.layer, 1].contiguous()

    def reference(self, dequantized: bool = True) -> torch.Tensor:
        """fp64 dense attention over the cache's values (`fp8 * scale`), or with
        `dequantized=False` over the unquantized values it was made from."""
        if dequantized:
            k, v = from_e4m3(self.key_cache, self.k_scale), from_e4m3(self.value_cache, self.v_scale)
        else:
            k, v = self.exact[:, self.layer, 0], self.exact[:, self.layer, 1]
        return ref_attention(self.query, k, v, self.block_tables, self.query_start_loc, self.seq_lens, self.scale)

    def code_outputs(self) -> torch.Tensor:
        """[num_seqs, Hq, D] in the query's dtype: each sequence's attention output when its
        context is one position (`make_fp8_code_case`): that position's value, `fp8 * v_scale`
        rounded to fp32, then to the query's dtype (NaN codes NaN)."""
        rows = self.block_tables[:, 0].long()
        v = from_e4m3(self.value_cache[rows, 0], self.v_scale).float()  # [num_seqs, Hk, D]
        group = self.query.shape[1] // v.shape[1]
        return v.repeat_interleave(group, dim=1).to(self.query.dtype)

    def head_magnitude(self) -> torch.Tensor:
        """[Hq] fp64: the largest |value| of the KV head each query head reads (its outputs'
        scale, by which errors are measured)."""
        v = self.exact[:, self.layer, 1].double().abs().nan_to_num(0.0)  # [NB, B, Hk, D]
        per_kv = v.amax(dim=(0, 1, 3))  # [Hk]
        return per_kv.repeat_interleave(self.query.shape[1] // per_kv.shape[0])


# Magnitudes of the KV heads' keys and values in `make_fp8_case` (cycled over the heads): scales
# four to five orders of magnitude apart, a head whose keys are small reading large values and
# the reverse. Queries are divided by their KV head's key magnitude, so every head's scores
# stay O(1).
#: Values where e4m3 rounding has edges, in units of a head's scale: saturation (448 and past it),
#: infinities, NaN, signed zeros, subnormals and their ties, and the ties around 1.
FP8_EDGES = (448.0, 449.0, 464.0, 1e6, math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-30, -1e-30,
             2.0**-10, 3 * 2.0**-10, 2.0**-9, 1.0625, 1.1875, -2.0**-10, 2.0**-6)


def place_fp8_edges(key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Put `FP8_EDGES` (times each head's scale) at the start of value row 0 and, negated, of key row 1."""
    edges = torch.tensor(FP8_EDGES)
    value[0, :, : edges.numel()] = edges * v_scale[:, None]
    key[1, :, : edges.numel()] = -edges * k_scale[:, None]


FP8_KEY_MAGNITUDES = (0.02, 50.0, 1.0)
FP8_VALUE_MAGNITUDES = (300.0, 0.004, 1.0)


def make_fp8_case(
    seq_lens: list[int],
    q_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_dtype: torch.dtype,
    seed: int = 0,
    binades: float = 8.0,
) -> Fp8Case:
    """`make_case`'s batch (scattered blocks, NaN in every unused slot) with fp8 caches: values
    randn x 2^-uniform(0, binades) x their head's magnitude (so the codes span many binades,
    subnormals included), quantized with per-(layer, KV head) scales max|x| / 448 (the largest
    value maps to 448); unused slots hold NaN (0x7F)."""
    case = make_case(seq_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    exact = case.pool * torch.exp2(-binades * torch.rand(case.pool.shape, generator=gen))
    mk = torch.tensor([FP8_KEY_MAGNITUDES[h % 3] for h in range(num_kv_heads)])
    mv = torch.tensor([FP8_VALUE_MAGNITUDES[h % 3] for h in range(num_kv_heads)])
    exact[:, :, 0] *= mk[:, None]
    exact[:, :, 1] *= mv[:, None]
    amax = exact.abs().nan_to_num(0.0).amax(dim=(0, 3, 5))  # [num_layers, 2, Hk]
    scales = (amax / E4M3_MAX).clamp(min=1e-30).float()
    pool = torch.empty(exact.shape, dtype=torch.float8_e4m3fn)
    for layer in range(exact.shape[1]):
        for kv in range(2):
            pool[:, layer, kv] = e4m3(exact[:, layer, kv], scales[layer, kv])
    group = num_q_heads // num_kv_heads
    query = case.query / mk.repeat_interleave(group)[:, None]
    return Fp8Case(
        pool=pool, exact=exact, scales=scales, layer=case.layer, query=query.to(query_dtype),
        block_tables=case.block_tables, seq_lens=case.seq_lens, query_start_loc=case.query_start_loc,
        scale=case.scale,
    )  # fmt: skip


def make_fp8_code_case(head_dim: int, query_dtype: torch.dtype, num_kv_heads: int = 2, group: int = 2) -> Fp8Case:
    """Decode rows over contexts of one position whose value rows hold every e4m3 byte 0..255 in
    turn (NaN codes 0x7F and 0xFF included), keys 0: each output is its one value times the v
    scale exactly (softmax weight 1; `Fp8Case.code_outputs`)."""
    per_seq = num_kv_heads * head_dim
    num_seqs = -(-256 // per_seq)
    case = make_fp8_case([1] * num_seqs, [1] * num_seqs, group * num_kv_heads, num_kv_heads, head_dim, 4,
                         query_dtype, seed=head_dim)  # fmt: skip
    codes = (torch.arange(num_seqs * per_seq) % 256).to(torch.uint8)
    for s in range(num_seqs):
        blk = int(case.block_tables[s, 0])
        case.value_cache[blk, 0].view(torch.uint8).copy_(codes[s * per_seq : (s + 1) * per_seq].view(num_kv_heads, -1))
        case.key_cache[blk, 0].view(torch.uint8).zero_()
    return case


def gather_dense(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """[n, num_kv_heads, head_dim] fp64: positions 0..n-1 read block by block via the table."""
    block_size = cache.shape[1]
    pieces = []
    for i in range((n + block_size - 1) // block_size):  # one block of the table at a time
        take = min(block_size, n - i * block_size)
        pieces.append(cache[int(table[i]), :take])  # [take, Hk, D]
    return torch.cat(pieces).double()


def ref_attention(
    query: torch.Tensor,  # [total_q, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:  # [total_q, num_q_heads, head_dim] fp64
    """Bottom-right aligned causal attention over each sequence's dense context, in fp64."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    for s in range(len(seq_lens)):
        n = int(seq_lens[s])
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if q1 == q0:
            continue
        k = gather_dense(key_cache, block_tables[s], n)  # [n, Hk, D]
        v = gather_dense(value_cache, block_tables[s], n)
        k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        nq = q1 - q0
        q = query[q0:q1].double()  # [nq, Hq, D]
        scores = torch.einsum("qhd,thd->hqt", q, k) * scale  # [Hq, nq, n]
        q_pos = torch.arange(n - nq, n, device=q.device)[:, None]  # [nq, 1] new tokens' positions
        visible = (
            torch.arange(n, device=q.device)[None, :] <= q_pos
        )  # [nq, n] causal, bottom-right aligned
        scores = scores.masked_fill(~visible, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqt,thd->qhd", probs, v)
    return out


def tolerance(dtype: torch.dtype) -> dict:
    """assert_close tolerances against the fp64 reference, per dtype."""
    return {
        torch.float32: {"atol": 2e-5, "rtol": 2e-5},
        torch.float16: {"atol": 3e-3, "rtol": 3e-3},
        torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    }[dtype]


def run_int64_case(pool: torch.Tensor, backend: str) -> None:
    """Write, copy and attend through blocks whose element offsets exceed 2**31.

    `pool`: [num_blocks, 1, 2, 16, 1, 64] fp16, mostly untouched (virtual memory only). Checks
    reshape_and_cache, copy_blocks and attention (a decode and a mixed batch: both Triton kernels)
    on `backend` against direct indexing and the dense reference.
    """
    import kernels

    nb, block_size, dev = pool.shape[0], pool.shape[3], pool.device
    gen = torch.Generator().manual_seed(7)
    table_ids = [nb - 1, 5, nb - 3]  # two high blocks and one low one
    pool[table_ids + [nb - 2, nb - 4]] = math.nan
    kc, vc = pool[:, 0, 0], pool[:, 0, 1]
    seq_len = 40
    pos = torch.arange(seq_len)
    slots = torch.tensor(table_ids)[pos // block_size] * block_size + pos % block_size
    slots = slots.to(dev)
    key = torch.randn(seq_len, 1, 64, generator=gen).half().to(dev)
    value = torch.randn(seq_len, 1, 64, generator=gen).half().to(dev)
    kernels.reshape_and_cache(key, value, kc, vc, slots.to(torch.int64), backend=backend)
    blocks, offs = slots // block_size, slots % block_size
    assert torch.equal(kc[blocks, offs], key), "keys did not land in their high slots"
    assert torch.equal(vc[blocks, offs], value), "values did not land in their high slots"

    pairs = torch.tensor([[nb - 1, nb - 2], [5, nb - 4]], dtype=torch.int64, device=dev)
    kernels.copy_blocks(pool, pairs, backend=backend)
    for src, dst in pairs.tolist():
        assert torch.equal(pool[dst].isnan(), pool[src].isnan()), f"copy {src}->{dst} failed"
        assert torch.equal(pool[dst].nan_to_num(), pool[src].nan_to_num()), f"copy {src}->{dst}"

    tables = torch.tensor([table_ids, [nb - 2, nb - 4, nb - 3]], dtype=torch.int32, device=dev)
    host_lens = torch.tensor([seq_len, seq_len], dtype=torch.int32)
    # Decode (split-KV forced on Triton), then a mixed batch (the prefill kernel on Triton).
    for q_lens in ([1, 1], [1, 3]):
        host_qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
        query = torch.randn(sum(q_lens), 4, 64, generator=gen).half().to(dev)
        ref = ref_attention(query, kc, vc, tables, host_qsl.to(dev), host_lens.to(dev), 0.125)
        decode = q_lens == [1, 1]
        plan = kernels.plan_attention(
            tables, host_qsl.to(dev), host_lens.to(dev), block_size, host_query_start_loc=host_qsl,
            host_seq_lens=host_lens, num_splits=2 if decode and backend == "triton" else None,
            backend=backend,
        )  # fmt: skip
        want = ("triton_decode" if decode else "triton_prefill") if backend == "triton" else "torch"
        assert plan.kernel == want, (plan.kernel, want)
        out = kernels.paged_attention(query, kc, vc, plan, 0.125)
        torch.testing.assert_close(out.double(), ref, **tolerance(torch.float16), msg=f"{want} int64")
