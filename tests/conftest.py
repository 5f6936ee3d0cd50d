"""Suite-wide pytest hooks: tests marked ``gpu`` are skipped on machines without CUDA, and on
those machines Triton runs in its interpreter (which must be switched on before triton is first
imported, by whichever test gets there first). A server started without ``--state-dir`` keeps
its registry in a directory of this run, never the user's."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

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
