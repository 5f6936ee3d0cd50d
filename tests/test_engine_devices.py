"""The engine's threads: on a CPU engine its I/O workers run below the forward's priority."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest
import torch
from engine_util import tiny_engine

from lorapage.engine.devices import IO_THREAD_NICENESS, io_thread


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are a Linux feature")
async def test_cpu_engine_io_threads_run_below_the_forward_thread():
    engine = tiny_engine()
    try:
        loop = asyncio.get_running_loop()
        forward = await loop.run_in_executor(engine._forward, _niceness)
        io = await loop.run_in_executor(engine._io, _niceness)
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
