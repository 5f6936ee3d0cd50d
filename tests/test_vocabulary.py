"""Retired words stay retired: one name per idea in ``lorapage/`` and ``kernels/``.

Each row of :data:`RETIRED` is (pattern, where, why): a regular expression that must not match
any line of the files ``where`` names (globs from the checkout's root; a leading ``!`` leaves
files out), and the reason, which is the message a failure shows. To retire a word, add a row.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".c", ".h"}


class Retired(NamedTuple):
    pattern: str
    where: tuple[str, ...]
    why: str


RETIRED: tuple[Retired, ...] = (
    Retired(
        r"(?i)(?<![a-z])lanes?(?![a-z])",
        ("kernels/*",),
        "the C kernels' tokens run in lockstep as stripes; a lane is the scheduler's distinct-adapter "
        "place in the batch (lorapage/scheduler/lanes.py)",
    ),
    Retired(
        r"\bclass FleetConfig\b",
        ("lorapage/**/*.py", "!lorapage/fleet/config.py"),
        "one FleetConfig, the deployed fleet's (lorapage/fleet/config.py); the simulator's is SimFleetConfig",
    ),
    Retired(
        r"\bStepScheduler\b|\bstep_scheduler\b",
        ("lorapage/**/*.py",),
        "the engine's per-step planner is the StepPlanner (engine/step_planner.py); the scheduler is the VTC policy",
    ),
    Retired(
        r"\b(AdminOps|LocalAdmin|FleetAdminOps|resolve_across|resolve_model)\b",
        ("lorapage/**/*.py",),
        "one admin (frontend/admin_ops.Admin) over a VersionStore and a Deployment; names resolve through "
        "resolve_version (stores), route (front end), serving_key / version_across (several bases)",
    ),
)


def files_of(where: tuple[str, ...]) -> list[Path]:
    chosen: set[Path] = set()
    for glob in where:
        if not glob.startswith("!"):
            chosen |= {p for p in ROOT.glob(glob) if p.is_file() and p.suffix in TEXT_SUFFIXES}
    for glob in where:
        if glob.startswith("!"):
            chosen -= set(ROOT.glob(glob[1:]))
    return sorted(chosen)


@pytest.mark.parametrize("rule", RETIRED, ids=[r.pattern for r in RETIRED])
def test_retired_words_do_not_come_back(rule: Retired):
    files = files_of(rule.where)
    assert files, f"{rule.where} names no file: move the row with the code it guards"
    pattern = re.compile(rule.pattern)
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"{rule.why}:\n" + "\n".join(found)


def test_a_retired_word_is_found():
    """The table's first row finds what it retires (it would, were it reintroduced)."""
    assert re.search(RETIRED[0].pattern, "static Plan plan_lanes(int lanes, ...)  /* LANES */")
    assert not re.search(RETIRED[0].pattern, "the plane's planned stripes")


# The control plane's words, held: ``resolve_version(name)`` is a version store's alone, the front
# end's model-name step is ``route(model, tenant)``. Classes, not files: files move, words stay.
STORES = {"AdapterCatalog", "FleetRegistry", "VersionStore"}
# Other words that begin alike and say what they do.
OTHER_RESOLVES = {"resolve_device", "resolved_lora_dtype"}
# aiohttp's resolver interface (the DNS lookup sources make): its name is aiohttp's.
DNS = ("CheckedResolver", "resolve")


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
    assert "ServerState" in routes


# An admin verb is defined in at most 3 places (issue 37): the route (frontend/admin.py), the one
# admin (:class:`Admin`), and the store: the VersionStore protocol and what satisfies it (an
# engine's catalog, the fleet's registry) with the registry they keep (registry/). The verbs are
# Admin's public methods. Not counted: the residency rules and the cache that carries out their
# decisions (adapters/), whose pin, unpin and unload are the rules' own events, applied after the
# store commits; and words spelled alike that name something else (each with its reason).
ADMIN_CLASS = ("lorapage/frontend/admin_ops.py", "Admin")
MAX_VERB_PLACES = 3
HOMONYMS = {
    ("lorapage/tenancy/tenants.py", "TenantsConfig", "load"): "reads a tenants file",
    ("lorapage/replay/keys.py", "Keys", "load"): "reads a replay's keys file",
    ("lorapage/fleet/routing/policies.py", "ReplicaView", "load"): "a replica's load: in flight over capacity",
    ("lorapage/registry/version_index.py", "VersionIndex", "load"): "builds the live view from the registry's rows",
    ("lorapage/model/moe.py", "MoeMlp", "load"): "reads a MoE layer's router and experts from the checkpoint",
}


def _admin_verbs(definitions: list[tuple[str, str | None, str]]) -> set[str]:
    return {name for f, c, name in definitions if (f, c) == ADMIN_CLASS and not name.startswith("_")}


def _verb_places(definitions: list[tuple[str, str | None, str]], verb: str) -> set[str]:
    """Where ``verb`` is defined: ``route``, ``admin``, ``store``, or ``file:class`` for anything else."""
    places = set()
    for f, c, name in definitions:
        if name != verb or f.startswith("lorapage/adapters/") or (f, c, name) in HOMONYMS:
            continue
        if f == "lorapage/frontend/admin.py":
            places.add("route")
        elif (f, c) == ADMIN_CLASS:
            places.add("admin")
        elif c in STORES or f.startswith("lorapage/registry/"):
            places.add("store")
        else:
            places.add(f"{f}:{c or '<module>'}")
    return places


def test_admin_verbs_are_counted_by_place():
    defs = [
        ("lorapage/frontend/admin.py", "AdminRoutes", "pin"),
        ("lorapage/frontend/admin_ops.py", "Admin", "pin"),
        ("lorapage/frontend/admin_ops.py", "VersionStore", "pin"),
        ("lorapage/registry/catalog.py", "AdapterCatalog", "pin"),
        ("lorapage/fleet/registry.py", "FleetRegistry", "pin"),
        ("lorapage/adapters/residency.py", "Residency", "pin"),
        ("lorapage/engine/admin.py", "AdapterAdmin", "pin"),
    ]
    assert _admin_verbs(defs) == {"pin"}
    assert _verb_places(defs, "pin") == {"route", "admin", "store", "lorapage/engine/admin.py:AdapterAdmin"}


def test_each_admin_verb_is_defined_in_at_most_three_places():
    definitions = _definitions()
    verbs = _admin_verbs(definitions)
    assert {"register", "deploy", "rollback", "pin", "unpin", "load", "unload"} <= verbs
    over = {v: sorted(p) for v in sorted(verbs) if len(p := _verb_places(definitions, v)) > MAX_VERB_PLACES}
    assert over == {}
    assert [h for h in HOMONYMS if h not in definitions] == []  # none outlives what it excused
