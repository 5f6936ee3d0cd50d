"""The package's import graph has no cycles, deferred imports included.

Every ``import`` and ``from ... import`` in ``lorapage/`` (and ``kernels/``, imported as
``lorapage.kernels``) is an edge, wherever it stands: a function-level import that closes a loop
is a cycle that only runs later, and one under ``if TYPE_CHECKING:`` is a cycle of meaning (two
modules that need each other) even though it never runs. A package's ``__init__`` counts only for
what it imports itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"lorapage": ROOT / "lorapage", "lorapage.kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if prefix == "lorapage" and name.startswith("lorapage.assets"):
                continue
            modules[name] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, resolved to the most specific known module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    resolve(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    resolve(full if full in known else base)
            visit(child)

    visit(tree)
    return found


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return cycles


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def test_the_graph_is_read():
    graph = import_graph()
    assert "lorapage.engine.engine" in graph and "lorapage.kernels.backend" in graph
    assert "lorapage.engine.step_scheduler" in graph["lorapage.engine.engine"]
    assert "lorapage.kernels.triton_import" in graph["lorapage.kernels.lora_triton"]


def test_a_cycle_is_found():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_lorapage():
    assert find_cycles(import_graph()) == []


def test_lower_layers_do_not_import_upper_ones():
    """Errors and config at the bottom; policy and memory below requests; requests below the
    model; kernels know nothing of the engine; nothing below the server imports it."""
    graph = import_graph()
    below = {
        "lorapage.scheduler": ("lorapage.request", "lorapage.model", "lorapage.engine", "lorapage.server"),
        "lorapage.memory": ("lorapage.request", "lorapage.model", "lorapage.engine", "lorapage.server"),
        "lorapage.kernels": ("lorapage.engine", "lorapage.model", "lorapage.adapters", "lorapage.server"),
        "lorapage.model": ("lorapage.engine", "lorapage.server"),
        "lorapage.engine": ("lorapage.server",),
        "lorapage.request": ("lorapage.model", "lorapage.engine", "lorapage.adapters", "lorapage.server"),
        "lorapage.sampling_params": ("lorapage.request", "lorapage.model", "lorapage.engine", "lorapage.server"),
        "lorapage.errors": ("lorapage",),
        "lorapage.config": (
            "lorapage.engine",
            "lorapage.model",
            "lorapage.adapters",
            "lorapage.server",
            "lorapage.scheduler",
            "lorapage.memory",
            "lorapage.request",
        ),
    }
    wrong = [
        (module, target)
        for module, targets in graph.items()
        for layer, forbidden in below.items()
        if module == layer or module.startswith(layer + ".")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    ]
    assert wrong == []


BLOCK_TORCH = """
import importlib, sys
class Block:
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is made unimportable here")
sys.meta_path.insert(0, Block())
module = importlib.import_module(sys.argv[1])
for name in getattr(module, "__all__", []):
    getattr(module, name)  # the lazy exports too
"""


@pytest.mark.parametrize("module", ["lorapage.sim", "lorapage.fleet.routing", "lorapage.scheduler", "lorapage.config"])
def test_pure_parts_import_without_torch(module):
    """The policies the simulator shares with the engine must not need a tensor library."""
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH, module], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_package_face_exports_lazily_what_it_declares():
    """One rule for ``__init__`` files: a docstring, exports through ``lorapage._exports.lazy``
    only, and the names its ``TYPE_CHECKING`` block imports (for type checkers) are exactly its
    table's, from the same modules."""
    for name, path in module_files().items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{name} has no docstring"
        typed: dict[str, str] = {}
        table: dict[str, str] = {}
        for node in tree.body:
            if isinstance(node, ast.If):  # if TYPE_CHECKING:
                for imp in node.body:
                    assert isinstance(imp, ast.ImportFrom) and imp.module
                    typed.update({a.asname or a.name: imp.module for a in imp.names})
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                table = {k.value: v.value for k, v in zip(node.value.args[1].keys, node.value.args[1].values)}
            elif isinstance(node, ast.ImportFrom):
                assert node.module in ("typing", "lorapage._exports", "__future__"), f"{name} imports {node.module}"
            else:
                assert isinstance(node, ast.Expr), f"{name} defines {ast.dump(node)[:80]}"  # the docstring
        assert typed == table, name
