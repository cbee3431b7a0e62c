"""The memory service sizes its pool from a model's config alone: a Hugging Face config.json or a
GGUF's metadata, as the worker reads them, and refuses what the worker would refuse."""

import json

import pytest

from memory_service.layout import SMOLLM2_LAYOUT, make_layout, model_attention_layout
from pagedkv.runtime.paths import smollm2_gguf_path


def test_gguf_metadata_gives_the_layout_the_worker_loads():
    gguf = smollm2_gguf_path()
    # SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64 (its model card; DESIGN.md)
    want = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    assert want == SMOLLM2_LAYOUT
    assert model_attention_layout(str(gguf)) == want  # the file
    assert model_attention_layout(str(gguf.parent)) == want  # a directory holding one GGUF
    layout = make_layout(str(gguf), block_size=16, dtype="float32", num_blocks=8)
    assert layout.shape == (8, 30, 2, 16, 3, 64)


def test_hf_config_gives_the_layout_and_unsupported_ones_are_named(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_attention_layout(str(tmp_path)) == {"num_layers": 3, "num_kv_heads": 2, "head_dim": 32}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        model_attention_layout(str(tmp_path))
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        model_attention_layout(str(bad))
