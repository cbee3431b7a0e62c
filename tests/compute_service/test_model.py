"""Our paged Llama against transformers' own LlamaForCausalLM on SmolLM2-135M-Instruct (fp32).

Tolerance: both sides run fp32 on the same dequantized weights, so logits differ only by
summation order. We require max |ours - reference| <= 1e-3 * max |reference logit| (about 0.04
at SmolLM2's logit scale of ~40; observed ~5e-5). Greedy tokens must be equal; a step where the
reference's top-2 margin is below 1e-4 is reported, not failed (a near-tie may flip either way).
The paged side is teacher-forced with the reference tokens so every step is compared.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers.model_fixtures import PROMPT, PagedCache, chat_ids, hf_greedy

import kernels
from compute_service.model.llama import LlamaForPagedLM, rope_inv_freq
from compute_service.weights.source import (
    SMOLLM2_GGUF,
    ModelConfig,
    RopeScaling,
    load_gguf,
    load_model_source,
    smollm2_gguf_path,
    unpermute_qk,
)

DECODE_STEPS = 32
REL_ATOL = 1e-3
TIE_MARGIN = 1e-4
BATCH_REL_ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):
    """Chat prompt ids, then the reference's 33 greedy tokens and their logits [33, vocab]."""
    ids = chat_ids(hf_tokenizer, PROMPT)
    tokens, logits = hf_greedy(hf_model, ids, DECODE_STEPS)
    return ids, tokens, logits


def _paged_run(model, ids, forced, chunks=None, seed=0):
    """Prefill `ids` (in `chunks` sizes if given), then feed `forced` one token per step.

    Returns logits [1 + len(forced), vocab]: after the prompt, then after each forced token.
    """
    cache = PagedCache(model, seed=seed)
    sizes = chunks or [len(ids)]
    start = 0
    for n in sizes:
        last = cache.step({0: ids[start : start + n]})[0]
        start += n
    assert start == len(ids)
    out = [last]
    for tok in forced:
        out.append(cache.step({0: [tok]})[0])
    return torch.stack(out)


def _compare(ours_logits, ref_tokens, ref_logits, what):
    scale = float(ref_logits.abs().max())
    diff = float((ours_logits - ref_logits).abs().max())
    assert diff <= REL_ATOL * scale, f"{what}: max |diff| {diff:.3g} > {REL_ATOL} * {scale:.3g}"
    top2 = ref_logits.topk(2, dim=-1).values
    for step, tok in enumerate(ours_logits.argmax(-1).tolist()):
        if tok != ref_tokens[step]:
            margin = float(top2[step, 0] - top2[step, 1])
            if margin < TIE_MARGIN:
                warnings.warn(
                    f"{what}: step {step} near-tie (margin {margin:.2g}) flipped", stacklevel=2
                )
                continue
            raise AssertionError(
                f"{what}: step {step} token {tok} != reference "
                f"{ref_tokens[step]} (margin {margin:.3g})"
            )


def test_greedy_matches_transformers(ours, reference, hf_tokenizer):
    _, _, model = ours
    ids, tokens, ref_logits = reference
    assert hf_tokenizer.decode(tokens).startswith("The capital of France is Paris.")
    logits = _paged_run(model, ids, tokens[:-1])
    _compare(logits, tokens, ref_logits, "prefill + decode")


def test_chunked_prefill_matches_transformers(ours, reference):
    _, _, model = ours
    ids, tokens, ref_logits = reference
    n = 8  # decode steps after the chunked prompt
    chunks = [5, 16, 1, 7, len(ids) - 29]  # crosses block boundaries (block size 16)
    logits = _paged_run(model, ids, tokens[:n], chunks=chunks, seed=3)
    _compare(logits, tokens[: n + 1], ref_logits[: n + 1], "chunked prefill")


def test_batch_matches_solo_runs(ours, hf_tokenizer):
    """Four prompts of different lengths join at different steps (prefill chunks and decode
    tokens in one forward); each sequence's tokens and logits equal its own solo run."""
    _, _, model = ours
    prompts = [
        chat_ids(hf_tokenizer, p)
        for p in (
            "What is the capital of France?",
            "Hi",
            "Name three colors.",
            "Write one sentence about the sea and the wind.",
        )
    ]
    steps = 6
    solo = []
    for ids in prompts:
        cache, toks, logits = PagedCache(model, seed=7), [], []
        last = cache.step({0: ids})[0]
        for _ in range(steps):
            logits.append(last)
            toks.append(int(last.argmax()))
            last = cache.step({0: [toks[-1]]})[0]
        solo.append((toks, torch.stack(logits)))

    join = [0, 0, 2, 3]  # step at which each sequence's prompt enters the batch
    cache = PagedCache(model, num_blocks=128, seed=11)
    got = {s: ([], []) for s in range(4)}
    pending: dict[int, list[int]] = {}
    for step in range(max(join) + steps):
        batch = {}
        for s in range(4):
            if join[s] == step:
                batch[s] = prompts[s][:]
            elif s in pending and len(got[s][0]) < steps:
                batch[s] = pending[s]
        out = cache.step(batch)
        for s, lg in out.items():
            got[s][0].append(int(lg.argmax()))
            got[s][1].append(lg)
            pending[s] = [got[s][0][-1]]
    for s in range(4):
        toks, logits = solo[s]
        assert got[s][0] == toks, f"seq {s}: batched tokens differ from its solo run"
        # Same arithmetic, but a matmul over more rows may order its sums differently: equal to
        # fp32 rounding accumulated over 30 layers: within 1e-5 of the largest logit.
        atol = BATCH_REL_ATOL * float(logits.abs().max())
        torch.testing.assert_close(
            torch.stack(got[s][1]), logits, atol=atol, rtol=0, msg=lambda m, s=s: f"seq {s}: {m}"
        )


def test_hf_directory_loads_same_tokens(hf_model, hf_tokenizer, reference, tmp_path, monkeypatch):
    """A directory written by transformers' save_pretrained loads through our HF loader."""
    # The GGUF-loaded model holds plain fp32 tensors; only its quantizer tag (when read from the GGUF
    # this run, not from the saved reference) blocks saving.
    monkeypatch.setattr(hf_model, "hf_quantizer", None, raising=False)
    hf_model.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    config, weights = load_model_source(str(tmp_path))
    assert (config.num_layers, config.num_q_heads, config.num_kv_heads, config.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    model = LlamaForPagedLM(config, weights)
    ids, tokens, ref_logits = reference
    n = 8
    logits = _paged_run(model, ids, tokens[:n])
    _compare(logits, tokens[: n + 1], ref_logits[: n + 1], "HF directory")


def test_gguf_config_and_cache(ours, pagedkv_home, monkeypatch):
    config, weights, _ = ours
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert (config.num_layers, config.num_q_heads, config.num_kv_heads) == (30, 9, 3)
    assert config.tie_word_embeddings and "lm_head" not in weights
    assert (config.bos_token_id, config.eos_token_ids, config.rope_scaling) == (1, (2,), None)
    assert ModelConfig.from_json(config.to_json()) == config
    # The first load wrote a dequantized copy under $PAGEDKV_HOME/weights; this one reads it.
    monkeypatch.setenv("PAGEDKV_HOME", str(pagedkv_home))
    files = list((pagedkv_home / "weights").glob("*.safetensors"))
    assert len(files) == 1 and files[0].name.startswith(SMOLLM2_GGUF.removesuffix(".gguf"))
    c2, w2 = load_gguf(smollm2_gguf_path())
    assert dataclasses.replace(c2, source="smollm2") == config
    for k in ("layers.0.wq", "layers.29.wk", "embed"):
        assert torch.equal(w2[k], weights[k]), k


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 64, 8)

    def llama_cpp_permute(x, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return (
            x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:])
            .swapaxes(1, 2)
            .reshape(x.shape)
        )

    assert torch.equal(unpermute_qk(llama_cpp_permute(w, 3), 3), w)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        RopeScaling("linear", 4.0),
        RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    ],
)
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "default" if scaling is None else scaling.kind, "rope_theta": 500000.0}
    if scaling is not None:
        rope.update(
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    hf = LlamaConfig(
        hidden_size=256, num_attention_heads=2, rope_parameters=rope, max_position_embeddings=131072
    )
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling.kind](hf, "cpu")
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=256,
        intermediate_size=64,
        num_layers=1,
        num_q_heads=2,
        num_kv_heads=2,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_ids=(),
        name="t",
        source="t",
    )
    torch.testing.assert_close(rope_inv_freq(cfg), ref.float(), rtol=1e-6, atol=0)


def test_bad_pool_and_weights_raise(ours):
    config, weights, model = ours
    pool = torch.zeros(4, config.num_layers, 2, 16, config.num_kv_heads + 1, config.head_dim)
    one = torch.zeros(1, dtype=torch.int64)
    meta = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.ones(1, dtype=torch.int32))
    plan = kernels.plan_attention(*meta, 16)
    with pytest.raises(ValueError, match="kv_pool shape"):
        model(one, one, pool, one, plan, one)
    good = torch.zeros(4, config.num_layers, 2, 16, config.num_kv_heads, config.head_dim)
    with pytest.raises(ValueError, match="block size 8"):
        model(one, one, good, one, kernels.plan_attention(*meta, 8), one)
    broken = dict(weights)
    del broken["layers.3.w_up"]
    with pytest.raises(ValueError, match="layers.3.w_up"):
        LlamaForPagedLM(config, broken)
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(config, num_kv_heads=2)


def test_tokenizer_cached_copy_matches(hf_tokenizer, tmp_path, monkeypatch):
    from pagedkv.model.tokenizer import load_tokenizer

    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path))
    first = load_tokenizer.__wrapped__("smollm2")
    assert list((tmp_path / "tokenizers").iterdir())
    again = load_tokenizer.__wrapped__("smollm2")  # from the saved copy
    for tok in (first, again):
        assert chat_ids(tok, PROMPT) == chat_ids(hf_tokenizer, PROMPT)
        assert tok.decode(chat_ids(tok, "Hi")) == hf_tokenizer.decode(chat_ids(hf_tokenizer, "Hi"))


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ],
)
def test_small_untied_model_from_hf_directory(rope, tmp_path):
    """A seeded random Llama (untied lm_head, GQA 4:2, scaled RoPE) saved by transformers loads
    through our HF loader; prefill + decode logits equal transformers' within 1e-4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=rope,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    config, weights = load_model_source(str(tmp_path))
    assert not config.tie_word_embeddings and "lm_head" in weights
    assert config.rope_scaling is not None and config.rope_scaling.kind == rope["rope_type"]
    model = LlamaForPagedLM(config, weights)
    ids = torch.randint(0, 256, (40,)).tolist()
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0].float()  # [40, vocab]
    cache = PagedCache(model, num_blocks=16, block_size=4, seed=5)
    got = [cache.step({0: ids[:30]})[0]] + [cache.step({0: [t]})[0] for t in ids[30:]]
    torch.testing.assert_close(torch.stack(got), ref[29:], atol=1e-4, rtol=0)


def test_step_inputs_plan_from_host_lengths():
    """The worker's plan comes from the step's host copies: a decode-only step plans the decode
    kernel (Triton) / decode rows (CPU), a step with a prompt chunk the prefill kernel."""
    from compute_service.step_inputs import build_step_inputs
    from pagedkv.compute.v1 import compute_service_pb2 as pb

    pool = torch.zeros(8, 2, 2, 4, 2, 16)  # [num_blocks, layers, 2, block_size 4, Hkv 2, Dh 16]

    def inputs(*seqs):
        req = pb.StepRequest(sequences=[
            pb.StepSequence(seq_id=i, token_ids=[1] * n, positions=range(p, p + n), block_ids=ids)
            for i, (p, n, ids) in enumerate(seqs)
        ])  # fmt: skip
        return build_step_inputs(req, block_size=4, num_blocks=8, vocab_size=10, device="cpu")

    dec = inputs((5, 1, [3, 1]), (0, 1, [6]))
    assert dec.host_seq_lens.tolist() == [6, 1] and dec.host_query_start_loc.tolist() == [0, 1, 2]
    plan = dec.attention_plan(pool)
    assert plan.kernel == "torch" and plan.decode_only and plan.block_size == 4
    assert dec.model_args(pool)[4].decode_only
    mixed = inputs((5, 1, [3, 1]), (0, 3, [6]))
    assert not mixed.attention_plan(pool).decode_only
    for step, want in ((dec, "triton_decode"), (mixed, "triton_prefill")):
        triton = kernels.plan_attention(
            step.block_tables, step.query_start_loc, step.seq_lens, 4, backend="triton",
            host_query_start_loc=step.host_query_start_loc, host_seq_lens=step.host_seq_lens, num_kv_heads=2,
        )  # fmt: skip
        assert triton.kernel == want
