"""Qwen3's thinking (vLLM's ``--reasoning-parser qwen3``): ``<think>...</think>`` before the answer
goes to the message's ``reasoning_content``, the rest to its ``content``; whole or streamed.

A block is reasoning when the output opens it (``<think>`` first, after whitespace; Qwen3 writes
it) or the prompt did (a template that ends its generation prompt with ``<think>``, as Qwen3.5's
and the 2507 thinking models' do): then everything up to ``</think>`` is reasoning, all of it when
the output ends first (cut by max_tokens). An output that opens no block is all content, so
``enable_thinking: false`` (whose template closes an empty block in the prompt) and models that
do not think are answered as without the parser.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves a ``<think>`` block open for the output to continue."""
    return prompt.rfind(START) > prompt.rfind(END)


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A finished output as ``(reasoning, content)`` (reasoning None: no block); ``opened``: the
    prompt opened the block."""
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(START):
            return None, text
        text = stripped[len(START) :]
    reasoning, end, content = text.partition(END)
    return reasoning, content if end else ""


class ReasoningStream:
    """One output's reasoning and content, released delta by delta as :func:`split_reasoning`
    would split the whole: text that may still be (the start of) a tag is held until it is not."""

    def __init__(self, opened: bool = False) -> None:
        self._phase = "reasoning" if opened else "start"
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` that ``delta`` releases."""
        if self._phase == "content":
            return "", delta
        self._held += delta
        if self._phase == "start":
            stripped = self._held.lstrip()
            if START.startswith(stripped):  # whitespace, or a <think> not yet whole
                return "", ""
            if not stripped.startswith(START):
                self._phase, text, self._held = "content", self._held, ""
                return "", text
            self._phase, self._held = "reasoning", stripped[len(START) :]
        reasoning, end, content = self._held.partition(END)
        if end:
            self._phase, self._held = "content", ""
            return reasoning, content
        keep = max((k for k in range(1, len(END)) if reasoning.endswith(END[:k])), default=0)
        self._held = reasoning[len(reasoning) - keep :]
        return reasoning[: len(reasoning) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: an unclosed block's tail is reasoning."""
        held, self._held = self._held, ""
        if self._phase == "start":
            return "", held
        return (held, "") if self._phase == "reasoning" else ("", held)
