"""vLLM's ``chat_template_kwargs`` and ``chat_template`` request fields, checked.

``chat_template_kwargs`` (a JSON object) passes extra variables to the model's chat template, as
vLLM passes them: Qwen3's ``{"enable_thinking": false}``, Llama 3.1's ``date_string``. A key the
template does not read changes nothing (vLLM drops such keys). A key that would replace what the
server itself gives the template (the messages, the tools, the generation prompt, the special
tokens, the template's helper functions) is refused: the request has fields of its own for those.

``chat_template`` (a whole template sent with the request) is refused: rendering it runs the
client's Jinja code in the server, where a small template can take unbounded time and memory. vLLM
refuses it too unless its operator starts it with ``--trust-request-chat-template``; a multi-tenant
server has no tenant it could trust with that.
"""

from __future__ import annotations

from typing import Any

from lorapage.errors import InvalidRequestError
from lorapage.model.tokenizer import NAMED_SPECIAL_TOKENS

# What the server passes the template itself (and vLLM's own refusals: chat_template, tokenize).
RESERVED_TEMPLATE_VARIABLES = (
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "tokenize",
    "raise_exception",
    "strftime_now",
    *NAMED_SPECIAL_TOKENS,
)


def template_kwargs(kwargs: dict[str, Any] | None, chat_template: Any) -> dict[str, Any]:
    """The checked ``chat_template_kwargs`` of a request (``{}`` when absent); a request template is refused."""
    if chat_template is not None:
        raise InvalidRequestError(
            "chat_template is not accepted: a template sent with the request would run its code in the server "
            "(vLLM refuses it too unless started with --trust-request-chat-template). The model's own chat "
            "template renders every chat; pass variables to it with chat_template_kwargs",
            param="chat_template",
        )
    if not kwargs:
        return {}
    taken = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_VARIABLES)
    if taken:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server gives the template these from the "
            "request itself (messages, tools, add_generation_prompt) and from the model's tokenizer; send them "
            "in their own fields, or omit them",
            param=f"chat_template_kwargs.{taken[0]}",
        )
    return dict(kwargs)
