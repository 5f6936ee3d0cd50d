"""The 404 of an unknown route names the nearest route lorapage serves.

A client that posts to ``/v1/adapter`` or ``/v1/chat/completion`` learns what it meant
(``did you mean POST /v1/adapters?``) instead of a bare "not found". Both front ends (the aiohttp
server and the fleet's ingress) pass the routes they actually serve, so the hint never names a
route that is not there.

Routes are compared as ``METHOD path`` strings: a pattern's placeholders (``{id}``) are filled
with the request's own segments first, so ``/v1/adapters/x/version`` is one letter from
``/v1/adapters/{id}/versions``. The path is cut to :data:`MAX_PATH_CHARS` before any comparison,
so a 404 costs the same small amount whatever an anonymous client sends.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

MAX_PATH_CHARS = 128  # of the requested path compared (difflib is quadratic in the lengths)
_CUTOFF = 0.75  # similarity below which nothing is suggested
_PLACEHOLDER = re.compile(r"\{[^}/]+\}")


def _filled(pattern: str, segments: list[str]) -> str:
    """``pattern`` with each ``{name}`` segment replaced by the request's segment at its place."""
    parts = pattern.split("/")
    return "/".join(segments[i] if _PLACEHOLDER.fullmatch(p) and i < len(segments) else p for i, p in enumerate(parts))


def nearest_route(method: str, path: str, routes: Iterable[tuple[str, str]]) -> tuple[str, str] | None:
    """The ``(method, pattern)`` of ``routes`` most like ``method path``, or None when none is close."""
    path = path[:MAX_PATH_CHARS]
    segments = path.split("/")
    asked = f"{method.upper()[:16]} {path}"
    best, best_score = None, _CUTOFF
    for route_method, pattern in routes:
        matcher = difflib.SequenceMatcher(None, asked, f"{route_method} {_filled(pattern, segments)}")
        if matcher.real_quick_ratio() < best_score or matcher.quick_ratio() < best_score:
            continue
        score = matcher.ratio()
        if score > best_score:
            best, best_score = (route_method, pattern), score
    return best


def not_found_message(method: str, path: str, routes: Iterable[tuple[str, str]]) -> str:
    """What the 404 of ``method path`` says: the nearest of ``routes`` when one is close."""
    shown = path if len(path) <= MAX_PATH_CHARS else path[:MAX_PATH_CHARS] + "..."
    near = nearest_route(method, path, routes)
    hint = f"; did you mean {near[0]} {near[1]}?" if near is not None else ""
    return f"no route {method.upper()[:16]} {shown}{hint} (docs/api.md lists the routes lorapage serves)"
