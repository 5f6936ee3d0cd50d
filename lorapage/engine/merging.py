"""A dedicated deployment: one adapter version merged into the engine's weights
(:meth:`Engine.merge_into_base <lorapage.engine.engine.Engine.merge_into_base>`), and the rules
for requests on such an engine."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import Executor
from contextlib import AsyncExitStack
from typing import Any

import torch

from lorapage.adapters.cache import AdapterEntry
from lorapage.adapters.loader import content_digest
from lorapage.adapters.peft_format import at_path, load_adapter_tensors, read_weights
from lorapage.errors import AdapterLoadError, AdapterNotFoundError, ConflictError
from lorapage.sources.version_files import VersionFiles


class MergedWeights:
    """Which version the weights hold (None: the plain base), whether a merge is under way, and
    what its equivalence check found (:mod:`lorapage.engine.merge_check`)."""

    def __init__(self) -> None:
        self.adapter: str | None = None
        self.merging = False  # new requests are refused while the weights change
        self.check: Mapping[str, Any] | None = None

    def check_weights(self, merged: str | None) -> None:
        """Refuse (409) a request that would run while the weights change, or whose route was
        decided before they did (``merged``: the merged version it saw)."""
        if self.merging or self.adapter != merged:
            raise ConflictError("an adapter is being merged into this engine's weights; retry once it is done")

    def check_route(self, adapter: str | None) -> None:
        """A dedicated deployment serves its merged version (on the plain base path) and nothing else."""
        if adapter == self.adapter:
            return
        merged_id = self.adapter.partition("@")[0] if self.adapter else ""
        asked = "the base model" if adapter is None else f"adapter {adapter!r}"
        raise AdapterNotFoundError(
            f"this server is a dedicated deployment of adapter {merged_id!r} (merged into the base weights): it "
            f"serves only model {merged_id!r}, not {asked}",
            param="model",
        )


async def merge_tensors(
    key: str, entry: AdapterEntry, files: VersionFiles, io: Executor
) -> tuple[dict, dict[tuple[int, str], float]]:
    """A version's A and B in float32 and its scales, read from its files (as the loader
    does) and checked against its registered digest."""
    loop = asyncio.get_running_loop()
    if not entry.spec.variants.plain:  # merge_adapter folds A / B only: a variant would be served wrong
        raise AdapterLoadError(
            f"adapter {key!r} has PEFT variants (DoRA, lora_bias, embedding LoRA or modules_to_save) that a merged "
            "deployment does not fold into the base; serve it unmerged on the shared pool"
        )
    async with AsyncExitStack() as held:
        spec = entry.spec
        if entry.origin.source:  # a fetched copy, as the loader reads it (lorapage.adapters.loader)
            origin = entry.origin
            path = await held.enter_async_context(files.locate(origin.source, entry.digest, origin.owner))
            spec = at_path(spec, path)
        weights = await loop.run_in_executor(io, read_weights, spec)
        if entry.digest and await loop.run_in_executor(io, content_digest, spec, weights) != entry.digest:
            raise AdapterLoadError(f"adapter {key!r}: its files changed since registration; register it again")
        tensors = await loop.run_in_executor(io, load_adapter_tensors, spec, torch.float32, weights)
    return tensors, spec.scales
