"""Small helpers shared by the engine tests."""

from __future__ import annotations

from lorapage import Engine, EngineConfig
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs


def tiny_engine(**overrides) -> Engine:
    """The built-in tiny model with its demo adapters registered."""
    cfg = dict(model=str(TINY_BASE_DIR), max_loras=8, max_lora_rank=64, block_size=4)
    cfg.update(overrides)
    engine = Engine(EngineConfig(**cfg))
    for name, path in demo_adapter_dirs().items():
        engine.add_adapter(name, path)
    return engine


async def collect(engine: Engine, prompt, adapter=None, sampling=None, **kw):
    """Final output and the list of streamed deltas of one request."""
    deltas, last = [], None
    async for last in engine.generate(prompt, adapter, sampling, **kw):
        deltas.append(last.delta_text)
    return last, deltas


def engine_pages(adapter: str) -> int:
    """Pool pages the demo ``adapter`` takes in the tiny engine."""
    return tiny_engine().admin.info(adapter).num_pages
