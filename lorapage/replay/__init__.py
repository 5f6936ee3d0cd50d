"""Load replay: traces in (synthetic, or imported from public production-trace formats), a
server or the embedded engine driven open- or closed-loop, latency by tenant and adapter tier,
goodput, fairness and server counters out, with plots. ``docs/replay.md`` describes it all."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.replay.driver import RunOptions as RunOptions, RunResult as RunResult, replay as replay
    from lorapage.replay.generator import GenConfig as GenConfig, generate as generate
    from lorapage.traces.records import Record as Record
    from lorapage.traces.trace import TraceRequest as TraceRequest, read_trace as read_trace, write_trace as write_trace

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "GenConfig": "lorapage.replay.generator",
        "Record": "lorapage.traces.records",
        "RunOptions": "lorapage.replay.driver",
        "RunResult": "lorapage.replay.driver",
        "TraceRequest": "lorapage.traces.trace",
        "generate": "lorapage.replay.generator",
        "read_trace": "lorapage.traces.trace",
        "replay": "lorapage.replay.driver",
        "write_trace": "lorapage.traces.trace",
    },
)
