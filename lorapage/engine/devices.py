"""The engine's device and dtype, from the config's names, and its threads."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lorapage.config import EngineConfig
from lorapage.omp_env import SPINCOUNT_ENV, TeamlessPool, spin_setting
from lorapage.tenancy.fair_workers import FairWorkers

log = logging.getLogger("lorapage.engine")

# Keyed by lorapage.config.DTYPE_NAMES (and int8, a lora_dtype only).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def resolve_device(name: str) -> torch.device:
    """The device for ``EngineConfig.device``; a CUDA device always carries its index, so the
    forward thread and graph capture can be bound to it (a new thread starts on cuda:0)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"EngineConfig.device={name!r} but no CUDA device is available; use 'auto' or 'cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def bind_thread(device: torch.device) -> None:
    """Make ``device`` current in a worker thread: Triton launches on the thread's current device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def forward_thread(device: torch.device, threads: int) -> None:
    """Initializer of the forward thread: its device, and ``threads`` intra-op threads (torch keeps
    the count per thread: OpenMP's and MKL's settings are the calling thread's)."""
    bind_thread(device)
    torch.set_num_threads(threads)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def forward_thread_count(configured: int | None, device: torch.device) -> int:
    """Intra-op threads of the forward: ``configured`` when given; else torch's setting, which
    OMP_NUM_THREADS or ``torch.set_num_threads`` decide and otherwise is its count of cores; on a
    CPU never more than the cores this process may run on (a container's CPU set can be smaller
    than the machine torch counted, and a thread without a core stalls every parallel region)."""
    if configured is not None:
        return configured
    threads = torch.get_num_threads()
    return min(threads, usable_cores()) if device.type == "cpu" else threads


# I/O threads of a CUDA engine when the config names no number (its forward mostly waits on the
# GPU, so reads of several adapters and prefetches beside them overlap), and the most a CPU
# engine starts.
MAX_IO_THREADS = 4


def io_thread_count(configured: int | None, device: torch.device, forward_threads: int) -> int:
    """Threads of the engine's I/O pool: ``configured`` when given; else ``MAX_IO_THREADS`` on
    CUDA, and on a CPU the cores the forward's ``forward_threads`` leave free (at least 2, at most 4).

    On a CPU more I/O threads than free cores only take turns with the forward: in the S-LoRA
    replay on 2 cores (forward at 1 thread, 2,000 adapters) the forward thread waited 1.8-1.9 s
    runnable with 4 I/O threads and 0.14-0.19 s with 1, of a 36-40 s pass (bench/RESULTS.md).
    Never fewer than 2: on a CPU the copies into the pool run here too, so with one thread a
    read stuck on a slow file would hold up every other adapter's load.
    """
    if configured is not None:
        return configured
    if device.type != "cpu":
        return MAX_IO_THREADS
    return max(2, min(MAX_IO_THREADS, usable_cores() - forward_threads))


def wants_lora_side(configured: bool | None, device: torch.device, num_threads: int | None, ranks: int) -> bool:
    """Whether an engine runs its LoRA updates on a side thread (kernels/lora_side.py): ``configured``
    (``lora_side_thread``) when given, on a CPU with one device; by default where the forward's
    intra-op threads leave a core free."""
    if device.type != "cpu" or ranks > 1:
        return False
    if configured is not None:
        return configured
    return forward_thread_count(num_threads, device) < usable_cores()


# How much lower the I/O threads run than the forward on a CPU engine (Linux nice steps). On a
# CPU the forward is the throughput; file reads, digests and copies are background work, and
# `io_threads` of them at once would otherwise take turns with it on the same cores.
IO_THREAD_NICENESS = 5


def io_thread(device: torch.device) -> None:
    """Initializer of an I/O worker: on a CPU engine under Linux, lower this thread's scheduling
    priority (``setpriority`` on its thread id). On CUDA the forward mostly waits on the GPU and
    the I/O threads keep their priority."""
    if device.type == "cpu" and sys.platform == "linux":
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + IO_THREAD_NICENESS)
        except OSError:  # a sandbox that refuses it: run at the process's priority
            pass


def shorten_switch_interval(seconds: float | None) -> None:
    """Make CPython's thread switch interval at most ``seconds`` for this process (None: leave it).

    The forward thread gives the GIL up at every torch op and C kernel call (~400 a decode step
    of the bench model) and must take it back to dispatch the next. While another thread runs
    Python (the event loop scheduling and streaming, an I/O thread parsing a file), CPython makes
    it wait up to the switch interval, 5 ms by default, each time. A forward beside a thread busy
    with Python 40% of the time took 28 ms a step at 5 ms against 24.5 ms at 0.5 ms (18 ms
    alone). In the S-LoRA replay, whose 2,000-adapter case keeps the I/O threads parsing and
    packing ~137 adapters a pass, the 2,000 case ran 6% faster at 0.5 ms, and the 5 case as
    before (bench/RESULTS.md, round 2, session 8). Process-wide, and never raised: an embedding
    application that set a shorter one keeps it.
    """
    if seconds is not None and sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)


@dataclass(frozen=True)
class Threads:
    """The engine's executors: one forward thread, file reads (I/O), tokenizing, grammars and,
    on a CPU, adapter copies."""

    forward: ThreadPoolExecutor
    io: ThreadPoolExecutor
    tokenize: ThreadPoolExecutor
    grammar: FairWorkers
    copies: ThreadPoolExecutor | None
    forward_threads: int  # intra-op threads of the forward pass
    io_threads: int

    async def run_on_device(self, fn: Callable[[], None]) -> None:
        """Run an adapter's copy into its pages. On CUDA it queues on the forward thread, ordered
        with the steps on one stream (and between graph replays). On a CPU there is no stream, and
        the copy writes only pages and a slot reserved for its load, which no step reads until
        the load is done. So it runs on the copy thread beside the step in flight rather than
        behind it, which would add up to a whole step to every cold request's wait."""
        await asyncio.get_running_loop().run_in_executor(self.copies or self.forward, fn)

    def shutdown_workers(self) -> None:
        """Stop every thread but the forward one (the engine drains that one first)."""
        self.io.shutdown(wait=False, cancel_futures=True)
        self.tokenize.shutdown(wait=False, cancel_futures=True)
        self.grammar.close()
        if self.copies is not None:
            self.copies.shutdown(wait=False, cancel_futures=True)


GRAMMAR_THREADS = 2  # one tenant holds at most one of them (FairWorkers: threads - 1 each)


def build_threads(config: EngineConfig, device: torch.device, tensor_parallel_size: int) -> Threads:
    """The engine's executors, sized from ``config`` and the cores the forward leaves free."""
    shorten_switch_interval(config.gil_switch_interval_s)  # the forward thread re-takes the GIL after each op
    forward_threads = forward_thread_count(config.num_threads, device)
    if device.type == "cpu":  # the ranks' forwards run at once: they share the cores
        forward_threads = max(1, forward_threads // tensor_parallel_size)
    io_threads = io_thread_count(config.io_threads, device, forward_threads)
    threads = Threads(
        forward=ThreadPoolExecutor(
            1, thread_name_prefix="lorapage-forward", initializer=forward_thread, initargs=(device, forward_threads)
        ),
        io=TeamlessPool(io_threads, thread_name_prefix="lorapage-io", initializer=io_thread, initargs=(device,)),
        # Prompts are tokenized apart from file reads: with every I/O thread stuck on a slow
        # file, a text request for a resident adapter (or the base) must still get in.
        tokenize=ThreadPoolExecutor(io_threads, thread_name_prefix="lorapage-tokenize"),
        # Structured output: grammars compile on threads of their own, never behind prompts, in
        # the tenants' turns; a spare thread (two at most) covers each compile past its deadline.
        grammar=FairWorkers(GRAMMAR_THREADS, name="lorapage-grammar", max_spare=GRAMMAR_THREADS),
        # On a CPU the copies into the pool get a thread of their own: queued behind file reads
        # on the I/O pool, a load whose read was done waited for every read queued after it (the
        # S-LoRA replay: a wave of ten cold adapters all became resident together, ~0.5 s in,
        # instead of one by one from ~70 ms). A copy is ~1 ms; the forward's priority.
        copies=TeamlessPool(1, thread_name_prefix="lorapage-copy") if device.type == "cpu" else None,
        forward_threads=forward_threads,
        io_threads=io_threads,
    )
    log.info(
        "threads: forward %d intra-op (%s), %d I/O, %d tokenizer; %d usable cores; %s %s",
        forward_threads,
        "num_threads" if config.num_threads is not None else "torch's setting",
        io_threads,
        io_threads,
        usable_cores(),
        SPINCOUNT_ENV,
        spin_setting(),  # what lets 2+ threads beat one (lorapage.omp_env)
    )
    if device.type == "cpu" and forward_threads > 1 and SPINCOUNT_ENV not in os.environ:
        log.warning(
            "%s unset with %d forward threads: most parallel regions wait for a sleeping OpenMP worker; "
            "call lorapage.configure_threads() before importing torch (docs/benchmarks.md)",
            SPINCOUNT_ENV,
            forward_threads,
        )
    return threads
