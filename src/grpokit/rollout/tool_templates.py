"""Tool calls in a chat template's own format, where the tokenizer's template knows tools; otherwise the rollout
keeps the plain-text protocol (:class:`grpokit.rollout.tools.PlainProtocol`).

A model tuned for tool use has learnt its template's format, so the prompt lists the tools the way the template
renders them (:func:`grpokit.data.render_prompt` with ``tools``) and the rollout reads and answers calls in
that format (:class:`TemplateProtocol`). Nothing about a model family is written here: the markers are read
from the template itself, by rendering probe conversations — a user message, an assistant message with one tool
call, the tool's message, the next generation prompt — and cutting the renders at the probe's known texts:

* the call is the JSON object in the assistant's turn holding the probe's name and arguments; the text on its line
  before it is the call's open marker, the text after it up to the end of the assistant's turn (as a plain
  assistant message ends it) is the close marker;
* everything from the close marker to the end of the render (the turn markers, the tool response wrapping, the
  next assistant generation prompt), cut at the probe's result, is the markup inserted around a tool's result.

This handles templates that write a call as one JSON object (``name`` and ``arguments`` or ``parameters``;
arguments as an object or as JSON text) between text markers that decode as text, and give the result back in
one message: Hermes / Qwen2.5 / Qwen3 (``<tool_call>\\n{...}\\n</tool_call>``) and their like. Templates whose
calls have no close marker before the end of the turn (Llama 3.1's bare JSON), whose call markers are special
tokens (decoding drops them, so the rollout could not see them), that do not write the call as JSON (Mistral's
lists, DeepSeek's and Kimi's function sections, XML parameters), or that escape the tool's text (so the inserted
text would not be what the template renders) get no :class:`TemplateProtocol`: :func:`template_protocol` answers
None and the run uses the plain-text protocol. One call is answered per assistant turn: the result's markup ends
the model's turn and opens its next one, as the template renders a call followed by its tool message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from grpokit.rollout.tools import ToolBox, ToolCall, parse_tool_call

__all__ = ["TemplateProtocol", "build_toolbox", "supports_tools", "template_protocol"]

# Probe texts: unusual enough never to be part of a template, ASCII so any tokenizer holds them.
PROBE_NAME = "grpokit_probe_tool"
PROBE_DESCRIPTION = "grpokit probe tool description"
PROBE_ARGUMENTS = {"probe_argument": "grpokit probe value"}
PROBE_USER = "grpokit probe question"
PROBE_CONTENT = "grpokit probe reply"
PROBE_RESULT = "grpokit probe result"
PROBE_CHECK = 'grpokit "probe"\nresult {2}'  # a second result: quotes, a newline, braces must come back verbatim
PROBE_ID = "call00001"  # 9 alphanumerics, the id length some templates insist on
PROBE_SCHEMA = {"type": "function", "function": {
    "name": PROBE_NAME, "description": PROBE_DESCRIPTION,
    "parameters": {"type": "object", "required": ["probe_argument"],
                   "properties": {"probe_argument": {"type": "string", "description": "any text"}}}}}
SEARCH_BACK = 512  # characters before the probe's name where its call's JSON object may start


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str | None:
    """The template's text for ``messages`` (with the probe tool), or None when it cannot render them: a template
    that raises on a probe (a role it refuses, an id format) does not support tools the way this module reads."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        text = tokenizer.apply_chat_template(messages, tools=[PROBE_SCHEMA], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception:  # jinja errors, raise_exception() in templates, TypeErrors of odd templates
        return None
    return text if isinstance(text, str) else None


def _conversation(arguments: Any, result: str) -> list[dict[str, Any]]:
    """The probe: a question, a reply with one call, the tool's message."""
    call = {"type": "function", "id": PROBE_ID, "function": {"name": PROBE_NAME, "arguments": arguments}}
    return [{"role": "user", "content": PROBE_USER},
            {"role": "assistant", "content": PROBE_CONTENT, "tool_calls": [call]},
            {"role": "tool", "name": PROBE_NAME, "tool_call_id": PROBE_ID, "content": result}]


def _probe_renders(tokenizer: Any, result: str = PROBE_RESULT) -> list[tuple[Any, str]]:
    """``(arguments, render)`` of the probe with its arguments as an object and as JSON text (templates differ in
    which they expect), those that render."""
    renders = []
    for arguments in (PROBE_ARGUMENTS, json.dumps(PROBE_ARGUMENTS)):
        text = _render(tokenizer, _conversation(arguments, result), add_generation_prompt=True)
        if text is not None:
            renders.append((arguments, text))
    return renders


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools: the probe conversation's tool description, its call's
    name after the question and its result after that all appear (a template that ignores ``tools`` and
    ``tool_calls`` renders at most the result)."""
    for _, text in _probe_renders(tokenizer):
        asked = text.find(PROBE_USER)
        called = text.find(PROBE_NAME, asked + len(PROBE_USER)) if asked >= 0 else -1
        if PROBE_DESCRIPTION in text and called >= 0 and text.find(PROBE_RESULT, called) >= 0:
            return True
    return False


class TemplateProtocol:
    """A chat template's tool-call format: a call is one JSON object between ``open`` and ``close``; its result
    comes back wrapped in the template's markup (``before`` + result + ``after``), the markup tokenized with
    special tokens, the tool's text never. Made by :func:`template_protocol`."""

    def __init__(self, open: str, close: str, before: str, after: str):
        self.open, self.close, self.before, self.after = open, close, before, after

    def __repr__(self) -> str:
        return (f"TemplateProtocol(open={self.open!r}, close={self.close!r}, before={self.before!r}, "
                f"after={self.after!r})")

    def parse(self, text: str) -> ToolCall | None:
        """The call that ``text`` ends with, between this template's markers
        (:func:`grpokit.rollout.tools.parse_tool_call`:
        every malformed call gives a :class:`ToolCall` with ``error`` set)."""
        return parse_tool_call(text, self.open, self.close)

    def result_pieces(self, text: str, call: ToolCall) -> list[tuple[str, bool]]:
        """``(piece, is_markup)``: the template's markup around the tool's text, as the template renders a tool
        message after the call and then the next generation prompt."""
        return [(self.before, True), (text, False), (self.after, True)]

    def result(self, text: str, call: ToolCall) -> str:
        return "".join(piece for piece, _ in self.result_pieces(text, call))


def _arguments_match(call: dict[str, Any]) -> bool:
    arguments = call.get("arguments", call.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return False
    return arguments == PROBE_ARGUMENTS


def _find_call(text: str, start: int) -> tuple[int, int] | None:
    """``(begin, end)`` of the probe call's JSON object in ``text`` after ``start``: the nearest ``{`` before the
    probe's name that decodes to an object with that name and the probe's arguments."""
    decoder = json.JSONDecoder()
    at = text.find(PROBE_NAME, start)
    while at >= 0:
        brace = text.rfind("{", max(start, at - SEARCH_BACK), at)
        while brace >= 0:
            try:
                call, end = decoder.raw_decode(text, brace)
            except ValueError:
                call, end = None, brace
            if isinstance(call, dict) and call.get("name") == PROBE_NAME and end > at and _arguments_match(call):
                return brace, end
            brace = text.rfind("{", max(start, at - SEARCH_BACK), brace)
        at = text.find(PROBE_NAME, at + 1)
    return None


def _specials(tokenizer: Any) -> list[str]:
    return [t for t in getattr(tokenizer, "all_special_tokens", []) if t]


def _survives(tokenizer: Any, marker: str) -> bool:
    """Whether ``marker`` is still in the text after encoding and decoding it as the rollout does (skipping
    special tokens): the rollout looks for markers in decoded text."""
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    return marker in tokenizer.decode(ids, skip_special_tokens=True)


def template_protocol(tokenizer: Any) -> TemplateProtocol | None:
    """The chat template's tool-call format read from probe renders (module docstring), or None when the template
    does not render tools or its format is not one this module reads: then use the plain-text protocol."""
    if not supports_tools(tokenizer):
        return None
    specials = _specials(tokenizer)
    # How a plain assistant turn ends (e.g. "<|im_end|>\n"): a call's close marker is what comes before that.
    plain = _render(tokenizer, [{"role": "user", "content": PROBE_USER},
                                {"role": "assistant", "content": PROBE_CONTENT}], add_generation_prompt=False)
    turn_end = plain[plain.rfind(PROBE_CONTENT) + len(PROBE_CONTENT):].strip() if plain and PROBE_CONTENT in plain \
        else ""
    # The generation prompt (e.g. "<|im_start|>assistant\n"): what precedes the model's text, not a marker of it.
    asking = [{"role": "user", "content": PROBE_USER}]
    prompted, unprompted = _render(tokenizer, asking, True) or "", _render(tokenizer, asking, False) or ""
    generation = prompted[len(unprompted):] if prompted.startswith(unprompted) else ""
    for arguments, text in _probe_renders(tokenizer):
        if PROBE_USER not in text:
            continue
        asked = text.find(PROBE_USER) + len(PROBE_USER)
        found = _find_call(text, asked)
        if found is None:
            continue
        begin, end = found
        # The open marker: the last line before the JSON, after the reply's text and any special token.
        lead = text[asked:begin]
        if PROBE_CONTENT in lead:
            lead = lead[lead.rfind(PROBE_CONTENT) + len(PROBE_CONTENT):]
        lines = [line.strip() for line in lead.splitlines() if line.strip()]
        op = lines[-1] if lines else ""
        for special in specials:
            if special in op:
                op = op[op.rfind(special) + len(special):].strip()
        # The close marker: after the JSON, up to where the turn ends (or the first special token).
        tail = text[end:]
        stop = tail.find(turn_end) if turn_end else -1
        if stop < 0:
            stops = [tail.find(s) for s in specials if s in tail]
            stop = min(stops) if stops else -1
        close = tail[:stop].strip() if stop >= 0 else ""
        if not op or not close or op in generation or not _survives(tokenizer, op) or not _survives(tokenizer, close):
            return None  # no markers the model writes itself, or markers the rollout could not see
        close_end = end + tail.index(close) + len(close)
        result_at = text.find(PROBE_RESULT, close_end)
        if result_at < 0:
            return None
        before, after = text[close_end:result_at], text[result_at + len(PROBE_RESULT):]
        # The tool's text must come back verbatim (a template that escapes or trims it renders something else).
        check = _render(tokenizer, _conversation(arguments, PROBE_CHECK), add_generation_prompt=True)
        if check != text[:result_at] + PROBE_CHECK + after:
            return None
        return TemplateProtocol(op, close, before, after)
    return None


def build_toolbox(tokenizer: Any, tools: Sequence[Callable], environment_factory: Callable[[], Any] | None, *,
                  chat_template: bool | None, system_prompt: str | None = None, **options: Any) -> ToolBox:
    """The ToolBox of a run or of ``grpokit sample`` (:attr:`ToolBox.NONE`, the empty box, without tools): calls in
    the chat template's own format where the tokenizer has a template that renders tools and ``chat_template`` is
    not false (the prompt then lists the tools as the template describes them: :meth:`ToolBox.prompt_tools`), else
    the plain-text protocol (docs/tools.md). ``options``: the ToolBox's (:func:`toolbox_options`)."""
    if not tools and environment_factory is None:
        return ToolBox.NONE  # no protocol to choose (nor the template's probe conversations to render)
    templated = chat_template is not False and getattr(tokenizer, "chat_template", None) is not None
    return ToolBox(tokenizer, tools, environment_factory=environment_factory, chat_template=chat_template,
                   system_prompt=system_prompt, protocol=template_protocol(tokenizer) if templated else None,
                   **options)


def toolbox_options(config: Any) -> dict[str, Any]:
    """A config's ToolBox settings (a GRPOConfig's keys, or a mapping of them: the demo's)."""
    get = config.get if isinstance(config, dict) else lambda key, default: getattr(config, key, default)
    from grpokit.config import GRPOConfig
    keys = dict(max_calls="max_tool_calls", timeout="tool_timeout", max_reply_chars="max_reply_chars",
                max_turns="max_turns", workers="call_workers")
    return {option: get(key, getattr(GRPOConfig, key)) for option, key in keys.items()}
