"""A decoder's shape and generation settings, read from a Hugging Face config without any weights.

Shared by the compute worker (which loads the weights to this shape), the memory service (which
sizes its pool layout from it) and the client (which learns it through GetModelInfo). Pure JSON:
no torch.

Supported architectures (Hugging Face `architectures` / `model_type`):

    LlamaForCausalLM    llama (Llama 1-3.x, SmolLM2; Llama 3's RoPE scaling), optional biases
    MistralForCausalLM  mistral (sliding window: `sliding_window`, or none)
    Qwen2ForCausalLM    qwen2 (Qwen2, Qwen2.5: q/k/v biases; window only with use_sliding_window)

Anything else raises `UnsupportedArchitectureError` naming it.

Generation settings follow vLLM's default `generation_config="auto"`
(`vllm.config.ModelConfig.get_diff_sampling_param`): of generation_config.json, the keys
temperature, top_p, top_k and repetition_penalty become request defaults when their value differs
from transformers' `GenerationConfig` default (1.0, 1.0, 50, 1.0): a file that says `top_k: 50`
sets nothing, as in vLLM. End-of-sequence ids are the union of config.json's and
generation_config.json's `eos_token_id` (an int or a list in either).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

#: architectures entry -> model_type, of the decoders this project runs.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
#: model_type values accepted (SmolLM2's own configs say "llama"; older exports "smollm").
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM", "smollm": "LlamaForCausalLM",
                         "smollm2": "LlamaForCausalLM"}

#: generation_config.json keys used as request defaults, with transformers' GenerationConfig
#: default for each (a value equal to it is no default, vLLM's `to_diff_dict`).
HONOURED_GENERATION_KEYS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
#: generation_config.json keys that carry no sampling setting (never warned about): token ids read
#: elsewhere, file metadata, and what transformers' `save_pretrained` writes about its own outputs.
_GENERATION_METADATA_KEYS = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                             "transformers_version", "_from_model_config", "output_attentions",
                             "output_hidden_states", "output_scores", "output_logits",
                             "return_dict_in_generate", "use_cache", "cache_implementation"}


class UnsupportedArchitectureError(ValueError):
    """A config.json names an architecture this project does not run."""


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
class GenerationDefaults:
    """Request defaults from generation_config.json; None = not set there (vLLM's default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None


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
    eos_token_ids: tuple[int, ...]  # every token that ends generation (may be empty)
    name: str  # human-readable model name
    source: str  # where it was loaded from (path or "smollm2")
    architecture: str = "LlamaForCausalLM"  # Hugging Face class name (SUPPORTED_ARCHITECTURES)
    sliding_window: int | None = None  # tokens each query sees (Mistral); None = full causal
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    #: generation_config.json keys with a sampling meaning that are not honoured (warned at start).
    ignored_generation_keys: tuple[str, ...] = ()

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
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 token or None, got {self.sliding_window}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(_unsupported(self.architecture, self.source))

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (None without one); `eos_token_ids` holds them all."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if "eos_token_id" in d:  # written before eos_token_ids
            eos = d.pop("eos_token_id")
            d["eos_token_ids"] = [] if eos is None else [eos]
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["generation"] = GenerationDefaults(**(d.get("generation") or {}))
        d["ignored_generation_keys"] = tuple(d.get("ignored_generation_keys") or ())
        return cls(**d)


def _unsupported(name: str, where: str) -> str:
    return (f"{where}: architecture {name!r} is not supported; pagedkv runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 1-3.x, SmolLM2, Mistral, Qwen2, Qwen2.5)")


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def rope_scaling_from_hf(d: dict | None) -> RopeScaling | None:
    """`rope_scaling` (or transformers 5's `rope_parameters`) of a config.json as a RopeScaling.

    Raises ValueError for a kind other than default, linear and llama3.
    """
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


def architecture_of(c: dict, where: str) -> str:
    """The supported architecture a config.json dict names.

    Raises UnsupportedArchitectureError naming the architecture (or model_type) otherwise.
    """
    archs = c.get("architectures") or []
    mtype = c.get("model_type", "llama")
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    if archs:
        raise UnsupportedArchitectureError(_unsupported(archs[0], where))
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(_unsupported(f"model_type {mtype}", where))
    return SUPPORTED_MODEL_TYPES[mtype]


def sliding_window_of(c: dict, architecture: str) -> int | None:
    """Tokens each query attends to, or None for full causal attention.

    Mistral: `sliding_window` (null in v0.2 and later). Qwen2: only with `use_sliding_window`
    (off in every released Qwen2/Qwen2.5 model), and then only when it covers every layer
    (`max_window_layers` >= num_hidden_layers is full attention in transformers' Qwen2).
    """
    window = c.get("sliding_window")
    if window is None or architecture == "LlamaForCausalLM":
        return None
    if architecture == "Qwen2ForCausalLM":
        if not c.get("use_sliding_window", False):
            return None
        if int(c.get("max_window_layers", 0)) < int(c["num_hidden_layers"]):
            raise ValueError("a Qwen2 config with use_sliding_window on some layers only is not supported")
    return int(window)


def generation_settings(path: Path) -> tuple[GenerationDefaults, list[int], tuple[str, ...]]:
    """(defaults, eos ids, ignored keys) of `path`/generation_config.json (empty when absent).

    Raises ValueError when the file exists but is not a JSON object.
    """
    f = path / "generation_config.json"
    if not f.exists():
        return GenerationDefaults(), [], ()
    try:
        g = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not JSON ({e})") from e
    if not isinstance(g, dict):
        raise ValueError(f"{f}: expected a JSON object")
    values = {}
    for k, default in HONOURED_GENERATION_KEYS.items():
        v = g.get(k)
        if v is not None and v != default:
            values[k] = int(v) if k == "top_k" else float(v)
    ignored = tuple(sorted(k for k in g if k not in HONOURED_GENERATION_KEYS and k not in _GENERATION_METADATA_KEYS))
    return GenerationDefaults(**values), _ids(g.get("eos_token_id")), ignored


def read_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory (config.json, generation_config.json).

    Accepts both the legacy `rope_theta`/`rope_scaling` keys and transformers 5's
    `rope_parameters`. `tie_word_embeddings` is what config.json says (default False); a loader
    that finds no lm_head tensor ties the head itself.

    Raises:
        FileNotFoundError: no config.json.
        UnsupportedArchitectureError: an architecture other than SUPPORTED_ARCHITECTURES.
        ValueError: a config that does not describe a valid decoder.
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}/config.json not found")
    try:
        c = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}/config.json: not JSON ({e})") from e
    architecture = architecture_of(c, str(path))
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    heads = int(c["num_attention_heads"])
    generation, gen_eos, ignored = generation_settings(path)
    eos = list(dict.fromkeys(_ids(c.get("eos_token_id")) + gen_eos))
    return ModelConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_q_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling_from_hf(c.get("rope_scaling") or rope),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=_opt_int(c.get("bos_token_id")),
        eos_token_ids=tuple(eos),
        name=str(c.get("_name_or_path") or path.name),
        source=str(path),
        architecture=architecture,
        sliding_window=sliding_window_of(c, architecture),
        generation=generation,
        ignored_generation_keys=ignored,
    )
