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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
