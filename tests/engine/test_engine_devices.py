"""The engine's threads: how many I/O workers it starts, on a CPU engine they run below the
forward's priority, and the GIL switch interval the forward thread gets."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest
import torch
from engine_util import tiny_engine

from lorapage.engine.build import MAX_PREFETCHES
from lorapage.engine.devices import (
    IO_THREAD_NICENESS,
    MAX_IO_THREADS,
    forward_thread_count,
    io_thread,
    io_thread_count,
    shorten_switch_interval,
)


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are a Linux feature")
async def test_cpu_engine_io_threads_run_below_the_forward_thread():
    engine = tiny_engine()
    try:
        loop = asyncio.get_running_loop()
        forward = await loop.run_in_executor(engine.debug.threads.forward, _niceness)
        io = await loop.run_in_executor(engine.debug.threads.io, _niceness)
        assert forward == _niceness()  # the forward keeps the process's priority
        assert io == min(forward + IO_THREAD_NICENESS, 19)  # Linux stops nice values at 19
    finally:
        await engine.close()


def test_io_thread_leaves_a_cuda_engines_workers_at_the_process_priority():
    seen: list[int] = []

    def worker() -> None:
        io_thread(torch.device("cuda", 0))  # needs no GPU: it only decides whether to lower
        seen.append(_niceness())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [_niceness()]


def test_io_thread_count_is_the_configs_else_the_cores_a_cpu_forward_leaves_free(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert io_thread_count(3, cpu, 2) == 3 and io_thread_count(3, cuda, 2) == 3  # as configured
    assert io_thread_count(None, cuda, 2) == MAX_IO_THREADS
    cores = {"n": 2}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores["n"])), raising=False)
    for n, forward, want in ((2, 1, 2), (2, 2, 2), (8, 2, 4), (8, 5, 3), (16, 1, 4)):
        cores["n"] = n
        assert io_thread_count(None, cpu, forward) == want, (n, forward)


def test_forward_threads_are_the_configs_else_torchs_within_the_usable_cores(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert forward_thread_count(3, cpu) == 3 and forward_thread_count(3, cuda) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # torch counted the machine, not the CPU set
    assert forward_thread_count(None, cpu) == 2
    assert forward_thread_count(None, cuda) == 8
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # OMP_NUM_THREADS=1
    assert forward_thread_count(None, cpu) == 1


async def test_a_cpu_engine_starts_the_threads_it_counted():
    engine = tiny_engine(num_threads=1)
    try:
        assert engine.debug.forward_threads == 1
        assert (
            await asyncio.get_running_loop().run_in_executor(engine.debug.threads.forward, torch.get_num_threads) == 1
        )
        assert engine.debug.io_threads == io_thread_count(None, torch.device("cpu"), 1)
        assert engine.debug.threads.io._max_workers == engine.debug.io_threads
        assert engine.debug.residency.limits.max_prefetches == min(MAX_PREFETCHES, engine.debug.io_threads - 1)
    finally:
        await engine.close()


@pytest.fixture
def switch_interval():
    """The process's switch interval, put back after the test."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


async def test_an_engine_shortens_the_gil_switch_interval_and_never_lengthens_it(switch_interval):
    sys.setswitchinterval(0.005)  # CPython's default
    await tiny_engine(gil_switch_interval_s=0.001).close()
    assert sys.getswitchinterval() == pytest.approx(0.001)
    await tiny_engine(gil_switch_interval_s=0.002).close()  # longer than the process's now: left as it is
    assert sys.getswitchinterval() == pytest.approx(0.001)
    sys.setswitchinterval(0.005)
    await tiny_engine(gil_switch_interval_s=None).close()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    shorten_switch_interval(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
