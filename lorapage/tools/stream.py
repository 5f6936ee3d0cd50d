"""A streamed output split into content, released as it comes, and tool calls, parsed at the end.

Content before the first call streams at once, except a tail that may be the start of a call's
marker; from the first marker on, text is held, and the finished output is parsed whole: its
calls go out as ``tool_calls`` deltas (each with its whole arguments, which OpenAI clients
accumulate like any other), and whatever is content after all goes out with them.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorapage.tools.formats import ToolCall, ToolFormat


class ToolStream:
    """One request's output, fed delta by delta."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[dict] = ()) -> None:
        self.fmt = fmt
        self.tools = tools  # the request's tools (a format may type arguments by their schemas)
        self.text = ""
        self._sent = 0  # characters of text released as content
        self._in_call = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; the content that may be released now."""
        self.text += delta
        if self._in_call:
            return ""
        pending = self.text[self._sent :]
        start = self.fmt.call_start(pending)
        if start >= 0:
            self._in_call = True
            end = self._sent + start
        else:
            end = len(self.text) - self.fmt.held_back(pending)
        out, self._sent = self.text[self._sent : end], end
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The output is complete (``cut``: stopped by its length): the content not released yet,
        and the calls it holds (:meth:`ToolFormat.parse <lorapage.tools.formats.ToolFormat.parse>`)."""
        content, calls = self.fmt.parse(self.text, cut, self.tools)
        sent = self.text[: self._sent]
        rest = content[len(sent) :] if content.startswith(sent) else ""
        return rest, calls
