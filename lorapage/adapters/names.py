"""How an adapter version is named: ``id`` (its alias) or ``id@N`` (version N, immutable).

The grammar every layer shares (the registry stores keys in it, the front end parses a request's
``model`` with it, metrics label by it); it sits under the adapters package so the pure parts
below the registry can read a name without importing the registry.
"""

from __future__ import annotations

import re

from lorapage.errors import InvalidRequestError

_VERSION = re.compile(r"[0-9]{1,18}")
OTHER = "other"  # the metrics label of every adapter outside the top set: no adapter may take it
_ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
# x-adapter-id of base-model requests, and the metrics' label of every adapter outside the top set.
RESERVED_IDS = ("none", OTHER)


def check_adapter_id(adapter_id: str, base_name: str, param: str = "id") -> None:
    """400 unless ``adapter_id`` is a name an adapter may take (ASCII, bounded, not reserved)."""
    if not _ADAPTER_ID.fullmatch(adapter_id) or adapter_id in RESERVED_IDS or adapter_id == base_name:
        shown = adapter_id if len(adapter_id) <= 160 else adapter_id[:160] + "..."
        raise InvalidRequestError(
            f"adapter id {shown!r} must be 1-128 ASCII letters, digits, '.', '_' or '-', start with a letter "
            f"or digit, and not be {' or '.join(repr(r) for r in RESERVED_IDS)} (reserved) or the base model's name",
            param=param,
        )


def version_key(adapter_id: str, version: int) -> str:
    """The name a version is served under: ``id@N``."""
    return f"{adapter_id}@{version}"


def parse_name(name: str) -> tuple[str, int | None]:
    """``id`` -> ``(id, None)`` (the alias), ``id@N`` -> ``(id, N)``; a suffix that is not a
    number of at most 18 ASCII digits gives version -1, which names nothing. Ids never hold ``@``."""
    adapter_id, at, number = name.rpartition("@")
    if not at:
        return name, None
    return adapter_id, int(number) if _VERSION.fullmatch(number) else -1
