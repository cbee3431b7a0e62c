"""How many weights a model has, and its shape, read from its files without loading a weight.

The memory service sizes a GPU pool by what the workers' weights will take
(:mod:`pagedkv.config.gpu_sizing`): the element count of every tensor the worker loads, times the
bytes of the dtype it runs them in (a float32 or quantized checkpoint runs in bfloat16 on a GPU, as
``--dtype auto`` decides: :func:`pagedkv.config.worker_dtype`). The count comes from, in order:

- a safetensors checkpoint's headers (the files ``model.safetensors.index.json`` names, else every
  ``*.safetensors`` but Mistral's ``consolidated*``; 8 bytes of header length, then a JSON header);
- a GGUF file's tensor infos (``gguf.GGUFReader``: the file is memory-mapped, no tensor is read);
- the config alone, as a parameter count (:func:`parameter_count`), for a Hugging Face repo whose
  weights the memory service did not fetch (it resolves the config only).

An old checkpoint's ``rotary_emb.inv_freq`` buffers and the LM head of a tied model are not loaded
by the worker, so they are not counted. No torch.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedkv.model.config import ModelConfig, read_hf_config
from pagedkv.model.gguf_config import gguf_model_config, open_gguf
from pagedkv.runtime.paths import smollm2_gguf_path

#: The longest safetensors header read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: Tensors a checkpoint may hold that the worker never loads (suffixes of their names).
_NOT_LOADED = ("rotary_emb.inv_freq",)
#: The LM head's names: Hugging Face's and llama.cpp's.
_LM_HEAD = ("lm_head.weight", "output.weight")


@dataclass(frozen=True, slots=True)
class WeightCount:
    """A model's weight elements and where they were counted."""

    #: Elements of every tensor a worker loads.
    elements: int
    #: "safetensors", "gguf" or "config".
    source: str

    def nbytes(self, itemsize: int) -> int:
        """Bytes at ``itemsize`` bytes per element (the dtype the worker runs)."""
        return self.elements * itemsize


def model_file(source: str | Path) -> Path:
    """The GGUF file of ``source`` ("smollm2", a .gguf, a directory holding one GGUF and no
    config.json), else the directory itself.

    Raises:
        FileNotFoundError: smollm2's wheel missing.
    """
    if str(source) == "smollm2":
        return smollm2_gguf_path()
    path = Path(source)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


def read_model_config(source: str | Path) -> ModelConfig:
    """The ModelConfig of ``source`` (see :func:`model_file`) from config.json or GGUF metadata.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: an unreadable or unsupported config.
    """
    path = model_file(source)
    return _gguf(path)[0] if path.suffix == ".gguf" and path.is_file() else read_hf_config(path)


def _loaded(name: str, tied: bool) -> bool:
    return not name.endswith(_NOT_LOADED) and not (tied and name in _LM_HEAD)


def safetensors_elements(path: str | Path, tied: bool = False) -> int:
    """Elements of every tensor in one safetensors file, from its header (no data read); ``tied``:
    without the LM head.

    Raises:
        ValueError: not a safetensors file (a header that does not parse), naming it.
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (header length {size})")
        try:
            header = json.loads(f.read(size))
            return sum(math.prod(t["shape"]) for name, t in header.items()
                       if name != "__metadata__" and _loaded(name, tied))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a safetensors header ({e!r})") from None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint files of a Hugging Face directory: those ``model.safetensors.index.json``
    names, else every ``*.safetensors`` but ``consolidated*`` (empty: none here).

    Raises:
        ValueError: an index that is not JSON with a ``weight_map``.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
        return [path / n for n in names if (path / n).is_file() and (path / n).parent == path]
    return sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))


def gguf_elements(path: str | Path) -> int:
    """Elements of every tensor a GGUF file lists (its tensor infos; no tensor read).

    Raises:
        ValueError: not a readable GGUF file.
    """
    return _gguf(Path(path))[1]


def _gguf(path: Path) -> tuple[ModelConfig, int]:
    """(config, weight elements) of a GGUF file from one parse (seconds for a real vocabulary),
    remembered per (path, size, modification time)."""
    st = path.stat()
    return _gguf_cached(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_cached(path: str, size: int, mtime_ns: int) -> tuple[ModelConfig, int]:
    reader = open_gguf(path)
    return gguf_model_config(reader, path), sum(int(t.n_elements) for t in reader.tensors if _loaded(t.name, False))


def parameter_count(c: ModelConfig) -> int:
    """Weights of a Llama-family decoder of config ``c`` (our tensor list, compute_service.weights.source):
    embedding V x D; per layer two norms, q/k/v/o and gate/up/down projections (and Qwen2's q/k/v
    biases); the final norm; the LM head unless tied. Llama's optional attention and MLP biases,
    which the config alone does not show, are left out (under 0.1% of a model's weights)."""
    d, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * i
    if c.architecture == "Qwen2ForCausalLM":
        layer += q + 2 * kv
    return v * d + c.num_layers * layer + d + (0 if c.tie_word_embeddings else v * d)


def count_weights(source: str | Path, config: ModelConfig | None = None) -> WeightCount:
    """The weight elements of ``source`` ("smollm2", a .gguf file, a Hugging Face directory): from its
    safetensors headers or GGUF tensor infos, else (a directory with config.json only) from its
    ``config`` (default: read here) by :func:`parameter_count`.

    Raises:
        FileNotFoundError: no config.json and no checkpoint.
        ValueError: a checkpoint or config that does not read.
    """
    path = model_file(source)
    if path.suffix == ".gguf" and path.is_file():
        return WeightCount(gguf_elements(path), "gguf")
    config = config or read_hf_config(path)
    files = safetensors_files(path)
    if files:
        return WeightCount(sum(safetensors_elements(f, config.tie_word_embeddings) for f in files), "safetensors")
    return WeightCount(parameter_count(config), "config")


__all__ = ["WeightCount", "count_weights", "gguf_elements", "model_file", "parameter_count", "read_model_config",
           "safetensors_elements", "safetensors_files"]
