"""The client's prompts as token ids, with the tokenizer of the model the worker names.

DESIGN.md, "Defaults and discovery": the client tokenizes itself. ``GetModelInfo``
gives the model source, its resolved revision and the worker's weights path
(:func:`tokenizer_source`: where that tokenizer is on this host); loading it is
:func:`pagedkv.model.tokenizer.load_tokenizer`, which the worker shares.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.model.source import is_repo_id, resolve_model

Messages = list[dict]


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


def encode_prompt(tokenizer, prompt: str | Messages | list[int], *, add_generation_prompt: bool = True,
                  chat_template: str | None = None, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a raw string, of chat messages through the model's chat template, or the
    given token ids themselves (checked against the vocabulary).

    Chat messages get the generation prompt appended (``<|im_start|>assistant``; not with
    ``add_generation_prompt=False``, as vLLM's /tokenize allows); the
    template adds its default system prompt when none is given, as transformers does.
    ``chat_template`` replaces the model's template (None: the model's), ``tools`` (OpenAI's
    ``{"type": "function", "function": {...}}`` entries) and ``template_kwargs`` are passed to it
    (client.serve.chat_template decides them).

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
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        chat_template=chat_template, tools=tools, **(template_kwargs or {}))
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)
