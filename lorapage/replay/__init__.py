"""Load replay: traces in (synthetic, or imported from public production-trace formats), a
server or the embedded engine driven open- or closed-loop, latency by tenant and adapter tier,
goodput, fairness and server counters out, with plots. ``docs/replay.md`` describes it all."""

from lorapage.replay.driver import RunOptions, RunResult, replay
from lorapage.replay.generator import GenConfig, generate
from lorapage.replay.records import Record
from lorapage.replay.trace import TraceRequest, read_trace, write_trace

__all__ = [
    "GenConfig",
    "Record",
    "RunOptions",
    "RunResult",
    "TraceRequest",
    "generate",
    "read_trace",
    "replay",
    "write_trace",
]
