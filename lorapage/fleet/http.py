"""Error answers of the ingress as Starlette responses, in the OpenAI error JSON the server writes.

The JSON itself comes from :func:`lorapage.server.error_json.error_payload`; this module adds the
status and ``Retry-After`` as :func:`lorapage.server.error_json.error_response` does for aiohttp.
"""

from __future__ import annotations

from starlette.responses import Response

from lorapage.errors import LorapageError
from lorapage.server.error_json import _HttpError, error_payload

_DEFAULT_RETRY_AFTER_S = 1  # a 503 without a better estimate, as the server


def error_response(exc: LorapageError) -> Response:
    """The HTTP answer for a refused request, with ``Retry-After`` where waiting helps."""
    headers = {}
    retry_after = exc.retry_after
    if retry_after is None and exc.status == 503:
        retry_after = _DEFAULT_RETRY_AFTER_S
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    return Response(error_payload(exc), status_code=exc.status, media_type="application/json", headers=headers)


def no_route() -> Response:
    return error_response(_HttpError(404, "not_found", "no such route; see docs/api.md for the routes lorapage serves"))


def method_not_allowed(allowed: str) -> Response:
    response = error_response(_HttpError(405, "method_not_allowed", f"method not allowed; allowed: {allowed}"))
    response.headers["Allow"] = allowed
    return response


def internal_error() -> Response:
    return error_response(_HttpError(500, "internal_error", "internal server error; the failure is in the ingress log"))
