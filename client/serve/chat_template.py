"""Which chat template renders a request, and with what: ``--chat-template``, the shipped tool
template, ``chat_template_kwargs``.

As vLLM (vllm/entrypoints/chat_utils.py ``load_chat_template``, ``resolve_chat_template_kwargs``):

- ``--chat-template VALUE`` is a file when VALUE opens as one; else, when it holds any of ``{``,
  ``}`` or a newline, the template itself (inline Jinja); else the name of a template shipped
  with pagedkv (client/serve/tools/, e.g. ``tool_chat_template_hermes.jinja``); else an error at
  start. It replaces the model's template for every chat prompt (chat, /tokenize, pins).
- Without it, a request with tools, tool results or assistant tool calls whose model template
  renders no tools (its source never mentions ``tools``, as SmolLM2's) is rendered by the shipped
  Hermes-style template (:data:`TOOL_TEMPLATE`); other requests by the model's own.
- ``chat_template_kwargs`` are extra variables of the template. A key that is one of the
  renderer's own arguments (``messages``, ``tools``, ``add_generation_prompt``, ``chat_template``,
  ``tokenize``, ...) is refused: vLLM refuses ``chat_template``/``tokenize`` outright and fails
  on ``messages``/``tools`` (given twice), and the request's own field wins over the others.

Templates render in transformers' sandboxed Jinja environment.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from importlib import resources

from client.tokenizer import encode_prompt

#: The shipped tool template (ChatML, Hermes' <tool_call> format).
TOOL_TEMPLATE = "tool_chat_template_hermes.jinja"
#: Where shipped templates are (a package of pagedkv).
_SHIPPED = "client.serve.tools"
_JINJA_CHARS = "{}\n"
#: Names the renderer sets itself; a ``chat_template_kwargs`` key among them is refused.
_OWN = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                  "continue_final_message", "tokenize"})


class TemplateKwargsError(ValueError):
    """A ``chat_template_kwargs`` that cannot be passed to the template (a 400 naming that field)."""


def shipped_template(name: str = TOOL_TEMPLATE) -> str:
    """The text of a template shipped with pagedkv.

    Raises:
        FileNotFoundError: no such template.
    """
    try:
        return resources.files(_SHIPPED).joinpath(name).read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise FileNotFoundError(name) from None


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template text (vLLM's rule: a file, else inline Jinja, else a shipped
    template's name), checked to compile; None for None.

    Raises:
        ValueError: a value that looks like a path but opens as neither a file nor a shipped
            template, or a template that does not compile (the message says which).
    """
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if any(c in value for c in _JINJA_CHARS):
            text = value
        else:
            try:
                text = shipped_template(value)
            except FileNotFoundError:
                raise ValueError(f"The supplied chat template ({value}) looks like a file path, but it failed to be "
                                 f"opened. Tried: {value} and pagedkv's shipped templates. Reason: {e}") from None
    _compile(text)
    return text


def _compile(text: str) -> None:
    """Raises ValueError when ``text`` is not a Jinja template (syntax checked in a sandbox)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None


def renders_tools(template: str | dict | None) -> bool:
    """Whether a model's chat template (its text, or transformers' dict of named templates) renders
    tool definitions: its source mentions ``tools`` at all."""
    if isinstance(template, dict):
        return any(renders_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def renderer_arguments() -> frozenset[str]:
    """The names a ``chat_template_kwargs`` key may not take: the renderer's own variables and
    every named parameter of transformers' ``apply_chat_template``."""
    try:
        from transformers import PreTrainedTokenizerBase

        params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
        named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    except (ImportError, ValueError, TypeError):
        named = set()
    return _OWN | named


def check_template_kwargs(kwargs: object) -> dict:
    """``chat_template_kwargs`` as the template will get them.

    Raises:
        TemplateKwargsError: not an object of string keys, or a key that is the renderer's own.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise TemplateKwargsError("chat_template_kwargs must be an object of template variables")
    clash = sorted(set(kwargs) & renderer_arguments())
    if clash:
        raise TemplateKwargsError(f"Found unexpected chat template kwargs from request: {clash}; these are set by "
                                  "the server (messages, tools and add_generation_prompt are the request's own "
                                  "fields)")
    return dict(kwargs)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """The server's rule for chat prompts: ``override`` is ``--chat-template``'s text (None: the
    model's own, or the shipped tool template where the model's renders no tools)."""

    override: str | None = None

    def choose(self, tokenizer, with_tools: bool) -> str | None:
        """The template text for a prompt (None: the tokenizer's own)."""
        if self.override is not None:
            return self.override
        if with_tools and not renders_tools(getattr(tokenizer, "chat_template", None)):
            return shipped_template()
        return None

    def encode(self, tokenizer, messages: list[dict], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        """Token ids of ``messages`` (client.serve.messages.chat_messages' form) rendered with
        ``tools`` and the checked ``template_kwargs``.

        Raises:
            TemplateKwargsError: a bad ``template_kwargs``.
            ValueError: messages the template cannot render (its own error, or a Jinja error).
        """
        kwargs = check_template_kwargs(template_kwargs)
        with_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        template = self.choose(tokenizer, with_tools)
        import jinja2

        try:
            return encode_prompt(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                 chat_template=template, tools=tools or None, template_kwargs=kwargs)
        except (jinja2.TemplateError, TypeError) as e:
            raise ValueError(f"the chat template cannot render these messages: {e}") from None
