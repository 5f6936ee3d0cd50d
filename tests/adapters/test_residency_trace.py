"""One trace through the embedded engine and through the fleet simulator's replica: both drive the
same residency rules (lorapage.adapters.residency), so they make the same decisions, event by event.

The engine runs a closed loop on an injected clock that stands still while a request runs and
jumps between requests, and each request (and the prefetches it starts) ends before the next is
sent; the simulator gets the same arrivals on its virtual clock, far enough apart that each
request ends before the next too. So what decides is the rules alone, not how fast this machine
is. Within one request's turn, a copy and a prefetch finish in whichever order the threads
allow, so each turn's events are compared as a set. Host RAM holds one packed copy, so at every
eviction both idle adapters fall to disk and their recent request rates alone decide: the
engine's measured reload costs and the simulator's cost model cannot rank them otherwise (the
test checks that premise by running the simulator with cost ratios far apart).
"""

from __future__ import annotations

import asyncio
import dataclasses

from engine_util import collect

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.adapters.decisions import Decision, Evict, Load, Read
from lorapage.adapters.residency import HistoryEntry
from lorapage.sim.costs import GPU_7B, LoadCosts
from lorapage.sim.fleet import Replica, SimFleetConfig
from lorapage.sim.loader import ResidencyConfig
from lorapage.sim.simulator import SimConfig, SimRequest
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

PROMPT = [5, 9, 12, 30]
MAX_TOKENS = 2
GAP_S = 60.0  # between requests: one rate half-life, well inside the ten minutes a tenant's recent adapters count

# (tenant, adapter or None for the base model), one every GAP_S.
TRACE: list[tuple[str, str | None]] = [
    ("t1", "acme"),
    ("t1", "globex"),
    ("t1", "initech"),  # no free slot: acme, the least used, leaves
    ("t2", "acme"),
    ("t1", "initech"),  # resident: t1's recent globex is prefetched into host RAM
    ("t1", "globex"),  # a host-RAM hit
    ("t2", "acme2"),  # t2's recent acme waits to be prefetched until acme2's read is done
    ("t2", "acme"),  # a host-RAM hit again
    ("t3", None),
    ("t3", "globex2"),
]
EXTRA = {"acme2": "acme", "globex2": "globex"}  # more versions over the demo adapters' files


class Clock:
    """The engine's clock, moved by the test between requests."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_turns(clock: Clock) -> tuple[list[HistoryEntry], dict[str, int]]:
    cfg = EngineConfig(
        model=str(TINY_BASE_DIR),
        max_loras=2,
        max_resident_loras=2,
        max_cpu_loras=1,
        max_lora_rank=64,
        block_size=4,
        io_threads=3,  # two prefetches at once, as the simulator is told
        enable_prefix_caching=False,
    )
    engine = Engine(cfg, clock=clock)
    dirs = demo_adapter_dirs()
    for name, path in {**dirs, **{n: dirs[like] for n, like in EXTRA.items()}}.items():
        engine.add_adapter(name, path)
    pages = {info.name.partition("@")[0]: info.num_pages for info in engine.admin.served()}

    async def run() -> None:
        try:
            for tenant, adapter in TRACE:
                clock.now += GAP_S
                out, _ = await collect(
                    engine, PROMPT, adapter, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), tenant=tenant
                )
                assert out.finish_reason == "length"
                for _ in range(2000):  # the prefetches this request started end in its turn
                    if not engine.debug.residency.loads.loading() and not engine.debug.residency.prefetch.running:
                        break
                    await asyncio.sleep(0.005)
        finally:
            await engine.close()

    asyncio.run(run())
    assert engine.stats().adapter_prefetches_failed == 0
    return list(engine.debug.residency.history), pages


def simulator_turns(pages: dict[str, int], loads: LoadCosts = GPU_7B.loads) -> list[HistoryEntry]:
    config = SimFleetConfig(
        replicas=1,
        engine=SimConfig(max_num_seqs=8, max_num_batched_tokens=2048),
        residency=ResidencyConfig(max_resident_loras=2, max_cpu_loras=1, pages=pages, max_prefetches=2),
        costs=dataclasses.replace(GPU_7B, loads=loads),
    )
    replica = Replica("r0", config)
    for i, (tenant, adapter) in enumerate(TRACE):
        replica.sim.submit(SimRequest(str(i), tenant, adapter, 1000.0 + (i + 1) * GAP_S, len(PROMPT), MAX_TOKENS))
    replica.sim.run()
    return list(replica.residency.rules.history)


def _decision(d: Decision) -> tuple:
    """What must agree: the kind, the version and the slot or tier (not page ids: the engine's
    pool also holds KV blocks, the simulator's adapters alone)."""
    key = d.key.partition("@")[0]
    if isinstance(d, Load | Evict):
        return type(d).__name__, key, d.slot
    if isinstance(d, Read):
        return type(d).__name__, key, d.tier.value
    return type(d).__name__, key


def turns(history: list[HistoryEntry]) -> list[list[tuple]]:
    """The events that decided something, one group per request (a turn starts at an arrival
    that decided something; a request whose adapter was resident may decide nothing), each
    group as a sorted list."""
    out: list[list[tuple]] = []
    for event, key, decisions in history:
        entry = (event, key.partition("@")[0], tuple(_decision(d) for d in decisions))
        if event == "enqueue" or not out:
            out.append([])
        out[-1].append(entry)
    return [sorted(group) for group in out]


def test_engine_and_simulator_make_the_same_residency_decisions():
    engine_history, pages = engine_turns(Clock())
    simulated = turns(simulator_turns(pages))
    engine = turns(engine_history)
    assert engine == simulated
    kinds = {d[0] for group in engine for _, _, decisions in group for d in decisions}
    assert {"Read", "Load", "Evict", "DropHost", "Prefetch", "Ready"} <= kinds, kinds
    reads = {d[2] for group in engine for _, _, decisions in group for d in decisions if d[0] == "Read"}
    assert reads == {"disk", "ram"}  # the prefetched adapters were host-RAM hits
    # The premise: no eviction here depends on what a reload costs, so the engine's measured
    # costs (seconds per page of a copy and of a read) cannot decide otherwise than the model's.
    disk_s = GPU_7B.loads.disk_s
    for ratio in (1.5, 1000.0):  # (read + copy) / copy
        loads = LoadCosts(remote_s=GPU_7B.loads.remote_s, disk_s=disk_s, copy_s=disk_s / (ratio - 1))
        assert turns(simulator_turns(pages, loads)) == simulated, ratio
