"""The control plane's words, held: ``resolve_version(name)`` is a version store's alone, the front
end's model-name step is ``route(model, tenant)``, and the retired admin names stay retired."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The one method a version store answers "which version does this name serve now" with.
# Classes, not files: the files move between packages, the words stay.
STORES = {"AdapterCatalog", "FleetRegistry", "VersionStore"}
# Other words that begin alike and say what they do.
OTHER_RESOLVES = {"resolve_device", "resolved_lora_dtype"}
# aiohttp's resolver interface (the DNS lookup sources make): its name is aiohttp's.
DNS = ("CheckedResolver", "resolve")
RETIRED = {"AdminOps", "LocalAdmin", "FleetAdminOps", "resolve_across", "resolve_model", "version_on"}


def _definitions() -> list[tuple[str, str | None, str]]:
    """(file, class or None, name) of every function and class defined in the library."""
    out = []
    for path in sorted((ROOT / "lorapage").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out.append((rel, None, node.name))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        out.append((rel, node.name, item.name))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((rel, None, node.name))
    return out


def test_resolve_version_is_a_stores_alone():
    stores = {c for _, c, name in _definitions() if name == "resolve_version"}
    assert stores == STORES


def test_no_other_resolve():
    """Each other step says what it does: ``route`` (front end), ``serving_key`` (several bases), ..."""
    found = [
        (c, name)
        for _, c, name in _definitions()
        if name.startswith("resolve") and name != "resolve_version" and name not in OTHER_RESOLVES
    ]
    assert found == [DNS], found


def test_the_front_end_routes_a_model_name():
    routes = {c for f, c, name in _definitions() if name == "route" and c is not None}
    assert {"RouteState", "ServerState"} <= routes


def test_retired_names_stay_retired():
    assert not [d for d in _definitions() if d[2] in RETIRED]
