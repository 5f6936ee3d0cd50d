"""``GET /version`` and ``GET|POST /ping``, as vLLM answers them (both front ends)."""

from __future__ import annotations

from functools import cache
from importlib import metadata

import msgspec

PING_BODY = b""  # vLLM's /ping is its /health: 200 and no body


@cache
def version_body() -> bytes:
    """``{"version": ...}``: the installed lorapage's version."""
    try:
        version = metadata.version("lorapage")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = "unknown"
    return msgspec.json.encode({"version": version})
