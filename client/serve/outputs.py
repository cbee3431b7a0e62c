"""OpenAI response bodies from the engine's cumulative :class:`~client.api.RequestOutput`.

One :class:`Choices` per HTTP request renders both routes' shapes: whole replies
(``chat.completion``, ``text_completion``) and stream chunks (``chat.completion.chunk``), where
each chunk carries only what is new since the last one for that choice (text, token ids,
logprobs). Choice ``i`` of prompt ``p`` has index ``p * n + i``, as in the OpenAI API.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from client.api import CompletionOutput, RequestOutput
from client.serve.tools.plan import ChoiceStream, ToolPlan


@dataclass(slots=True)
class _Sent:
    """How much of one choice a stream has sent."""

    text: int = 0
    tokens: int = 0
    #: Characters of the logprob token names sent (completions' ``text_offset`` continues from here).
    offset: int = 0
    started: bool = False
    finished: bool = False


@dataclass
class Choices:
    """Renders the outputs of one HTTP request's prompts.

    Args:
        request_id: the response's ``id``.
        model: the served model name.
        chat: chat completions (else text completions).
        n: choices per prompt.
        tokenizer: decodes single tokens for logprobs.
        logprobs: top alternatives per token (chat ``top_logprobs``); None: no logprobs.
        token_names_as_ids: render logprob tokens as ``token_id:ID`` (vLLM's flag).
        return_token_ids: add ``token_ids`` to each choice and ``prompt_token_ids`` to the reply.
        tools: a chat request's tool plan: each message's text is split into content and
            ``tool_calls`` (streams: ``delta.tool_calls`` pieces), its finish reason may be "tool_calls".
        final_only: stream a prompt's choices only once it has finished (beam search: beams are
            ranked, and become choices, only when the search ends).
    """

    request_id: str
    model: str
    chat: bool
    n: int
    tokenizer: object
    logprobs: int | None = None
    token_names_as_ids: bool = False
    return_token_ids: bool = False
    tools: ToolPlan | None = None
    final_only: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _sent: dict[int, _Sent] = field(default_factory=dict)
    #: Each streamed choice's tool parse (with ``tools``).
    _tool_streams: dict[int, ChoiceStream] = field(default_factory=dict)

    # ------------------------------------------------------------- whole reply
    def reply(self, outputs: list[RequestOutput]) -> dict:
        """The non-streamed body: every choice of every prompt, and ``usage``."""
        choices = []
        for p, out in enumerate(outputs):
            for o in out.outputs:
                c = {"index": p * self.n + o.index, "logprobs": self._logprobs(o, 0, len(o.token_ids)),
                     "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if self.chat and self.tools is not None:
                    c["message"], called = self.tools.message(o.text)
                    c["finish_reason"] = self.tools.finish_reason(o.finish_reason, called)
                elif self.chat:
                    c["message"] = {"role": "assistant", "content": o.text}
                else:
                    c["text"] = o.text
                if self.return_token_ids:
                    c["token_ids"] = list(o.token_ids)
                choices.append(c)
        body = {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage(outputs)}
        if self.return_token_ids:
            body["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outputs] if not self.chat else \
                list(outputs[0].prompt_token_ids)
        return body

    # ------------------------------------------------------------------ stream
    def chunks(self, p: int, out: RequestOutput) -> list[dict]:
        """Stream chunks for what is new in prompt ``p``'s output since the last call."""
        chunks = []
        if self.final_only and not out.finished:
            return chunks
        for o in out.outputs:
            index = p * self.n + o.index
            sent = self._sent.setdefault(index, _Sent())
            if sent.finished:
                continue
            text = o.text[sent.text:]
            new_tokens = o.token_ids[sent.tokens:]
            finish = o.finish_reason
            if not text and not new_tokens and finish is None and sent.started:
                continue
            c: dict = {"index": index, "logprobs": self._logprobs(o, sent.tokens, len(o.token_ids), sent.offset),
                       "finish_reason": finish}
            if c["logprobs"] is not None and not self.chat and c["logprobs"]["tokens"]:
                sent.offset = c["logprobs"]["text_offset"][-1] + len(c["logprobs"]["tokens"][-1])
            if finish is not None:
                c["stop_reason"] = o.stop_reason
            if self.chat:
                if self.tools is not None:
                    delta = self._tool_delta(index, text, c, sent.started)
                else:
                    delta = {"content": text} if text or not sent.started else {}
                if not sent.started:
                    delta = {"role": "assistant", **delta}
                c["delta"] = delta
            else:
                c["text"] = text
            if self.return_token_ids:
                c["token_ids"] = list(new_tokens)
            sent.started, sent.text, sent.tokens = True, len(o.text), len(o.token_ids)
            sent.finished = finish is not None
            chunks.append(self._chunk([c]))
        return chunks

    def _tool_delta(self, index: int, text: str, choice: dict, started: bool) -> dict:
        """Choice ``index``'s delta for its new ``text`` through the tool parse; at its end (a
        ``finish_reason`` in ``choice``), what the parse kept back and the tool-call finish reason."""
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = self.tools.stream()
        d = stream.feed(text)
        if choice["finish_reason"] is not None:
            d.extend(stream.finish())
            choice["finish_reason"] = self.tools.finish_reason(choice["finish_reason"], stream.called)
        delta: dict = {"content": d.content} if d.content or not started else {}
        if d.tool_calls:
            delta["tool_calls"] = [t.to_openai() for t in d.tool_calls]
        return delta

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
        return self._chunk([], usage=usage(outputs))

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, **extra}

    # ---------------------------------------------------------------- logprobs
    def _token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.token_names_as_ids else self.tokenizer.decode([token_id])

    def _logprobs(self, o: CompletionOutput, start: int, end: int, offset: int = 0) -> dict | None:
        """Logprobs of tokens ``start:end`` in the route's shape (None when not asked); completions'
        ``text_offset`` starts at ``offset``."""
        if self.logprobs is None or o.logprobs is None:
            return None
        chosen = o.token_ids[start:end]
        lps = (o.token_logprobs or [])[start:end]
        tops = o.logprobs[start:end]
        if self.chat:
            content = []
            for tok, lp, top in zip(chosen, lps, tops):
                name = self._token(tok)
                alts = sorted(top.items(), key=lambda kv: -kv[1])[:self.logprobs]
                content.append({"token": name, "logprob": lp, "bytes": list(name.encode()),
                                "top_logprobs": [{"token": (t := self._token(i)), "logprob": v,
                                                  "bytes": list(t.encode())}
                                                 for i, v in alts]})
            return {"content": content}
        names = [self._token(t) for t in chosen]
        offsets, at = [], offset
        for name in names:
            offsets.append(at)
            at += len(name)
        return {"tokens": names, "token_logprobs": lps,
                "top_logprobs": [{self._token(i): v for i,
                                  v in sorted(top.items(), key=lambda kv: -kv[1])[:self.logprobs]}
                                 for top in tops],
                "text_offset": offsets}


def usage(outputs: list[RequestOutput]) -> dict:
    """Prompt tokens (each prompt once), completion tokens (every choice), their sum, and
    ``prompt_tokens_details.cached_tokens``: the prompt tokens served from the prefix cache (each
    prompt's figure at its first allocation, whole blocks, never its last token; 0 for a prompt
    that never got blocks)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
