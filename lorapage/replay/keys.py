"""The keys file of ``--url`` replays: which API key each tenant of the trace sends.

JSON or TOML (by the ``.toml`` suffix), e.g.::

    {"tenants": {"acme": "lp-...", "globex": "lp-...", "*": "sk-..."}, "admin": "lp-admin-..."}

``"*"`` is the key of every tenant not named (one key for a server that has no tenants);
``admin`` opens ``/metrics`` on a lorapage server (``--admin-key`` overrides it).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ANY_TENANT = "*"


class KeysError(ValueError):
    """The keys file is malformed or lacks a tenant's key; the message says what to add."""


@dataclass(frozen=True)
class Keys:
    tenants: dict[str, str] = field(default_factory=dict)
    admin: str | None = None

    @classmethod
    def load(cls, path: str | Path) -> Keys:
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        try:
            doc = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise KeysError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}") from None
        if not isinstance(doc, dict) or set(doc) - {"tenants", "admin"}:
            raise KeysError(f'{path}: expected {{"tenants": {{tenant: key}}, "admin": key}}; got keys {list(doc)}')
        tenants = doc.get("tenants", {})
        admin = doc.get("admin")
        if not isinstance(tenants, dict) or not all(isinstance(v, str) and v for v in tenants.values()):
            raise KeysError(f"{path}: tenants must map each tenant to a non-empty key string")
        if admin is not None and not (isinstance(admin, str) and admin):
            raise KeysError(f"{path}: admin must be a non-empty key string")
        return cls(dict(tenants), admin)

    def key_for(self, tenant: str) -> str | None:
        return self.tenants.get(tenant, self.tenants.get(ANY_TENANT))

    def check_covers(self, tenants: Iterable[str]) -> None:
        """Every tenant of the trace has a key (or there is a ``"*"`` key)."""
        missing = sorted({t for t in tenants if self.key_for(t) is None})
        if missing:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise KeysError(f'no key for tenants {shown}: add them to the keys file\'s "tenants", or a "*" key')
