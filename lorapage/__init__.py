"""lorapage: one base LLM and thousands of LoRA adapters in one process.

The embedded API::

    import lorapage
    lorapage.configure_threads()  # first, before torch loads: the command's OpenMP spin
    from lorapage import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(model="path/to/hf_dir"))
    engine.add_adapter("acme", "path/to/peft_dir")
    async for out in engine.generate("Hello", adapter="acme", sampling=SamplingParams(max_tokens=16)):
        print(out.delta_text, end="")
"""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.config import EngineConfig as EngineConfig
    from lorapage.engine import Engine as Engine
    from lorapage.heap import freeze_gc_heap as freeze_gc_heap
    from lorapage.omp_env import configure_threads as configure_threads, release_thread_team as release_thread_team
    from lorapage.request import RequestOutput as RequestOutput
    from lorapage.sampling_params import SamplingParams as SamplingParams

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "Engine": "lorapage.engine",
        "EngineConfig": "lorapage.config",
        "SamplingParams": "lorapage.sampling_params",
        "RequestOutput": "lorapage.request",
        "configure_threads": "lorapage.omp_env",
        "freeze_gc_heap": "lorapage.heap",
        "release_thread_team": "lorapage.omp_env",
    },
)
