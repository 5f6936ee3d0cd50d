"""lorapage.configure_threads: the command's OpenMP settings for an embedding program, set before
torch loads libgomp, and a warning when it is called too late to matter."""

import os
import subprocess
import sys

from lorapage.omp_env import SPINCOUNT, SPINCOUNT_ENV, THREADS_ENV


def run_script(script: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in (SPINCOUNT_ENV, THREADS_ENV)}
    return subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # the checkout's top-level kernels/ must not shadow anything
        env={**clean, **env},
    )


BEFORE_TORCH = """
import os, sys
import lorapage
assert "torch" not in sys.modules
took = lorapage.configure_threads(1)
import torch
print(took, os.environ["GOMP_SPINCOUNT"], os.environ["OMP_NUM_THREADS"], torch.get_num_threads())
"""


def test_configure_threads_sets_the_environment_before_torch_loads():
    done = run_script(BEFORE_TORCH)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", SPINCOUNT, "1", "1"]


def test_an_operators_spin_count_wins():
    done = run_script(BEFORE_TORCH, GOMP_SPINCOUNT="123")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:2] == ["True", "123"]


AFTER_TORCH = """
import warnings, torch, lorapage
from lorapage.omp_env import ThreadsConfiguredTooLate
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    took = lorapage.configure_threads(1)
assert took is False
assert [w.category for w in caught] == [ThreadsConfiguredTooLate], caught
assert "before importing torch" in str(caught[0].message)
assert torch.get_num_threads() == 1  # the thread count still applies: torch sets it at any time
print("ok")
"""


def test_configure_threads_warns_after_torch_loaded():
    done = run_script(AFTER_TORCH)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
