"""Suite-wide pytest hooks: tests marked ``gpu`` are skipped on machines without CUDA, and on
those machines Triton runs in its interpreter (which must be switched on before triton is first
imported, by whichever test gets there first). A server started without ``--state-dir`` keeps
its registry in a directory of this run, never the user's. The checkout's root leaves
``sys.path`` (see below)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# The suite's processes share the machine's cores: two pytest-xdist workers, and the servers and
# Ray replicas they start. An idle libgomp worker spins before it sleeps (lorapage's commands set
# a long spin: lorapage/omp_env.py), and a spinning team holds the cores another process's team
# waits for: two engine test modules side by side on 2 cores took 49-50 s each, 2.7-3.5 s without
# the spin (bench/RESULTS.md, "Test-suite time", round 4 session 11). So no spin, set before torch
# loads libgomp here and inherited by every process the suite starts (lorapage's own setting
# yields to it, as to an operator's). A value in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "0")

import torch  # noqa: E402

# kernels/ is the package lorapage.kernels (pyproject's package-dir). With the checkout's root on
# sys.path (`python -m pytest` puts the working directory first) it would also be importable as a
# top-level `kernels` and shadow the PyPI package of that name, which transformers >= 5.25 imports.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["LORAPAGE_STATE_DIR"] = tempfile.mkdtemp(prefix="lorapage-test-state-")


# The modules that start a Ray cluster, in this process or through `lorapage fleet`: under
# pytest-xdist they make one unit of work that runs alone (two clusters on one machine contend for
# Ray's fixed dashboard-agent port, and with another worker's tests beside them on 2 cores their
# waits, such as a merged deployment's start, ran past their timeouts). A new Ray module goes here.
RAY_MODULES = frozenset(
    f"tests/fleet/{name}.py"
    for name in (
        "test_fleet_autoscale_ray",
        "test_fleet_bases",
        "test_fleet_cli",
        "test_fleet_dedicated_ray",
        "test_fleet_guard_ray",
        "test_fleet_ray",
    )
)
# Modules whose checks ride on wall-clock timing, one unit that runs alone: the residency's turns
# (adapter_wait_s of 0.05 s), and the simulator's agreement with an embedded engine's measured tiers
# (failed once beside another worker's tests).
ALONE_MODULES = frozenset({"tests/adapters/test_adapter_residency.py", "tests/sim/test_sim_fleet.py"})
assert all((_ROOT / m).is_file() for m in RAY_MODULES | ALONE_MODULES), "a module named here is missing"
EXCLUSIVE_UNITS = ("alone", "ray")  # run first, in this order, each with the other workers idle


def work_unit(nodeid: str) -> str:
    """The unit pytest-xdist hands to one worker: the test's module (so its module-scoped fixtures,
    a server or a checkpoint, are built once), "ray" for every test of the Ray modules, "alone"
    for the wall-clock ones."""
    module = nodeid.split("::", 1)[0]
    return "ray" if module in RAY_MODULES else "alone" if module in ALONE_MODULES else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (scripts/test runs ``-n 2``): hand out whole :func:`work_unit`s in the
    order the workers collected them (the exclusive units first, then the modules: see below), and
    nothing to another worker while an exclusive unit has tests left. So those tests run as they
    did in one process, and the rest of the suite on every worker."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _exclusive_runs(self, beside: object = None) -> bool:
            """Whether a worker (other than ``beside``) has tests of an exclusive unit left."""
            units = [work for node, work in self.assigned_work.items() if node is not beside]
            return any(not all(work.get(unit, {}).values()) for work in units for unit in EXCLUSIVE_UNITS)

        def _assign_work_unit(self, node) -> None:  # type: ignore[no-untyped-def]
            if self._exclusive_runs(beside=node):
                return  # until the exclusive units end (mark_test_complete below); their worker goes on
            super()._assign_work_unit(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:  # type: ignore[no-untyped-def]
            super().mark_test_complete(node, item_index, duration)
            if not self._exclusive_runs():
                for other in self.nodes:  # the workers that waited
                    if other is not node and not self._pending_of(self.assigned_work[other]):
                        self._reschedule(other)

    config.option.loadscopereorder = False  # keep the collected order
    return WorkUnitScheduling(config, log)  # type: ignore[arg-type]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _units_in_order(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _units_in_order(items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker the exclusive units come first, then the modules in their usual
    order. Stable: each module keeps its order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {unit: i for i, unit in enumerate(EXCLUSIVE_UNITS)}
        items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))
