"""Tool calling: rendering tools and tool messages for a model's chat template, parsing the
calls its family writes (whole or streamed), and the grammar that makes ``tool_choice``
``required`` / a named function produce valid calls even from an untrained adapter."""

from lorapage.tools.formats import FORMATS, ToolCall, ToolFormat, detect_format
from lorapage.tools.prompting import conversation
from lorapage.tools.stream import ToolStream

__all__ = ["FORMATS", "ToolCall", "ToolFormat", "ToolStream", "conversation", "detect_format"]
