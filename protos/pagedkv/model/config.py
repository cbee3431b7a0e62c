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
import math
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.model.config_json import MAX_TOKEN_ID, ConfigFile, is_integer, is_number

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
    #: The dtype the checkpoint was saved in ("float32", "float16" or "bfloat16"; config.json's
    #: ``dtype``/``torch_dtype``, a GGUF's ``general.file_type``); None: not stated. ``--dtype auto``
    #: starts from it (pagedkv.config.default_dtype).
    dtype: str | None = None

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


def rope_scaling_from_hf(d: dict | None, where: str = "config.json") -> RopeScaling | None:
    """`rope_scaling` (or transformers 5's `rope_parameters`) of a config.json as a RopeScaling.

    Raises ValueError for a kind other than default, linear and llama3, or a missing or mistyped
    field (named, with `where`).
    """
    if not d:
        return None
    r = ConfigFile(d, f"{where} rope_scaling")
    kind = r.str("rope_type", r.str("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", r.float("factor", positive=True))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            r.float("factor", positive=True),
            r.float("low_freq_factor"),
            r.float("high_freq_factor"),
            r.int("original_max_position_embeddings"),
        )
    raise ValueError(f"{where}: RoPE scaling {kind!r} not supported (only linear and llama3)")


def architecture_of(c: ConfigFile) -> str:
    """The supported architecture a config.json names (`architectures`, else `model_type`).

    Raises UnsupportedArchitectureError naming the architecture (or model_type) otherwise, and
    ValueError when `architectures` is not a list of names.
    """
    archs = c.names("architectures")
    mtype = c.str("model_type", "llama")
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    if archs:
        raise UnsupportedArchitectureError(_unsupported(archs[0], c.path))
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(_unsupported(f"model_type {mtype}", c.path))
    return SUPPORTED_MODEL_TYPES[mtype]


def sliding_window_of(c: ConfigFile, architecture: str) -> int | None:
    """Tokens each query attends to, or None for full causal attention.

    Mistral: `sliding_window` (null in v0.2 and later). Qwen2: only with `use_sliding_window`
    (off in every released Qwen2/Qwen2.5 model), and then only when it covers every layer
    (`max_window_layers` >= num_hidden_layers is full attention in transformers' Qwen2).
    """
    if c.data.get("sliding_window") is None or architecture == "LlamaForCausalLM":
        return None
    window = c.int("sliding_window")
    if architecture == "Qwen2ForCausalLM":
        if not c.bool("use_sliding_window", False):
            return None
        if c.int("max_window_layers", 0, minimum=0) < c.int("num_hidden_layers"):
            raise ValueError(f"{c.path}: a Qwen2 config with use_sliding_window on some layers only is not supported")
    return window


def _generation_value(key: str, v) -> float | int | None:
    """A honoured generation_config.json value as a request default, or None when it is not one a
    request could carry (not a finite number; top_k not an int32)."""
    if not is_number(v) or not math.isfinite(v):
        return None
    if key == "top_k":
        return int(v) if is_integer(v) and abs(v) <= MAX_TOKEN_ID else None
    return float(v)


def generation_settings(path: Path) -> tuple[GenerationDefaults, list[int], tuple[str, ...]]:
    """(defaults, eos ids, ignored keys) of `path`/generation_config.json (empty when absent).

    A honoured key whose value no request could carry (a string, NaN, a top_k past int32) is
    listed among the ignored keys instead (its default does not apply).

    Raises ValueError when the file exists but is not a JSON object, or its eos_token_id is not
    a token id or a list of them.
    """
    f = path / "generation_config.json"
    if not f.exists():
        return GenerationDefaults(), [], ()
    try:
        g = ConfigFile(json.loads(f.read_text()), f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not JSON ({e})") from e
    values, ignored = {}, []
    for k, default in HONOURED_GENERATION_KEYS.items():
        v = g.data.get(k)
        if v is None or v == default:
            continue
        value = _generation_value(k, v)
        if value is None:
            ignored.append(k)
        else:
            values[k] = value
    ignored += [k for k in g.data if k not in HONOURED_GENERATION_KEYS and k not in _GENERATION_METADATA_KEYS]
    return GenerationDefaults(**values), g.token_ids("eos_token_id"), tuple(sorted(ignored))


def read_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory (config.json, generation_config.json).

    Accepts both the legacy `rope_theta`/`rope_scaling` keys and transformers 5's
    `rope_parameters`. `tie_word_embeddings` is what config.json says (default False); a loader
    that finds no lm_head tensor ties the head itself. Every value is type-checked
    (`pagedkv.model.config_json`): nothing is coerced.

    Raises:
        FileNotFoundError: no config.json.
        UnsupportedArchitectureError: an architecture other than SUPPORTED_ARCHITECTURES.
        ValueError: a config that does not describe a valid decoder (the file and key named).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found")
    try:
        c = ConfigFile(json.loads((path / "config.json").read_text()), path / "config.json")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}/config.json: not JSON ({e})") from e
    architecture = architecture_of(c)
    rope = c.object("rope_parameters") or {}
    theta = ConfigFile(rope,
                       f"{c.path} rope_parameters").float("rope_theta", c.float("rope_theta", 10000.0, positive=True),
                                                               positive=True)
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    generation, gen_eos, ignored = generation_settings(path)
    eos = list(dict.fromkeys(c.token_ids("eos_token_id") + gen_eos))
    bos = c.token_ids("bos_token_id")
    return ModelConfig(
        vocab_size=c.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.int("intermediate_size"),
        num_layers=c.int("num_hidden_layers"),
        num_q_heads=heads,
        num_kv_heads=c.int("num_key_value_heads", heads),
        head_dim=c.int("head_dim", hidden // heads),
        rms_norm_eps=c.float("rms_norm_eps", 1e-6, positive=True),
        rope_theta=theta,
        rope_scaling=rope_scaling_from_hf(c.object("rope_scaling") or rope, c.path),
        max_position_embeddings=c.int("max_position_embeddings", 2048),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        bos_token_id=bos[0] if len(bos) == 1 else None,
        eos_token_ids=tuple(eos),
        name=c.str("_name_or_path", "") or path.name,
        source=str(path),
        architecture=architecture,
        sliding_window=sliding_window_of(c, architecture),
        generation=generation,
        ignored_generation_keys=ignored,
        dtype=checkpoint_dtype_name(c.str("dtype", "") or c.str("torch_dtype", "")),
    )


#: The checkpoint dtypes ModelConfig.dtype names (what config.json's ``torch_dtype`` says).
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")


def checkpoint_dtype_name(text: str) -> str | None:
    """``text`` (a config.json ``dtype``, e.g. "bfloat16" or "torch.bfloat16") when it names one of
    :data:`CHECKPOINT_DTYPES`, else None (unstated, or a dtype no model computes in)."""
    name = text.removeprefix("torch.")
    return name if name in CHECKPOINT_DTYPES else None
