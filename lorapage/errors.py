"""Errors a caller can act on, for the embedded engine and the server alike: one hierarchy.

Each names what was wrong and what would be accepted. ``status`` is the HTTP status the server
answers with, ``code`` OpenAI's machine-readable code, ``param`` the request field at fault (when
there is one) and ``retry_after`` the seconds after which a retry may succeed (``None``: waiting
does not help, or nobody knows). :mod:`lorapage.frontend.error_json` writes them as OpenAI error JSON.
"""

from __future__ import annotations


class LorapageError(Exception):
    """Base class: a request or registration was refused for a reason the caller can fix."""

    status = 400
    code = "invalid_request"
    retry_after: float | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# --- 400: the request itself ---------------------------------------------------------------


class InvalidRequestError(LorapageError):
    """A request field is outside what the engine accepts (bad sampling value, empty prompt...)."""


class PromptTooLongError(LorapageError):
    """Prompt plus requested tokens do not fit in the model's context."""

    code = "context_length_exceeded"


class AdapterFormatError(LorapageError):
    """An adapter directory is not a PEFT LoRA that fits this base model; the message says why."""

    code = "invalid_adapter"


class AdapterEnvelopeError(AdapterFormatError):
    """An adapter's shape is outside the shared serving envelope (tier dedicated) and no
    dedicated deployment serves it; the message carries its projected cost and the allowed shapes."""

    code = "adapter_outside_envelope"


class AdapterBaseUnknownError(LorapageError):
    """Registration cannot tell which base an adapter was trained on (no ``expected_base_digest``,
    and its ``base_model_name_or_path`` is not a base this server knows); the message says how to
    bind it."""

    code = "adapter_base_unknown"


class AdapterTokensOverSharedLimitError(LorapageError):
    """A request on an adapter asks for more tokens than the shared pool allows one
    (``max_adapter_tokens``); the message names the limit and the dedicated tier."""

    code = "adapter_tokens_over_shared_limit"


class AdapterLoadError(LorapageError):
    """Reading an adapter's weights failed when a request needed them."""

    code = "adapter_load_failed"


class SamplingError(LorapageError):
    """A request's next-token distribution could not be sampled (not finite); that request ends
    alone, every other row of the step goes on."""

    code = "sampling_failed"


# --- 401, 403, 404: who may use what --------------------------------------------------------


class AuthenticationError(LorapageError):
    """No API key, one that matches no tenant, or one that is not UTF-8."""

    status = 401
    code = "invalid_api_key"


class PermissionDeniedError(LorapageError):
    """A valid key that may not do this (a tenant key on an admin route, a path outside the roots)."""

    status = 403
    code = "permission_denied"


class AdapterNotFoundError(LorapageError):
    """The named adapter is not registered, or not visible to the caller: the two look the same."""

    status = 404
    code = "model_not_found"


# --- 409, 413, 429: the server's state or limits --------------------------------------------


class ConflictError(LorapageError):
    """The request clashes with the server's state (an adapter id already taken)."""

    status = 409
    code = "conflict"


class AdapterBusyError(ConflictError):
    """The adapter has requests in flight; the operation would break them."""

    code = "adapter_busy"


class AdapterVersionStaleError(ConflictError):
    """A request named an adapter version older than its id's staleness bound allows (or one
    retired): a rollout must sample from a policy version at most ``max_staleness`` behind."""

    code = "adapter_version_stale"


class AdapterBaseMismatchError(ConflictError):
    """An adapter (a version, or one being registered) was trained on another base model than the
    one running; the message names both digests and the migration route."""

    code = "adapter_base_mismatch"


class PinLimitError(ConflictError):
    """Pinning one more adapter resident would take more of the pool than pins may hold."""

    code = "pin_limit_exceeded"


class BodyTooLargeError(LorapageError):
    """The request body is over the server's limit."""

    status = 413
    code = "request_too_large"


class QuotaExceededError(LorapageError):
    """The tenant's RPM, TPM or concurrency quota is spent. ``retry_after`` is None when waiting
    cannot help (the request alone exceeds the tenant's token burst)."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# --- 5xx: the service, not the request ------------------------------------------------------


class ServiceUnavailableError(LorapageError):
    """No capacity for the request now (shutting down, queue full); retry after ``retry_after``
    seconds (``None``: the server answers with its default of one second)."""

    status = 503
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineOverloadedError(ServiceUnavailableError):
    """The waiting queue is at its bound; retry after a while."""

    code = "overloaded"


class EngineClosedError(ServiceUnavailableError):
    """The engine has been shut down."""

    code = "engine_closed"


class AdapterSourceError(LorapageError):
    """An adapter's weights could not be fetched from their source (unreachable, refused, over
    the size cap); only the requests that need that adapter fail."""

    status = 502
    code = "adapter_source_failed"


class AdapterIntegrityError(AdapterSourceError):
    """Fetched adapter files do not match the digest they were registered with."""

    code = "adapter_integrity_failed"


class EngineStepError(LorapageError):
    """A forward step failed unexpectedly; the requests in it were ended, the engine goes on."""

    status = 500
    code = "internal_error"
