"""The README's commands pass their arguments through: ``scripts/serve --port N`` reaches
``lorapage serve --port N`` and installs no extra named ``--port``; ``scripts/test -k X`` reaches
pytest and skips the lint checks.

The scripts run for real, against an environment directory (``LORAPAGE_VENV``) whose ``python``
and ``lorapage`` only write down how they were called: nothing is installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTEST = "python -m pytest -q -n 2"  # two pytest-xdist workers
RECORDER = '#!/usr/bin/env bash\necho "{name} $*" >> "$LORAPAGE_CALLS"\n'


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    """An environment whose tools record their calls; lorapage counts as installed with every extra."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "lorapage"):
        tool = bin_dir / name
        tool.write_text(RECORDER.format(name=name))
        tool.chmod(0o755)
    for extra in ("", "-dev", "-replay"):
        (tmp_path / "venv" / f".lorapage-installed{extra}").touch()
    return tmp_path / "venv"


def run(script: str, *args: str, venv: Path) -> list[str]:
    """Run ``scripts/<script> args`` against ``venv``; the calls its tools saw, one per line."""
    calls = venv / "calls.log"
    env = {**os.environ, "LORAPAGE_VENV": str(venv), "LORAPAGE_CALLS": str(calls)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    return calls.read_text().splitlines() if calls.exists() else []


def test_serve_passes_its_arguments_to_lorapage_serve(venv):
    assert run("serve", "--port", "8011", "--max-loras", "4", venv=venv) == ["lorapage serve --port 8011 --max-loras 4"]


def test_test_with_arguments_runs_only_pytest_with_them(venv):
    assert run("test", "-k", "quota and not slow", venv=venv) == [f"{PYTEST} -k quota and not slow"]


def test_test_without_arguments_checks_lint_format_and_types_first(venv):
    assert run("test", venv=venv) == [
        "python -m ruff check .",
        "python -m ruff format --check .",
        "python -m mypy",
        PYTEST,
    ]


def test_a_first_run_installs_the_scripts_own_extra_not_an_argument(venv):
    (venv / ".lorapage-installed").unlink()
    (venv / ".lorapage-installed-dev").unlink()
    serve_calls = run("serve", "--port", "8011", venv=venv)
    assert f"python -m pip install -q -e {ROOT}" in serve_calls  # no extra: not `.[--port]`
    assert serve_calls[-1] == "lorapage serve --port 8011"
    test_calls = run("test", "-x", venv=venv)
    assert f"python -m pip install -q -e {ROOT}[dev]" in test_calls
    assert (venv / ".lorapage-installed").exists() and (venv / ".lorapage-installed-dev").exists()
    calls = run("serve", "--port", "8012", venv=venv)
    assert calls[-1] == "lorapage serve --port 8012"
    assert sum("pip install -q -e" in c for c in calls) == 2  # each installed once, not again


def test_replay_passes_its_arguments(venv):
    assert run("replay", "gen", "-o", "t.jsonl", "--scale", "0.1", venv=venv) == [
        "lorapage replay gen -o t.jsonl --scale 0.1"
    ]
