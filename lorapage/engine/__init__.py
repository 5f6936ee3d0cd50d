"""The embedded engine: :class:`Engine` is the face; the step scheduler and step loop sit behind it."""

from lorapage.engine.engine import Engine

__all__ = ["Engine"]
