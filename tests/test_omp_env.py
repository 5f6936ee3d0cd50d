"""lorapage.configure_threads: the command's OpenMP settings for an embedding program, set before
torch loads libgomp, and a warning when it is called too late to matter."""

import os
import subprocess
import sys

import pytest

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


# Both scripts below: 2 intra-op threads, ``workers()`` the threads started outside Python (libgomp's
# workers among them), and a stop where torch runs another OpenMP runtime.
TEAMS_PRELUDE = """
import os, sys, threading, time
import lorapage
lorapage.configure_threads(2)
from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.omp_env import TeamlessPool, _openmp_runtime

def workers():
    python = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python

if _openmp_runtime() is None or "libgomp" not in _openmp_runtime()._name:
    print("no-libgomp")
    sys.exit(0)
"""

ONE_TEAM = (
    TEAMS_PRELUDE
    + """
from concurrent.futures import ThreadPoolExecutor
import torch

def product():
    return torch.randn(512, 512) @ torch.randn(512, 512)  # a parallel region on 2 threads

start = workers()
product()
mine = workers() - start  # the calling thread's team
plain, teamless = ThreadPoolExecutor(1), TeamlessPool(1)
before = workers()
plain.submit(product).result()
kept_by_plain = workers() - before
before = workers()
teamless.submit(product).result()
kept_by_teamless = workers() - before
engine = Engine(EngineConfig(num_threads=2))
threads = engine.debug.threads
print(len(mine), len(mine & workers()), len(kept_by_plain), len(kept_by_teamless),
      isinstance(threads.io, TeamlessPool), isinstance(threads.copies, TeamlessPool))
"""
)


def test_the_engine_leaves_one_openmp_team_the_forwards():
    """libgomp spins a worker for GOMP_SPINCOUNT only while its workers number no more than the
    CPUs: the thread that built the engine gives its team back, and the I/O and copy threads (a
    TeamlessPool) keep none after a task, where a plain thread pool's thread keeps one."""
    done = run_script(ONE_TEAM)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.strip() == "no-libgomp":
        pytest.skip("torch here runs another OpenMP runtime (libgomp's throttle is what this guards)")
    mine, kept, plain, teamless, io, copies = done.stdout.split()
    assert (int(mine), int(kept)) == (1, 0)  # the caller's team ended once the engine was built
    assert (int(plain), int(teamless)) == (1, 0)
    assert io == copies == "True"


TWO_ENGINES = (
    TEAMS_PRELUDE
    + """
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

def engine():
    e = Engine(EngineConfig(model=str(TINY_BASE_DIR), num_threads=2, max_loras=2, max_lora_rank=64))
    for name, path in list(demo_adapter_dirs().items())[:2]:
        e.add_adapter(name, path)
    return e

first, second = engine(), engine()
names = list(demo_adapter_dirs())[:2]
rows = [([1, 5, 9, 14, 3], names[i % 2]) for i in range(4)]  # token ids: no tokenizer threads
params = SamplingParams(max_tokens=4, temperature=0.0)

def settled():
    deadline = time.monotonic() + 10  # the release runs on the forward thread just after the call
    while workers() - start and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(workers() - start)

first.generate_batch(rows, params)
time.sleep(0.5)
start = workers()  # whatever the first call started for good; its team, too, if it kept one
left = []
for e in (second, first, second):
    e.generate_batch(rows, params)
    left.append(settled())
print(*left)
"""
)


def test_an_engine_used_through_generate_batch_gives_its_team_back_between_calls():
    """Each ``generate_batch`` runs the step loop on an event loop of its own, which ends with the
    call: the forward's team must end with it, or a second engine's forward in the same process
    (the llama.cpp bench's float32 and w8a8) runs beside a live team and libgomp throttles both."""
    done = run_script(TWO_ENGINES)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.strip() == "no-libgomp":
        pytest.skip("torch here runs another OpenMP runtime (libgomp's throttle is what this guards)")
    assert done.stdout.split() == ["0", "0", "0"]
