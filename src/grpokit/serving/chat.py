"""Chat requests to token ids and sampled tokens back to an OpenAI message: the messages rendered with the tokenizer's
chat template and its generation prompt (the request's ``tools`` listed by the template), tool calls read in the
template's own format (:mod:`grpokit.rollout.tool_templates`). No model family is named here."""

from __future__ import annotations

import json
import secrets
from typing import Any

from grpokit.rollout.tool_templates import TemplateProtocol, template_protocol
from grpokit.rollout.tools import parse_tool_call


class RequestError(ValueError):
    """A request the server refuses, as OpenAI's API refuses it: ``status``, ``code`` and the ``param`` at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def _text(content: Any) -> str:
    """A message's content as text: a string as is, a list of parts their text parts joined (OpenAI's shape)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise RequestError(f"message content of type {part.get('type')!r} is not supported: text only",
                               param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: text content, and tool calls' arguments as an object (OpenAI sends them
    as JSON text; templates write them with ``tojson``)."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = _text(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # the template gets the text as sent
        calls.append({**call, "function": function})
    if calls:
        out["tool_calls"] = calls
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt text of a chat request: its messages through the chat template, with the generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("the served model's tokenizer has no chat template: use /v1/completions with a prompt, "
                           "or serve a model whose tokenizer has one", param="messages")
    if not messages:
        raise RequestError("messages must hold at least one message", param="messages")
    try:
        return tokenizer.apply_chat_template([_for_template(m) for m in messages], tools=tools or None,
                                             tokenize=False, add_generation_prompt=True)
    except Exception as error:  # the template's own raise_exception(), jinja errors
        raise RequestError(f"the chat template could not render these messages: {error}", param="messages") from error


class ToolCallReader:
    """Tool calls in the served template's format, read from sampled text; the template's format is read once."""

    def __init__(self, tokenizer: Any):
        self.protocol: TemplateProtocol | None = template_protocol(tokenizer) \
            if getattr(tokenizer, "chat_template", None) is not None else None

    def check(self) -> None:
        """Refuse a request with ``tools`` when the template has no tool-call format that grpokit reads."""
        if self.protocol is None:
            raise RequestError("the served model's chat template has no tool-call format grpokit reads (a JSON call "
                               "between text markers, as Hermes / Qwen templates write it; "
                               "grpokit.rollout.tool_templates): send the request without tools", param="tools")

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)``: the text before the first well-formed call, and the calls in OpenAI's shape
        (arguments as JSON text). Text with no well-formed call is all content."""
        assert self.protocol is not None
        open_, close = self.protocol.open, self.protocol.close
        calls, first, at = [], None, 0
        while (end := text.find(close, at)) >= 0:
            end += len(close)
            start = text.rfind(open_, at, end - len(close))
            call = parse_tool_call(text[at:end], open_, close)
            if call is not None and call.error is None and start >= 0:
                first = start if first is None else first
                calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                              "function": {"name": call.name, "arguments": json.dumps(call.arguments)}})
            at = end
        if not calls:
            return text, []
        content = text[:first].strip()
        return content or None, calls
