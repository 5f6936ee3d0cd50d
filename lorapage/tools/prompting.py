"""A conversation with tools, as the model's chat template takes it.

A template that knows tools (it reads ``tools``) gets them and the OpenAI messages as
transformers would pass them: assistant ``tool_calls`` with their arguments as objects, ``tool``
messages as they are. A template that does not (the built-in tiny model's, Gemma's) gets the
tools described in a system message, with how to call them in the format's own words
(:attr:`~lorapage.tools.formats.ToolFormat.instruction`), assistant calls written out as the
format writes them and tool results as user turns in ``<tool_response>`` tags: the way Hermes and
Qwen templates render them, through the roles the template has. A template that takes no system
message (Gemma 2 refuses one) gets that description at the start of the first user turn.
"""

from __future__ import annotations

import json
from typing import Any

from lorapage.tools.formats import ToolFormat

# Hermes's tools prompt, in short (a template without tools gets this; a small model's context is short).
TOOLS_PROMPT = "You may call these functions:\n<tools>\n{tools}\n</tools>\n{instruction}"


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def conversation(
    messages: list[dict[str, Any]],
    tools: list[dict] | None,
    fmt: ToolFormat,
    chat_template: str | None,
    *,
    system_role: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(messages, template keyword arguments)`` for the chat template. ``messages`` are OpenAI
    chat messages already checked (roles system, user, assistant, tool); ``system_role``: whether
    the template takes a system message."""
    if template_knows_tools(chat_template):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [
                    {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": _args(c)}}
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls, "content": m.get("content") or ""}
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    if tools:
        described = "\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
        system = TOOLS_PROMPT.format(tools=described, instruction=fmt.instruction)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        if system_role:
            out.append({"role": "system", "content": system})
        elif messages and messages[0]["role"] == "user":
            messages = [{**messages[0], "content": system + "\n\n" + messages[0]["content"]}, *messages[1:]]
        else:
            messages = [{"role": "user", "content": system}, *messages]
    for m in messages:
        if m["role"] == "tool":
            body = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + body}
            else:
                out.append({"role": "user", "content": body})
        elif m.get("tool_calls"):
            written = fmt.write([{"name": c["name"], "arguments": _args(c)} for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": (m.get("content") or "") + written})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return out, {}


def _args(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["arguments"])
    except (ValueError, TypeError):
        return call["arguments"]
