"""The embedded engine: :class:`Engine` is the face; the step scheduler and step loop sit behind it."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.engine.engine import Engine as Engine
    from lorapage.engine.stats import EngineStats as EngineStats

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "Engine": "lorapage.engine.engine",
        "EngineStats": "lorapage.engine.stats",
    },
)
