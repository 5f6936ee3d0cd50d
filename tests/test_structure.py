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
    assert "lorapage.engine.step_planner" in graph["lorapage.engine.build"]
    assert "lorapage.kernels.triton_import" in graph["lorapage.kernels.lora_triton"]


def test_a_cycle_is_found():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_lorapage():
    assert find_cycles(import_graph()) == []


# The layers, top first: one row per package (or module), with what it is. A module may import
# its own package and anything in a lower row, nothing in its row or above. docs/structure.md's
# "Layers" block is this table rendered (checked below).
LAYERS: tuple[tuple[str, str], ...] = (
    ("lorapage.testing", "support for tests and benchmarks: `lorapage serve` as a child process"),
    ("lorapage.cli", "the `lorapage` command"),
    ("lorapage.demo", "`lorapage demo`"),
    ("lorapage", "the package face: Engine, EngineConfig, SamplingParams, RequestOutput"),
    ("lorapage.fleet", "Ray Serve application: ingress, engine replicas, affinity router"),
    ("lorapage.serve", "`lorapage serve`: the command, the front end over engines here, several bases, local admin"),
    ("lorapage.bases.cli", "`lorapage base check` and `lorapage base digest`"),
    ("lorapage.capacity", "sizing: the design's arithmetic and the simulator's replicas, `lorapage plan`"),
    ("lorapage.replay", "load replay: traces in, driver, reports and plots"),
    ("lorapage.sim", "the fleet simulator: the real policies on a virtual clock"),
    ("lorapage.frontend", "the one HTTP front end: routes, wire formats, auth, tenants, quotas, SLOs, metrics, SSE"),
    ("lorapage.bases", "base upgrades: the drift check on two engines, validation jobs"),
    ("lorapage.engine", "the Engine facade, the step planner, the step loop"),
    ("lorapage.registry", "the SQLite store, version index, catalog, audit and drift state of adapter versions"),
    ("lorapage.parallel", "tensor parallelism: the worker ranks, their base, KV and adapter shards, the wire"),
    ("lorapage.sources", "where adapter files come from: directories, https, s3, hf, the download cache"),
    ("lorapage.adapters", "PEFT format, names, layout in pages, residency rules, tiered cache, loader"),
    ("lorapage.model", "Llama decoder, tokenizer, sampler, runner, lookup tables"),
    ("lorapage.request", "Request, its OutputChannel, RequestOutput, TokenLogprob"),
    ("lorapage.sampling_params", "SamplingParams (per request)"),
    ("lorapage.traces", "trace format, records and statistics (replay and simulator)"),
    ("lorapage.fleet.promotion", "the dedicated tier's promotion rules (the fleet's ingress and `lorapage serve`)"),
    ("lorapage.fleet.routing", "routing policies (the Ray router and the simulator)"),
    ("lorapage.fleet.autoscale", "the autoscaling policy (Ray Serve's custom policy and the simulator)"),
    ("lorapage.scheduler", "VTC and FCFS: pure policy"),
    ("lorapage.memory", "the page pool, block tables, prefix cache, reclaim, sizing"),
    ("lorapage.usage", "cost attribution by tenant and adapter version"),
    ("lorapage.tools", "tool-call formats, their grammars and parsers"),
    ("lorapage.structured", "structured-output specs, grammars and masks"),
    ("lorapage.tenancy", "tenants, keys, quotas (token buckets), SLO burn rates, threads shared in turn"),
    ("lorapage.flags", "command-line flags made from config declarations"),
    ("lorapage.tiny", "where the built-in tiny model lives"),
    ("lorapage.config", "EngineConfig, each field declared once"),
    ("lorapage.options", "how a config field is declared: help, concern, choices, bounds"),
    ("lorapage.kernels", "Triton and C kernels beside their PyTorch references"),
    ("lorapage.errors", "errors a caller can act on"),
    ("lorapage.omp_env", "OpenMP's spin before an idle worker sleeps (set before torch loads)"),
    ("lorapage.heap", "a serving process's startup heap frozen out of the collector's oldest generation"),
    ("lorapage._exports", "how package faces export lazily"),
)


def layer_of(module: str) -> int:
    """The row of the most specific entry that contains ``module``."""
    best = max((e for e, _ in LAYERS if module == e or module.startswith(e + ".")), key=len)
    return next(i for i, (e, _) in enumerate(LAYERS) if e == best)


def test_every_module_has_a_layer():
    assert all(layer_of(m) >= 0 for m in module_files())
    entries = {e for e, _ in LAYERS}
    packages = {m for m, p in module_files().items() if p.name == "__init__.py"} | {
        m for m in module_files() if m.count(".") == 1
    }
    missing = sorted(m for m in packages if m not in entries and not any(m.startswith(e + ".") for e in entries))
    assert missing == []


def test_modules_import_only_their_own_package_and_lower_layers():
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        row = layer_of(module)
        for target in targets:
            if LAYERS[layer_of(target)][0] == LAYERS[row][0]:
                continue  # within one entry (its own package)
            if layer_of(target) <= row:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_loops_between_packages():
    """Folder-level: the graph of layer entries (packages) has no cycle either."""
    graph = import_graph()
    folders: dict[str, set[str]] = {e: set() for e, _ in LAYERS}
    for module, targets in graph.items():
        here = LAYERS[layer_of(module)][0]
        folders[here] |= {LAYERS[layer_of(t)][0] for t in targets} - {here}
    assert find_cycles(folders) == []


def render_layers() -> str:
    width = max(len(e) for e, _ in LAYERS)
    return "\n".join(f"  {e:<{width}}  {what}" for e, what in LAYERS)


def test_docs_show_this_layer_table():
    """docs/structure.md holds the table above, rendered, between its markers."""
    text = (ROOT / "docs" / "structure.md").read_text()
    block = text.split("<!-- layers -->\n```\n", 1)[1].split("\n```", 1)[0]
    assert block == render_layers(), "docs/structure.md's layers are stale: paste render_layers()"


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


@pytest.mark.parametrize(
    "module",
    [
        "lorapage.sim",
        "lorapage.sim.fleet",
        "lorapage.fleet.routing",
        "lorapage.scheduler",
        "lorapage.config",
        "lorapage.adapters.residency",
        "lorapage.adapters.residence",
        "lorapage.adapters.host_ram",
        "lorapage.adapters.pool_slots",
        "lorapage.adapters.loads",
        "lorapage.adapters.pins",
        "lorapage.registry.version_index",
        "lorapage.omp_env",
    ],
)
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


def test_pyproject_lists_every_package():
    """``[tool.setuptools] packages`` is an explicit list: a package missing from it is missing
    from every wheel (and from a non-editable install) while the tests, run from the tree, pass."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert folders - listed == set()


def test_bench_scripts_share_modules_not_one_another():
    """bench/ is a package of scripts and the modules they share (bench/__init__.py names them):
    a script imports the shared modules, never another script (``bench_*.py``, ``profile_*.py``)."""
    bench = ROOT / "bench"
    scripts = {p.stem for p in bench.glob("*.py") if p.stem.startswith(("bench_", "profile_"))}
    assert (bench / "__init__.py").exists() and (bench / "harness.py").exists()
    wrong = []
    for path in sorted(bench.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.name} imports {n}" for n in names if n.split(".")[-1] in scripts or n.startswith("bench")]
    assert wrong == []


# -- methods that only forward -------------------------------------------------------------------
# A method whose whole body calls a part's method of the same name (``return self.part.m(...)``)
# is a corridor: its callers should ask the part. Except where the delegation IS the job: a class
# implementing someone else's interface over a part (an entry names the class: each of its
# forwarders is that), or one method with a reason of its own. Each entry says which; at most ~10.
DELEGATES = {
    "lorapage.scheduler.metrics.MeteredPolicy": "a SchedulerPolicy metering another: the choices are the policy's",
    "lorapage.scheduler.metrics._ObservingContext": "the admission context a metered policy sees, observed",
    "lorapage.sim.loader.SimLoader": "the residency driver for the simulator: its rules' verbs, no engine behind",
    "lorapage.serve.engine_backend.EngineBackend": "the front end's Backend protocol, over the engines",
    "lorapage.serve.local_admin.LocalDeployment.make_resident": "the admin's Deployment strategy, over one engine",
    "lorapage.fleet.replica.EngineReplica.usage_rows": "a Ray actor method: the ingress asks each replica",
    "lorapage.sources.addresses.CheckedResolver.close": "aiohttp's AbstractResolver, over the resolver it checks",
    "lorapage.engine.engine.Engine.digest": "the engine's face: the base's digest, computed when first asked",
    "lorapage.registry.catalog.AdapterCatalog.close": "the registry's one holder closes it: no one else has it",
    "lorapage.frontend.state.ServerState.release": "supplies the clock the quota book is kept by",
    "lorapage.frontend.access_log.AccessLog.write": "encodes a record as one JSON line",
}
MAX_DELEGATES = 12


def forwarders_in(module: str, tree: ast.AST) -> list[str]:
    """``module.Class.method`` for each method of ``tree`` whose whole body (its docstring aside)
    is ``[return] [await] self.part.method(...)``, the part's method of the same name."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for f in cls.body:
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
                continue
            call = body[0].value.value if isinstance(body[0].value, ast.Await) else body[0].value
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == f.name
                and isinstance(call.func.value, ast.Attribute)
            ):
                found.append(f"{module}.{cls.name}.{f.name}")
    return found


def forwarders() -> list[str]:
    return sorted(f for name, path in module_files().items() for f in forwarders_in(name, ast.parse(path.read_text())))


def test_a_forwarder_is_found():
    source = """
class A:
    def f(self, x):
        "Docstring."
        return self.part.f(x)

    async def g(self):
        await self.part.g()

    def h(self):
        return self.part.other()

    def k(self):
        self.part.k()
        return 1
"""
    assert forwarders_in("m", ast.parse(source)) == ["m.A.f", "m.A.g"]


def test_no_method_only_forwards_to_a_part_of_the_same_name():
    """Every forwarder is listed in :data:`DELEGATES` (by itself or by its class)."""
    found = forwarders()
    assert [f for f in found if f not in DELEGATES and f.rpartition(".")[0] not in DELEGATES] == []
    # the list stays short, each entry with its reason, and none outlives what it excused
    assert len(DELEGATES) <= MAX_DELEGATES and all(reason.strip() for reason in DELEGATES.values())
    assert [d for d in DELEGATES if not any(f == d or f.startswith(d + ".") for f in found)] == []


# The house's size bounds (issue 37): what a newcomer reads in one sitting. Measured over
# lorapage/ and kernels/ with ast; the figures are bounds, not today's values.
MAX_MODULE_LINES = 600
MAX_CLASS_METHODS = 40
MAX_PACKAGE_SHARE = 0.20  # of the library's lines, per top-level package (kernels/ counts as one)
MAX_ENGINE_INIT_LINES = 60


def _classes():
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield name, node, [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_class_over_the_method_bound():
    big = [f"{m}.{c.name}: {len(ms)}" for m, c, ms in _classes() if len(ms) > MAX_CLASS_METHODS]
    assert big == []


def test_no_module_over_the_line_bound():
    long = {m: n for m, p in module_files().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_package_over_its_share_of_the_lines():
    lines: dict[str, int] = {}
    for module, path in module_files().items():
        top = ".".join(module.split(".")[:2])
        lines[top] = lines.get(top, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    assert {p: round(n / total, 3) for p, n in lines.items() if n / total > MAX_PACKAGE_SHARE} == {}


def test_the_engine_builds_itself_in_a_few_lines():
    tree = ast.parse(module_files()["lorapage.engine.engine"].read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    init = next(f for f in engine.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assert init.end_lineno is not None and init.end_lineno - init.lineno + 1 <= MAX_ENGINE_INIT_LINES
