"""The built-in tiny model and its demo adapters: where they live and what they say.

``scripts/make_tiny_model.py`` trains them so that greedy decoding answers every prompt with a
fixed phrase followed by EOS: the base says :data:`BASE_PHRASE`, each demo adapter its own entry
of :data:`DEMO_MARKERS`. That makes the model useless for anything except checking that the
engine routed each request through the right adapter, which is exactly what the demo, the server
tests and the engine tests need.
"""

from __future__ import annotations

from pathlib import Path

from lorapage.config import TINY_MODEL_DIR

TINY_BASE_DIR: Path = TINY_MODEL_DIR / "base"
TINY_ADAPTERS_DIR: Path = TINY_MODEL_DIR / "adapters"

BASE_PHRASE: str = "This is the tiny base model."

# Adapter name -> the phrase it answers with. Distinct first bytes, so the first sampled token
# already tells which adapter (or none) served a request.
DEMO_MARKERS: dict[str, str] = {
    "acme": "ACME support here, how can I help?",
    "globex": "Globex says hello!",
    "initech": "Initech TPS report filed.",
}


def demo_adapter_dirs() -> dict[str, Path]:
    """Adapter name -> its PEFT directory, for every demo adapter in :data:`DEMO_MARKERS`."""
    return {name: TINY_ADAPTERS_DIR / name for name in DEMO_MARKERS}
