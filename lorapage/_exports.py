"""How every package ``__init__`` exports its public names: lazily, from the module that defines them.

A package's face imports nothing when the package is imported, so importing a pure part (the
scheduler, the simulator, the routing policies) never drags in torch, Ray or aiohttp through a
sibling it does not use. Each ``__init__`` names its exports in one table and, for type checkers
only, imports them under ``TYPE_CHECKING``; ``tests/test_structure.py`` checks the two agree.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose public name N lives in module
    ``table[N]`` (imported on first use of N)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals_of(package)[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals_of(package)) | set(table))

    return __getattr__, __dir__, list(table)


def globals_of(package: str) -> dict[str, Any]:
    return vars(importlib.import_module(package))
