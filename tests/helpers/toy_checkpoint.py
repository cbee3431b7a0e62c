"""A toy Llama checkpoint of known tensor sizes (config.json + safetensors, zeros), for the tests
of a GPU pool's budget: its weights and activation reserve are worked out by hand."""

from __future__ import annotations

import json

import numpy as np

#: The toy model: vocabulary 128, width 64, SwiGLU 96, 2 layers, 4 query and 2 KV heads of 16, tied.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "tie_word_embeddings": True, "torch_dtype": "float32"}
#: Its weights by Hugging Face name: what the worker loads.
HF_SHAPES = {"model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,)} | {
    f"model.layers.{i}.{k}": s for i in range(2) for k, s in {
        "input_layernorm.weight": (64,), "self_attn.q_proj.weight": (64, 64), "self_attn.k_proj.weight": (32, 64),
        "self_attn.v_proj.weight": (32, 64), "self_attn.o_proj.weight": (64, 64),
        "post_attention_layernorm.weight": (64,), "mlp.gate_proj.weight": (96, 64), "mlp.up_proj.weight": (96, 64),
        "mlp.down_proj.weight": (64, 96)}.items()}
#: By hand: the 128 x 64 embedding, 2 layers of 64 + 4096 + 2048 + 2048 + 4096 + 64 + 6144 + 6144 + 6144
#: = 30848 (norm, q, k, v, o, norm, gate, up, down), the final norm's 64; no head (tied).
TOY_WEIGHTS = 128 * 64 + 2 * 30848 + 64


def write_checkpoint(folder, extra: dict | None = None, shards: int = 1) -> None:
    """config.json and the toy's tensors (plus ``extra``) in ``shards`` safetensors files with an index."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    tensors = {k: np.zeros(s, np.float32) for k, s in (HF_SHAPES | (extra or {})).items()}
    names = sorted(tensors)
    weight_map = {}
    for n in range(shards):
        part = {k: tensors[k] for k in names[n::shards]}
        file = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / file))
        weight_map |= dict.fromkeys(part, file)
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
