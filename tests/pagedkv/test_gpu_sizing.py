"""A GPU pool's budget (pagedkv.config.gpu_sizing) and the weights it sets aside, counted from a
checkpoint's files without loading them (pagedkv.model.weight_bytes): the arithmetic on numbers
worked out by hand, the checkpoints written here with tensors of known sizes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers.toy_checkpoint import CONFIG, HF_SHAPES, TOY_WEIGHTS, write_checkpoint

from pagedkv.config import BFLOAT16, FLOAT32, FP8
from pagedkv.config.gpu_sizing import activation_reserve, check_utilization, gpu_pool_bytes, refuse_on_cpu
from pagedkv.model.config import read_hf_config
from pagedkv.model.weight_bytes import count_weights, parameter_count, read_model_config

GiB = 2**30
def test_the_toys_weights_by_hand_match_its_shapes():
    assert TOY_WEIGHTS == sum(math.prod(s) for s in HF_SHAPES.values()) == 69952


def test_safetensors_headers_give_the_weights_the_worker_loads(tmp_path):
    """Every tensor's elements from the headers, over shards named by the index; the tied head and
    rotary buffers (not loaded by the worker) and files the index does not name left out."""
    write_checkpoint(tmp_path / "m", extra={"lm_head.weight": (128, 64),
                                            "model.layers.0.self_attn.rotary_emb.inv_freq": (8,)}, shards=2)
    from safetensors.numpy import save_file

    save_file({"stray": np.zeros((1000,), np.float32)}, str(tmp_path / "m" / "other.safetensors"))
    count = count_weights(tmp_path / "m")
    assert (count.elements, count.source) == (TOY_WEIGHTS, "safetensors")
    assert count.nbytes(BFLOAT16.itemsize) == 2 * 69952
    # Untied, the head is the worker's too.
    untied = {**CONFIG, "tie_word_embeddings": False}
    (tmp_path / "m" / "config.json").write_text(json.dumps(untied))
    assert count_weights(tmp_path / "m").elements == TOY_WEIGHTS + 128 * 64


def test_a_config_without_weights_counts_its_parameters(tmp_path):
    """A repo resolved for its config only: the parameter count from the shape, which equals the
    checkpoint's headers for this architecture (Qwen2 adds q/k/v biases)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    count = count_weights(tmp_path)
    assert (count.elements, count.source) == (TOY_WEIGHTS, "config")
    cfg = {**CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert parameter_count(read_hf_config(tmp_path)) == TOY_WEIGHTS + 2 * (64 + 32 + 32)


def test_a_gguf_counts_its_tensor_infos(tmp_path):
    """A GGUF written here (llama.cpp names, no output.weight: tied): its tensor infos' elements,
    and its config from the same parse."""
    import gguf

    names = {"token_embd.weight": (128, 64), "output_norm.weight": (64,)} | {
        f"blk.{i}.{k}.weight": s for i in range(2) for k, s in {
            "attn_norm": (64,), "attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
            "ffn_norm": (64,), "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96)}.items()}
    path = tmp_path / "toy.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_vocab_size(128)
    w.add_context_length(256)
    w.add_file_type(0)
    for name, shape in names.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert count_weights(path).elements == TOY_WEIGHTS and count_weights(path).source == "gguf"
    assert count_weights(tmp_path).elements == TOY_WEIGHTS  # a folder holding one GGUF
    cfg = read_model_config(path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.tie_word_embeddings, cfg.dtype) == (64, 2, True, "float32")


def test_the_activation_reserve_term_by_term(tmp_path):
    """The docstring's formula at T = 32 tokens, bfloat16 (b = 2), by hand."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    r = activation_reserve(read_hf_config(tmp_path), 32, BFLOAT16)
    assert r.hidden_bytes == 4 * 32 * 64 * 2 == 16384
    assert r.attention_bytes == 32 * 16 * (3 * 4 + 3 * 2) * 2 + 32 * 4 * 16 * 4 == 26624
    assert r.mlp_bytes == 3 * 32 * 96 * 2 == 18432
    assert r.logits_bytes == 32 * 128 * (2 + 4 + 4) == 40960
    assert r.total_bytes == 102400
    assert activation_reserve(read_hf_config(tmp_path), 64, FLOAT32).total_bytes > 2 * r.total_bytes
    with pytest.raises(ValueError, match="max-num-batched-tokens must be >= 1"):
        activation_reserve(read_hf_config(tmp_path), 0, BFLOAT16)
    with pytest.raises(ValueError, match="never fp8"):
        activation_reserve(read_hf_config(tmp_path), 32, FP8)


def test_the_budget_on_a_fake_device():
    """floor(F x total) - W x (weights + reserve), on an 80 GiB device."""
    assert gpu_pool_bytes(80 * GiB, 0.9, 1, 16 * GiB, GiB) == int(0.9 * 80 * GiB) - 17 * GiB
    assert gpu_pool_bytes(80 * GiB, 0.5, 2, 10 * GiB, GiB) == 40 * GiB - 22 * GiB
    assert gpu_pool_bytes(100, 1.0, 1, 30, 20) == 50


def test_a_budget_that_leaves_too_little_names_every_term():
    with pytest.raises(ValueError) as e:
        gpu_pool_bytes(80 * GiB, 0.5, 3, 12 * GiB, 2 * GiB)  # 40 GiB - 3 x 14 GiB < 0
    msg = str(e.value)
    for term in ("no room for the pool", "0.5 x 80.00 GiB", "40.00 GiB", "3 worker(s) per device",
                 "weights 12.00 GiB", "activation reserve 2.00 GiB", "42.00 GiB", "-2.00 GiB",
                 "--gpu-memory-utilization", "--max-num-batched-tokens", "--workers-per-device", "--kv-cache-memory"):
        assert term in msg, (term, msg)
    with pytest.raises(ValueError, match=r"less than one sequence of 131072 tokens needs \(16.00 GiB") as e:
        gpu_pool_bytes(80 * GiB, 0.5, 1, 20 * GiB, 10 * GiB, min_pool_bytes=16 * GiB,
                       min_pool_what="one sequence of 131072 tokens")
    assert "leaves 10.00 GiB" in str(e.value) and "--max-model-len" in str(e.value)
    with pytest.raises(ValueError, match="workers-per-device must be >= 1"):
        gpu_pool_bytes(80 * GiB, 0.5, 0, GiB, GiB)


@pytest.mark.parametrize("value", [0, -0.1, 1.01, 2, "x", float("nan")])
def test_utilization_outside_zero_one_is_refused(value):
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        check_utilization(value)


def test_utilization_is_refused_on_cpu_and_taken_on_cuda():
    assert check_utilization("1") == 1.0 and check_utilization(0.05) == 0.05
    with pytest.raises(ValueError, match="sizes a GPU pool.*--kv-cache-memory"):
        refuse_on_cpu("cpu", 0.9)
    refuse_on_cpu("cpu", None)
    refuse_on_cpu("cuda:1", 0.9)
