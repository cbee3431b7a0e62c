"""Read a llama-architecture GGUF file (llama.cpp's format) into our naming, cached as safetensors.

Tensors are dequantized to float32 with the `gguf` package and llama.cpp's Q/K row permutation
is undone; the config comes from the GGUF metadata. Dequantizing is slow, so the result is
written once as safetensors under `$PAGEDKV_HOME/weights/` (default `~/.cache/pagedkv/weights/`),
keyed by the file's name, size and mtime, with the config JSON in its metadata; every load after
that streams from the cache tensor by tensor (`compute_service.weights.checkpoint.SafetensorsWeights`),
as a Hugging Face checkpoint does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from compute_service.weights.checkpoint import SafetensorsWeights, TensorDict, WeightSource
from pagedkv.model.config import ModelConfig
from pagedkv.model.gguf_config import gguf_model_config, open_gguf
from pagedkv.runtime.paths import pagedkv_home

#: Each layer's tensors: our name -> GGUF name between `blk.{i}.` and `.weight` / `.bias`.
GGUF_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
    "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down",
}  # fmt: skip
#: Optional biases: our name -> GGUF name between `blk.{i}.` and `.bias`.
GGUF_LAYER_BIASES = {
    "bq": "attn_q", "bk": "attn_k", "bv": "attn_v", "bo": "attn_output",
    "b_gate": "ffn_gate", "b_up": "ffn_up", "b_down": "ffn_down",
}  # fmt: skip


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    llama.cpp stores each head's rows interleaved (pairs for its rotate-adjacent RoPE); HF keeps
    the two halves of a head apart (rotate_half). w: [n_head * head_dim, ...] -> same shape (a
    Q/K bias [n_head * head_dim] too).
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_cache_path(path: Path) -> Path:
    """Where the dequantized copy of GGUF `path` is cached (name, size and mtime in the name)."""
    st = path.stat()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)
    return pagedkv_home() / "weights" / f"{stem}-{st.st_size}-{st.st_mtime_ns}.safetensors"


def load_gguf(path: str | Path, cache: bool = True) -> tuple[ModelConfig, WeightSource]:
    """Read a llama-architecture GGUF file; every tensor dequantized to float32, in our naming.

    With `cache`, the result is stored once as safetensors (config JSON in its metadata) under
    `gguf_cache_path(path)`, and the weights returned stream from there (a lazy
    `SafetensorsWeights`); without it, they are an in-memory `TensorDict`.

    Raises ValueError when the architecture is not llama or a tensor is missing.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    cache_path = gguf_cache_path(path) if cache else None
    if cache_path is not None and cache_path.exists():
        with safe_open(cache_path, "pt") as f:
            meta = f.metadata()
        return ModelConfig.from_json(meta["config"]), SafetensorsWeights.from_files([cache_path])

    config, weights = _read_gguf(path)
    if cache_path is None:
        return config, TensorDict(weights)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(f".tmp{os.getpid()}")
    save_file(weights, tmp, metadata={"config": config.to_json(), "gguf": str(path)})
    os.replace(tmp, cache_path)
    del weights
    return config, SafetensorsWeights.from_files([cache_path])


def _read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf
    import numpy as np

    reader = open_gguf(path)
    config = gguf_model_config(reader, path)
    num_q_heads, num_kv_heads = config.num_q_heads, config.num_kv_heads

    raw: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        # numpy shape is the reverse of ggml's ne: [rows, cols] == torch Linear [out, in].
        arr = arr.reshape(tuple(reversed([int(n) for n in t.shape])))
        raw[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))

    w = {"embed": raw.pop("token_embd.weight"), "norm": raw.pop("output_norm.weight")}
    if not config.tie_word_embeddings:
        w["lm_head"] = raw.pop("output.weight")
    if "rope_freqs.weight" in raw:
        w["rope_freqs"] = raw.pop("rope_freqs.weight")
    heads = {"wq": num_q_heads, "wk": num_kv_heads, "bq": num_q_heads, "bk": num_kv_heads}
    for i in range(config.num_layers):
        for ours, g in GGUF_LAYER_TENSORS.items():
            key = f"blk.{i}.{g}.weight"
            if key not in raw:
                raise ValueError(f"{path}: tensor {key} missing")
            w[f"layers.{i}.{ours}"] = raw.pop(key)
        for ours, g in GGUF_LAYER_BIASES.items():
            if f"blk.{i}.{g}.bias" in raw:
                w[f"layers.{i}.{ours}"] = raw.pop(f"blk.{i}.{g}.bias")
        for ours, n in heads.items():
            if f"layers.{i}.{ours}" in w:
                w[f"layers.{i}.{ours}"] = unpermute_qk(w[f"layers.{i}.{ours}"], n).contiguous()
    return config, w
