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
import torch

# kernels/ is the package lorapage.kernels (pyproject's package-dir). With the checkout's root on
# sys.path (`python -m pytest` puts the working directory first) it would also be importable as a
# top-level `kernels` and shadow the PyPI package of that name, which transformers >= 5.25 imports.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["LORAPAGE_STATE_DIR"] = tempfile.mkdtemp(prefix="lorapage-test-state-")


# The modules that start a Ray cluster, in this process or through `lorapage fleet`: under
# pytest-xdist one worker runs them all, one cluster at a time (two clusters on one machine contend
# for Ray's fixed dashboard-agent port, and each would want both cores). A new Ray module goes here.
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
assert all((_ROOT / module).is_file() for module in RAY_MODULES), "RAY_MODULES names a missing file"


def work_unit(nodeid: str) -> str:
    """The unit pytest-xdist hands to one worker: the test's module (so its module-scoped fixtures,
    a server or a checkpoint, are built once), or "ray" for every test of the Ray modules."""
    module = nodeid.split("::", 1)[0]
    return "ray" if module in RAY_MODULES else module


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (scripts/test runs ``-n 2``): hand out whole :func:`work_unit`s, in the
    order the workers collected them (the Ray unit first, see below)."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # keep the collected order: the Ray unit first
    return WorkUnitScheduling(config, log)  # type: ignore[arg-type]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _ray_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _ray_first(items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker the Ray unit comes first: it is the longest unit of work, and
    started last it would be the whole run's tail. Stable: each module keeps its order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: work_unit(item.nodeid) != "ray")
