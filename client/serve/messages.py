"""Chat messages of a request, as the chat template takes them.

The OpenAI API's message shapes (and vLLM's reading of them, vllm/entrypoints/chat_utils.py):

- ``system``/``developer``/``user``/``assistant``: ``content`` a string, a list of text parts
  ``{"type": "text", "text": ...}`` (joined with newlines, as vLLM does) or null (""); a
  ``developer`` message is the template's ``system``.
- ``assistant`` may carry ``tool_calls`` ``[{"id", "type": "function", "function": {"name",
  "arguments"}}]`` (then ``content`` may be null); each call's ``arguments`` (JSON text) reach
  the template as the object they encode, as vLLM passes them (Hugging Face templates write
  them with ``tojson``), or as the text itself when it is not a JSON object.
- ``tool``: a tool's result, ``content`` and the ``tool_call_id`` it answers.
- Fields the ``openai`` package writes when a reply's message is sent back (``refusal``,
  ``annotations``, a null ``audio`` or ``function_call``) are accepted and dropped; a message's
  ``name`` is kept.
"""

from __future__ import annotations

import json
from typing import Any

from client.serve.protocol import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role, text content, and for the tool roles their fields.

    Raises:
        APIError: 400 naming the message for an unknown role, a content part that is not text,
            or malformed tool calls.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with a role and content", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r:.40}", "messages")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), i)}
        for name in ("audio", "function_call"):
            if m.get(name) is not None:
                raise bad_request(f"messages[{i}].{name} is not supported: send text content"
                                  f"{' and tool_calls' if name == 'function_call' else ''}", "messages")
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list, on an assistant message", "messages")
            if calls:
                msg["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad_request(f"messages[{i}].tool_call_id must be a string", "messages")
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def _text(content: Any, i: int) -> str:
    """A message's content as one string (null: "")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}; "
                              "this model reads text only", "messages")
        parts.append(part["text"])
    return "\n".join(parts)


def _tool_call(call: Any, where: str) -> dict:
    """One assistant tool call, its arguments decoded when they are a JSON object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or call.get("type", "function") != "function" or \
            not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                          '"arguments": ...}}}}', "messages")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise bad_request(f"{where}.id must be a string", "messages")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            decoded = json.loads(args)
        except (ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, dict):
            args = decoded
    elif not isinstance(args, dict):
        raise bad_request(f"{where}.function.arguments must be JSON text", "messages")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}
