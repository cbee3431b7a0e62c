"""A chat request's prompt and tool plan, as the routes need them (chat completions, /tokenize, pins).

Every route renders chat messages through :func:`render`, so a prompt tokenizes alike on each of
them (the server's :class:`~client.serve.chat_template.ChatTemplate`, the request's tools and
``chat_template_kwargs``); :func:`tool_plan` checks a chat request's tool fields
(:mod:`client.serve.tools.plan`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from client.serve.chat_template import TemplateKwargsError
from client.serve.messages import chat_messages
from client.serve.protocol import bad_request
from client.serve.tools.plan import ToolPlan, ToolRequestError, check_tools, plan_tools

if TYPE_CHECKING:
    from client.serve.app import Server


async def render(server: Server, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                 add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a request's ``messages`` (as the API sent them) rendered with ``tools``.

    Raises:
        APIError: 400 naming ``messages``, ``tools`` or ``chat_template_kwargs``.
    """
    msgs = chat_messages(messages)
    if tools is not None:
        try:
            check_tools(tools)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from None
    try:
        return await asyncio.to_thread(server.chat_template.encode, server.client.tokenizer, msgs, tools=tools,
                                       add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
    except TemplateKwargsError as e:
        raise bad_request(str(e), "chat_template_kwargs") from None
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def tool_plan(server: Server, req) -> ToolPlan | None:
    """What a chat request's ``tools``/``tool_choice``/``parallel_tool_calls`` make of its outputs.

    Raises:
        APIError: 400 naming ``tools`` or ``tool_choice``.
    """
    try:
        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, server.tool_settings)
    except ToolRequestError as e:
        raise bad_request(str(e), e.param) from None
