"""Which tool-call format a model writes: the parsers users pick in vLLM (``--tool-call-parser``),
named here, and the one a chat template shows when none is picked.

Detection reads what the template teaches the model to write, first match wins:

- ``<function=`` with ``<parameter=``: ``qwen3_coder`` (Qwen3-Coder's template);
- ``[TOOL_CALLS]``: ``mistral``;
- "python list" (the pythonic templates of Llama 3.2 / 4, Gemma 3 and ToolACE say "respond with a
  python list of the calls"): ``pythonic``;
- ``<|python_tag|>``, or ``ipython`` with ``"parameters"``: ``llama3_json`` (Llama 3.1 / 3.2 / 3.3);
- ``<start_of_turn>`` (Gemma 2 / 3, whose templates show no tools): ``pythonic``, the format vLLM's
  Gemma 3 tool template teaches; lorapage describes the tools in its words;
- anything else (``<tool_call>``: Hermes, Qwen 2.5 / 3; or a template with no tools at all): ``hermes``.
"""

from __future__ import annotations

from lorapage.tools.formats import HermesFormat, Llama3JsonFormat, MistralFormat, ToolFormat
from lorapage.tools.pythonic import PythonicFormat
from lorapage.tools.qwen3_coder import Qwen3CoderFormat

FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(), Qwen3CoderFormat(), PythonicFormat())
}
AUTO = "auto"  # --tool-call-parser's default: the format the chat template shows


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template writes tool calls in (what vLLM's ``--tool-call-parser`` names);
    Hermes for templates that show none (lorapage then describes the tools in Hermes's words)."""
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return FORMATS["qwen3_coder"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "python list" in template:
        return FORMATS["pythonic"]
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return FORMATS["llama3_json"]
    if "<start_of_turn>" in template:
        return FORMATS["pythonic"]
    return FORMATS["hermes"]


def tool_format(parser: str, chat_template: str | None) -> ToolFormat:
    """The format ``--tool-call-parser`` names (``auto``: the one ``chat_template`` shows)."""
    return detect_format(chat_template) if parser == AUTO else FORMATS[parser]
