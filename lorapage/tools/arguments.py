"""A function's arguments one by one, for the formats that write each argument on its own
(``qwen3_coder``'s ``<parameter=x>``, ``pythonic``'s ``x=...``) rather than as one JSON object:
the declared parameters in order, and the Lark rules of a sequence where some may be left out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lorapage.structured.spec import closed_objects


@dataclass(frozen=True)
class Parameter:
    """One declared argument of a function: its name, its JSON schema (objects closed at every
    depth, as the JSON formats' grammars close them), and whether it must be given."""

    name: str
    schema: dict[str, Any]
    required: bool


def parameters(tool: dict) -> list[Parameter]:
    """The declared arguments of an OpenAI function tool, in the order its schema lists them."""
    params = tool["function"].get("parameters") or {}
    required = set(params.get("required") or ())
    properties = params.get("properties") or {}
    return [
        Parameter(name, closed_objects(schema if isinstance(schema, dict) else {}), name in required)
        for name, schema in properties.items()
    ]


def object_arguments(arguments: Any) -> dict[str, Any]:
    """An earlier call's arguments as an object (arguments that were no JSON object: none)."""
    return arguments if isinstance(arguments, dict) else {}


def json_value(schema: dict[str, Any]) -> str:
    """Lark for one JSON value valid against ``schema``, written without optional whitespace."""
    return f"%json {json.dumps({'x-guidance': {'whitespace_flexible': False}, **schema}, ensure_ascii=False)}"


def sequence_rules(prefix: str, items: list[tuple[str, bool]], separator: str) -> tuple[str, list[str]]:
    """Lark rules for ``items`` (each ``(lark expression, required)``) in order, the optional ones
    left out at will, ``separator`` (a Lark literal, or ``""``) between those present. Returns the
    expression of the whole (``""`` when there are no items) and its rules: ``{prefix}_rest_i`` is
    items i.. each after a separator, ``{prefix}_first_i`` items i.. with the first one present
    unseparated."""
    sep = f"{separator} " if separator else ""
    rules, n = [], len(items)
    for i in range(n - 1, -1, -1):
        expr, required = items[i]
        rest = f" {prefix}_rest_{i + 1}" if i + 1 < n else ""
        rules.append(
            f"{prefix}_rest_{i}: {sep}{expr}{rest}" if required else f"{prefix}_rest_{i}: ({sep}{expr})?{rest}"
        )
        if required:
            rules.append(f"{prefix}_first_{i}: {expr}{rest}")
        elif i + 1 < n:
            rules.append(f"{prefix}_first_{i}: {expr}{rest} | {prefix}_first_{i + 1}")
        else:
            rules.append(f"{prefix}_first_{i}: ({expr})?")
    return (f"{prefix}_first_0" if n else ""), rules
