"""Errors a caller can act on. Each names what was wrong and what would be accepted.

The server maps them to OpenAI error JSON: ``status`` is the HTTP status, ``code`` the machine
readable code, ``param`` the request field at fault (when there is one).
"""

from __future__ import annotations


class LorapageError(Exception):
    """Base class: a request or registration was refused for a reason the caller can fix."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(LorapageError):
    """A request field is outside what the engine accepts (bad sampling value, empty prompt...)."""


class PromptTooLongError(LorapageError):
    """Prompt plus requested tokens do not fit in the model's context."""

    code = "context_length_exceeded"


class AdapterNotFoundError(LorapageError):
    """The named adapter is not registered (or not visible to the caller)."""

    status = 404
    code = "model_not_found"


class AdapterFormatError(LorapageError):
    """An adapter directory is not a PEFT LoRA that fits this base model; the message says why."""

    code = "invalid_adapter"


class AdapterLoadError(LorapageError):
    """Reading an adapter's weights failed when a request needed them."""

    code = "adapter_load_failed"


class EngineOverloadedError(LorapageError):
    """The waiting queue is at its bound; retry after a while."""

    status = 503
    code = "overloaded"


class EngineClosedError(LorapageError):
    """The engine has been shut down."""

    status = 503
    code = "engine_closed"


class AdapterBusyError(LorapageError):
    """The adapter has requests in flight; the operation would break them."""

    status = 409
    code = "adapter_busy"


class EngineStepError(LorapageError):
    """A forward step failed unexpectedly; the requests in it were ended, the engine goes on."""

    status = 500
    code = "internal_error"
