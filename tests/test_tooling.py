"""The checks read ``kernels/``: mypy, ruff and the layer test each cover every kernel module.

``kernels/`` sits at the top level and is imported as ``lorapage.kernels`` through setuptools'
``package-dir``. No tool reads that mapping (mypy cannot follow an editable install's import
hook, python/mypy#13392), so ``lorapage/kernels`` is a symlink to ``../kernels`` that mypy walks
into from ``packages = ["lorapage"]``; ruff and the layer test read ``kernels/`` itself. Each test
asks the tool (or the test) which files it would read, without running the check itself.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from test_structure import ROOT, module_files

KERNELS = ROOT / "kernels"


def kernel_modules() -> dict[str, Path]:
    """``lorapage.kernels.X`` -> ``kernels/X.py`` for every kernel module (the package as ``lorapage.kernels``)."""
    modules = {f"lorapage.kernels.{p.stem}": p for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    modules["lorapage.kernels"] = KERNELS / "__init__.py"
    assert len(modules) > 10, "kernels/ should hold the kernel modules"
    return modules


def test_mypy_checks_every_kernel_module_under_its_import_name(monkeypatch):
    # mypy's own source finding from pyproject's [tool.mypy], as `python -m mypy` runs it.
    from mypy.main import process_options

    monkeypatch.chdir(ROOT)
    sources, _ = process_options([], stdout=io.StringIO(), stderr=io.StringIO())
    checked = {s.module: Path(s.path).resolve() for s in sources if s.path}
    for module, path in kernel_modules().items():
        assert checked.get(module) == path.resolve(), f"mypy does not check {module} ({path.relative_to(ROOT)})"


def test_ruff_reads_every_kernel_file():
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = {Path(line.strip()).resolve() for line in listed.splitlines() if line.strip().endswith(".py")}
    for path in kernel_modules().values():
        assert path.resolve() in files, f"ruff does not read {path.relative_to(ROOT)}"


def test_ruff_formats_every_kernel_file():
    # `ruff format --check` names no files it passes; a file it excludes is not even counted.
    names = sorted(str(p.relative_to(ROOT)) for p in kernel_modules().values())
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--force-exclude", *names],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(names)} files already formatted" in result.stdout + result.stderr


def test_the_layer_test_reads_every_kernel_module():
    modules = module_files()
    for module, path in kernel_modules().items():
        assert modules.get(module) == path, f"tests/test_structure.py does not read {module}"
