"""The embedded engine: :class:`Engine` is the face, :class:`AdapterAdmin` (``engine.admin``) its adapter
administration; the step planner and step loop sit behind it."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.engine.admin import AdapterAdmin as AdapterAdmin
    from lorapage.engine.engine import Engine as Engine
    from lorapage.engine.stats import EngineMetrics as EngineMetrics, EngineStats as EngineStats

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "AdapterAdmin": "lorapage.engine.admin",
        "Engine": "lorapage.engine.engine",
        "EngineMetrics": "lorapage.engine.stats",
        "EngineStats": "lorapage.engine.stats",
    },
)
