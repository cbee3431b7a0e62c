"""The tokenizer and chat template of a model source ("smollm2", a .gguf file or an HF directory).

Building a fast tokenizer from GGUF metadata takes ~10 s on two cores, so the result is saved
once with `save_pretrained` under `$PAGEDKV_HOME/tokenizers/<name>-<size>-<mtime_ns>/` and
loaded from there afterwards (well under a second).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from compute_service.weights import pagedkv_home, smollm2_gguf_path


def _gguf_of(source: str) -> Path | None:
    if source == "smollm2":
        return smollm2_gguf_path()
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "tokenizer.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


def load_tokenizer(source: str, cache: bool = True):
    """A transformers tokenizer (with the chat template) for `source`.

    Raises FileNotFoundError when `source` is neither "smollm2", a .gguf file nor a directory.
    """
    from transformers import AutoTokenizer

    gguf = _gguf_of(source)
    if gguf is None:
        if not Path(source).is_dir():
            raise FileNotFoundError(
                f"model source {source!r} is neither 'smollm2', a .gguf file "
                "nor a Hugging Face directory"
            )
        return AutoTokenizer.from_pretrained(source)
    st = gguf.stat()
    cached = pagedkv_home() / "tokenizers" / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}"
    if cache and (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if cache:
        tmp = cached.parent / f"{cached.name}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    return tok
