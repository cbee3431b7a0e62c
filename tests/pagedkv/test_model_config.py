"""A published model's config files and checkpoint, refused clearly when malformed: every bad value
a ValueError naming the file and key (never a traceback, never a silent coercion), generation
defaults no request could carry listed as ignored, and a checkpoint read only as the config says."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from compute_service.weights.source import check_model_source, load_model_source
from pagedkv.model.config import UnsupportedArchitectureError, read_hf_config

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "eos_token_id": 2, "tie_word_embeddings": True}


def write(d, config: dict | list | str, generation: dict | None = None):
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


@pytest.mark.parametrize("change, match", [
    ({"num_attention_heads": None}, "num_attention_heads must be an integer >= 1, got None"),
    ({"vocab_size": 32.5}, "vocab_size must be an integer >= 1, got 32.5"),
    ({"vocab_size": "32"}, "vocab_size must be an integer"),
    ({"hidden_size": True}, "hidden_size must be an integer"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of names"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"rope_scaling": "linear"}, "rope_scaling must be a JSON object"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling: factor is missing"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling: low_freq_factor is missing"),
    ({"rope_theta": -1}, "rope_theta must be a finite number > 0"),
    ({"eos_token_id": "</s>"}, "eos_token_id must be a token id or a list of token ids"),
    ({"eos_token_id": [2, 2**40]}, "eos_token_id must be a token id"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": True}, "sliding_window must be an integer >= 1"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 24.5}, "sliding_window must be an integer >= 1"),
])
def test_a_malformed_config_names_the_key(tmp_path, change, match):
    write(tmp_path, {**BASE, **change})
    with pytest.raises(ValueError, match=match) as e:
        read_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_a_missing_key_and_a_document_that_is_no_object(tmp_path):
    write(tmp_path, {k: v for k, v in BASE.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="hidden_size is missing"):
        read_hf_config(tmp_path)
    write(tmp_path, [BASE])
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        read_hf_config(tmp_path)
    write(tmp_path, {**BASE, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(UnsupportedArchitectureError, match="'Qwen3ForCausalLM' is not supported"):
        read_hf_config(tmp_path)


def test_integral_floats_and_nulls_read_as_transformers_does(tmp_path):
    c = read_hf_config(write(tmp_path, {**BASE, "vocab_size": 32.0, "num_key_value_heads": None, "head_dim": None,
                                        "architectures": ["MistralForCausalLM"], "sliding_window": None}))
    assert (c.vocab_size, c.num_kv_heads, c.head_dim, c.sliding_window) == (32, 2, 8, None)


def test_generation_defaults_no_request_could_carry_are_ignored_and_named(tmp_path):
    gen = {"temperature": "hot", "top_p": math.inf, "top_k": 10**12, "repetition_penalty": 1.1,
           "do_sample": True, "use_cache": True, "eos_token_id": [2, 5]}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen).replace("Infinity", "1e999"))
    c = read_hf_config(write(tmp_path, BASE))
    assert (c.generation.temperature, c.generation.top_p, c.generation.top_k) == (None, None, None)
    assert c.generation.repetition_penalty == pytest.approx(1.1)
    assert c.ignored_generation_keys == ("do_sample", "temperature", "top_k", "top_p")
    assert c.eos_token_ids == (2, 5)
    write(tmp_path, BASE, {"eos_token_id": [[2]]})
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id"):
        read_hf_config(tmp_path)


def _tensors(hidden=16, inter=32, vocab=32, kv=8, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": r(hidden)}
    p = "model.layers.0."
    t.update({p + "input_layernorm.weight": r(hidden), p + "post_attention_layernorm.weight": r(hidden),
              p + "self_attn.q_proj.weight": r(hidden, hidden), p + "self_attn.k_proj.weight": r(kv, hidden),
              p + "self_attn.v_proj.weight": r(kv, hidden), p + "self_attn.o_proj.weight": r(hidden, hidden),
              p + "mlp.gate_proj.weight": r(inter, hidden), p + "mlp.up_proj.weight": r(inter, hidden),
              p + "mlp.down_proj.weight": r(hidden, inter)})
    if bias:
        t[p + "self_attn.q_proj.bias"] = r(hidden)
    return t


def test_a_checkpoint_is_refused_before_any_weight_is_read(tmp_path):
    write(tmp_path, BASE)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\"")  # truncated header
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        check_model_source(str(tmp_path))
    t = _tensors()
    t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].to(torch.int8)
    save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"weights must be floating point; layers.0.wq \(torch.int8\)"):
        check_model_source(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(ValueError, match="names files outside the model directory"):
        check_model_source(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="not a safetensors index with a weight_map"):
        check_model_source(str(tmp_path))


def test_a_bias_the_config_does_not_declare_is_ignored_as_transformers_does(tmp_path):
    write(tmp_path, BASE)
    save_file(_tensors(bias=True), tmp_path / "model.safetensors")
    _, weights = load_model_source(str(tmp_path))
    assert "layers.0.bq" not in weights
    write(tmp_path, {**BASE, "attention_bias": True})  # declared: q/k/v/o biases required
    with pytest.raises(ValueError, match="self_attn.k_proj.bias missing"):
        check_model_source(str(tmp_path))
