"""lorapage: one base LLM and thousands of LoRA adapters in one process.

The embedded API::

    from lorapage import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(model="path/to/hf_dir"))
    engine.add_adapter("acme", "path/to/peft_dir")
    async for out in engine.generate("Hello", adapter="acme", sampling=SamplingParams(max_tokens=16)):
        print(out.delta_text, end="")
"""

from lorapage.config import EngineConfig
from lorapage.engine import Engine
from lorapage.request import RequestOutput
from lorapage.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput"]
