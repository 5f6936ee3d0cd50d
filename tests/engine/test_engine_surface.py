"""The Engine's public surface is the documented one (lorapage.engine.engine's docstring): its
methods, a few read-only properties, ``admin`` and the read-only ``debug`` view; and the tests
reach the engine's parts only through ``debug``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from lorapage import Engine, EngineConfig
from lorapage.tiny import TINY_BASE_DIR

TESTS = Path(__file__).resolve().parents[1]

METHODS = {
    "generate",
    "generate_batch",
    "run_to_end",
    "abort",
    "stats",
    "metrics",
    "usage_rows",
    "close",
    "add_adapter",
    "register_adapter",
    "merge_into_base",
    "record_merge_check",
    "set_tenant_weights",
    "load_adapter",  # deprecated: engine.admin.load (a DeprecationWarning says so)
}
# Read-only: what the server, replay, the fleet and the bases tools read of an engine.
PROPERTIES = {
    "admin",
    "debug",
    "config",
    "tokenizer",
    "model_config",
    "base_name",
    "digest",
    "max_model_len",
    "device",
    "merged_adapter",
    "step_reserve_bytes",
}
PUBLIC = METHODS | PROPERTIES


@pytest.mark.asyncio
async def test_the_engine_shows_exactly_the_documented_names():
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), max_loras=2, max_lora_rank=8))
    try:
        assert {name for name in dir(engine) if not name.startswith("_")} == PUBLIC
        assert {name for name in METHODS if not callable(getattr(engine, name))} == set()
        for name in PROPERTIES:
            prop = inspect.getattr_static(Engine, name)
            assert isinstance(prop, property) and prop.fset is None, name
            with pytest.raises(AttributeError):
                setattr(engine, name, None)
        with pytest.raises(AttributeError):  # the debug view is read-only too
            engine.debug.pool = None  # type: ignore[misc]
    finally:
        await engine.close()


def _engine_names(scope: ast.AST) -> set[str]:
    """Names an engine is bound to in a function: ``engine``, ``eng``, and any name assigned
    ``Engine(...)`` or ``tiny_engine(...)`` there."""
    names = {"engine", "eng"}
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) else []
        for t, v in [(target, value), *pairs]:
            if isinstance(t, ast.Name) and _makes_engine(v):
                names.add(t.id)
    return names


def _makes_engine(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"Engine", "tiny_engine"}


def _is_engine(node: ast.expr, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):  # a test server's engine
        return node.attr == "engine" and isinstance(node.value, ast.Name) and node.value.id in {"srv", "server"}
    return _makes_engine(node)  # tiny_engine(...).debug


def _uses_engines(tree: ast.AST) -> bool:
    """The file makes or is handed engines (a scheduler test's own fake ``Engine`` is not one)."""
    if any(isinstance(n, ast.ClassDef) and n.name == "Engine" for n in ast.walk(tree)):
        return False
    return any(isinstance(n, ast.Name) and n.id in {"Engine", "tiny_engine", "ENGINES", "srv"} for n in ast.walk(tree))


def _reach_throughs(tree: ast.AST) -> list[ast.Attribute]:
    """``engine.<name>`` for every name the engine does not show."""
    if not _uses_engines(tree):
        return []
    wrong = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    seen: set[int] = set()
    for scope in scopes:
        names = _engine_names(scope)
        for node in ast.walk(scope):
            if id(node) in seen or not isinstance(node, ast.Attribute):
                continue
            seen.add(id(node))
            if node.attr not in PUBLIC and not node.attr.startswith("__") and _is_engine(node.value, names):
                wrong.append(node)
    return wrong


def test_tests_reach_engine_parts_only_through_debug():
    wrong = [
        f"{path.relative_to(TESTS)}:{node.lineno}: {ast.unparse(node)}"
        for path in sorted(TESTS.rglob("*.py"))
        for node in _reach_throughs(ast.parse(path.read_text()))
    ]
    assert wrong == [], "reach engine parts through engine.debug:\n" + "\n".join(wrong)


def test_the_pass_finds_reach_throughs():
    found = _reach_throughs(
        ast.parse(
            "async def t(srv):\n"
            "    engine, other = tiny_engine(), Engine(config)\n"
            "    engine.pool, other._io, srv.engine.residency, tiny_engine().runner\n"
            "    engine.debug.pool, other.stats(), srv.engine.admin\n"
        )
    )
    assert [ast.unparse(n) for n in sorted(found, key=lambda n: n.col_offset)] == [
        "engine.pool",
        "other._io",
        "srv.engine.residency",
        "tiny_engine().runner",
    ]


def test_the_library_does_not_look_through_debug():
    """``debug`` is for tests, benchmarks and diagnostics; the library uses the engine's surface."""
    library = TESTS.parent / "lorapage"
    wrong = [
        f"{path.relative_to(library)}:{node.lineno}: {ast.unparse(node)}"
        for path in sorted(library.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "debug"
    ]
    assert wrong == []
