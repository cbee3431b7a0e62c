"""A llama-architecture GGUF file's ModelConfig from its metadata alone (no tensor data read).

Shared by the worker (`compute_service.weights.gguf`, which then dequantizes the tensors) and the memory
service (which sizes its pool from the layout). Keys as llama.cpp's `convert_hf_to_gguf.py` writes
them (`llama.*`, `tokenizer.ggml.*`). No torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pagedkv.model.config import ModelConfig, RopeScaling

#: llama.cpp's ``general.file_type`` (LlamaFileType) of unquantized files: ALL_F32, MOSTLY_F16, MOSTLY_BF16.
UNQUANTIZED_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def gguf_checkpoint_dtype(file_type: int | None) -> str | None:
    """The dtype of the model a GGUF was converted from, by its ``general.file_type``: an
    unquantized file's own (:data:`UNQUANTIZED_FILE_TYPES`); a quantized one's source is written
    nowhere in the file, and llama.cpp quantizes 16-bit exports of the models pagedkv serves (all
    published in bfloat16, SmolLM2 among them): "bfloat16". None: no ``general.file_type``."""
    if file_type is None:
        return None
    return UNQUANTIZED_FILE_TYPES.get(int(file_type), "bfloat16")


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over ``path`` (memory-mapped; it parses every metadata field).

    Raises:
        ValueError: not a readable GGUF file (the file named).
    """
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def gguf_model_config(reader, path: str | Path) -> ModelConfig:
    """The ModelConfig of an open GGUF (`open_gguf`). The head is tied when there is no
    `output.weight` tensor.

    Raises:
        ValueError: an architecture other than llama, an unsupported RoPE scaling, or a missing key.
    """
    path = Path(path)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    def need(key: str):
        v = field(key)
        if v is None:
            raise ValueError(f"{path}: GGUF metadata {key} missing")
        return v

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    num_q_heads = int(need("llama.attention.head_count"))
    hidden = int(need("llama.embedding_length"))
    vocab = field("llama.vocab_size")
    if vocab is None:
        vocab = len(need("tokenizer.ggml.tokens"))
    scaling = None
    kind = field("llama.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ValueError(f"{path}: GGUF RoPE scaling {kind!r} not supported")
        scaling = RopeScaling("linear", float(need("llama.rope.scaling.factor")))
    bos, eos = field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("llama.feed_forward_length")),
        num_layers=int(need("llama.block_count")),
        num_q_heads=num_q_heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", num_q_heads)),
        head_dim=int(field("llama.attention.key_length", hidden // num_q_heads)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field("llama.context_length", 2048)),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(field("general.name", path.stem)),
        source=str(path),
        dtype=gguf_checkpoint_dtype(field("general.file_type")),
    )


def read_gguf_config(path: str | Path) -> ModelConfig:
    """`gguf_model_config` of the file at ``path``, remembered per (path, size, modification time):
    the reader parses every metadata field, the vocabulary included, which takes seconds.

    Raises the errors of `open_gguf` and `gguf_model_config`.
    """
    st = Path(path).stat()
    return _cached(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _cached(path: str, size: int, mtime_ns: int) -> ModelConfig:
    return gguf_model_config(open_gguf(path), path)
