"""Tool calling: rendering tools and tool messages for a model's chat template, parsing the
calls its family writes (whole or streamed), and the grammar that makes ``tool_choice``
``required`` / a named function produce valid calls even from an untrained adapter."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.tools.families import FORMATS as FORMATS, detect_format as detect_format, tool_format as tool_format
    from lorapage.tools.formats import ToolCall as ToolCall, ToolFormat as ToolFormat
    from lorapage.tools.prompting import conversation as conversation
    from lorapage.tools.stream import ToolStream as ToolStream

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "FORMATS": "lorapage.tools.families",
        "ToolCall": "lorapage.tools.formats",
        "ToolFormat": "lorapage.tools.formats",
        "ToolStream": "lorapage.tools.stream",
        "conversation": "lorapage.tools.prompting",
        "detect_format": "lorapage.tools.families",
        "tool_format": "lorapage.tools.families",
    },
)
