"""The KV-cache pool layout: shape, dtype, sizing, and where it comes from.

DESIGN.md, "The pool": one allocation per (device, layout), block-major
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` so that one
block is one contiguous byte range (the unit of a copy-on-write copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedkv import config
from pagedkv.config import DType
from pagedkv.model.config import read_hf_config
from pagedkv.model.gguf_config import read_gguf_config

#: Dimension names of the pool tensor, outermost first.
DIM_NAMES = ("num_blocks", "num_layers", "kv", "block_size", "num_kv_heads", "head_dim")
#: SmolLM2-135M-Instruct's attention layout (DESIGN.md, "The real model").
SMOLLM2_LAYOUT = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Shape and dtype of a paged KV-cache pool."""

    #: Transformer layers with a KV cache.
    num_layers: int
    #: Key/value heads per layer.
    num_kv_heads: int
    #: Elements per head.
    head_dim: int
    #: Tokens per block.
    block_size: int
    #: The element type (:data:`pagedkv.config.DTYPES`; fp8_e4m3 has static per-head scales:
    #: :mod:`pagedkv.runtime.kv_scales`). A wire name given here is turned into its :class:`~pagedkv.config.DType`.
    dtype: DType
    #: Blocks in the pool.
    num_blocks: int

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024 tokens, got {self.block_size}")
        object.__setattr__(self, "dtype", config.dtype(self.dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        """Pool tensor shape in :data:`DIM_NAMES` order."""
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def strides(self) -> tuple[int, ...]:
        """Contiguous (row-major) strides in elements."""
        out, acc = [], 1
        for dim in reversed(self.shape):
            out.append(acc)
            acc *= dim
        return tuple(reversed(out))

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: every layer, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_blocks * self.block_nbytes


def gguf_attention_layout(path: Path) -> dict[str, int]:
    """``num_layers``, ``num_kv_heads``, ``head_dim`` of a llama-architecture GGUF file, from its
    metadata alone (`pagedkv.model.gguf_config.read_gguf_config`: no tensor is read).

    Raises:
        ValueError: not a GGUF file, or not the llama architecture.
    """
    c = read_gguf_config(path)
    return {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}


def model_attention_layout(model: str) -> dict[str, int]:
    """``num_layers``, ``num_kv_heads``, ``head_dim`` of ``"smollm2"``, a Hugging Face directory or
    a GGUF file (or a directory holding one GGUF and no config.json), as the worker reads them.

    Read from config.json alone (`pagedkv.model.config.read_hf_config`) or the GGUF's metadata,
    no weights.

    Raises:
        ValueError: no readable config.json or GGUF, or an unsupported architecture.
    """
    if model == "smollm2":
        return dict(SMOLLM2_LAYOUT)
    path = Path(model)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
    if path.is_file() and path.suffix == ".gguf":
        return gguf_attention_layout(path)
    if len(ggufs) == 1:
        return gguf_attention_layout(ggufs[0])
    try:
        c = read_hf_config(model)
    except FileNotFoundError as e:
        raise ValueError(
            f"--model {model!r}: expected 'smollm2' or a Hugging Face directory with config.json ({e})"
        ) from e
    return {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}


def make_layout(
    model: str,
    *,
    block_size: int,
    dtype: DType | str,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
) -> PoolLayout:
    """Layout for ``model`` sized by ``num_blocks`` or by ``kv_cache_memory`` bytes (exactly one).

    Raises:
        ValueError: both or neither size given, or the memory holds no block.
    """
    if (num_blocks is None) == (kv_cache_memory is None):
        raise ValueError("give exactly one of --num-blocks or --kv-cache-memory")
    attn = model_attention_layout(model)
    if num_blocks is None:
        probe = PoolLayout(**attn, block_size=block_size, dtype=dtype, num_blocks=1)
        num_blocks = kv_cache_memory // probe.block_nbytes
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {kv_cache_memory} bytes holds no block of {probe.block_nbytes} bytes")
    return PoolLayout(**attn, block_size=block_size, dtype=dtype, num_blocks=num_blocks)
