"""How a config field is declared once (:func:`option`): its default, its help, its concern
(:data:`GROUPS`), the values it takes (choices or bounds) and what ``None`` means. The configs
check their values from these declarations, and :mod:`lorapage.flags` makes each command's flags
from them."""

from __future__ import annotations

from dataclasses import field
from typing import Any

# The concerns a config's fields are grouped by, in the order --help lists them.
GROUPS = {
    "model": "model",
    "memory": "memory: the page pool and prefix cache",
    "scheduling": "scheduling",
    "adapters": "adapters",
    "kernels": "kernels and threads",
    "state": "state: the adapter registry and downloads",
}


def option(
    default: Any,
    help: str,
    *,
    group: str,
    choices: tuple[str, ...] | None = None,
    none: str | None = None,
    shown: str | None = None,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
) -> Any:
    """A config field declared once: its default, what it does (``help``), its concern (a key of
    :data:`GROUPS`), the values it takes (``choices``, or the bounds ``at_least`` / ``above`` /
    ``at_most``: :func:`bounds_error`), what ``None`` means, and how --help shows the default
    (``shown``; else the default itself)."""
    assert group in GROUPS, group
    assert at_least is None or above is None, "one lower bound"
    bounds = (at_least, above, at_most)
    meta = {"help": help, "group": group, "choices": choices, "none": none, "shown": shown, "bounds": bounds}
    return field(default=default, metadata=meta)


def bounds_error(value: float, bounds: tuple[float | None, float | None, float | None]) -> str | None:
    """What is wrong with ``value`` under ``(at_least, above, at_most)`` (a field's :func:`option`
    bounds), as the end of "X must be ...": ">= 1", "> 0", "in (0, 1]", "in [0, 1]"; ``None``
    where it is within them. Every comparison with a NaN is false: a NaN is outside every bound."""
    at_least, above, at_most = bounds
    low = at_least if at_least is not None else above
    inside = (
        (at_least is None or value >= at_least)
        and (above is None or value > above)
        and (at_most is None or value <= at_most)
    )
    if inside:
        return None
    if at_most is None:
        return f"{'>=' if at_least is not None else '>'} {low:g}"
    if low is None:
        return f"<= {at_most:g}"
    return f"in {'[' if at_least is not None else '('}{low:g}, {at_most:g}]"
