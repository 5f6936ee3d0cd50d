"""Base upgrades: the behavioural-drift check an adapter passes before it moves to a new base."""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.bases.drift import (
        DriftReport as DriftReport,
        DriftThresholds as DriftThresholds,
        PromptDrift as PromptDrift,
        prompt_drift as prompt_drift,
        verdict as verdict,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "DriftReport": "lorapage.bases.drift",
        "DriftThresholds": "lorapage.bases.drift",
        "PromptDrift": "lorapage.bases.drift",
        "prompt_drift": "lorapage.bases.drift",
        "verdict": "lorapage.bases.drift",
    },
)
