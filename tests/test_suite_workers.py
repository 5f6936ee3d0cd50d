"""The suite's split over pytest-xdist workers (tests/conftest.py): every module that starts a Ray
cluster is in the one Ray unit, the wall-clock modules in the "alone" unit (both run with
the other workers idle), and every other module is a unit of its own."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import RAY_MODULES, work_unit

TESTS = Path(__file__).resolve().parent
# ray.init in the test process, or `lorapage fleet` (which starts Ray) as a subprocess.
STARTS_RAY = re.compile(r"\bray\.init\(|\"lorapage\.cli\",\s*\"fleet\"")


def test_every_module_that_starts_ray_is_in_the_ray_unit():
    starts = {
        path.relative_to(TESTS.parent).as_posix()
        for path in TESTS.rglob("test_*.py")
        if STARTS_RAY.search(path.read_text())
    }
    assert starts == set(RAY_MODULES)


def test_units_are_modules_and_the_ray_modules_share_one():
    assert work_unit("tests/fleet/test_fleet_ray.py::test_x[a]") == "ray"
    assert work_unit("tests/fleet/test_fleet_cli.py::test_y") == "ray"
    assert work_unit("tests/adapters/test_adapter_residency.py::test_x") == "alone"
    assert work_unit("tests/sim/test_sim_fleet.py::test_x") == "alone"
    assert work_unit("tests/engine/test_engine.py::test_x[a::b]") == "tests/engine/test_engine.py"
