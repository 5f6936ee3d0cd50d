"""The work of a load: files -> a packed host copy (I/O threads), host copy -> pool pages (the device).

Nothing here decides anything: the residency rules (:mod:`lorapage.adapters.residency`) say what
to read and where to copy it, and :class:`~lorapage.adapters.cache.AdapterCache` calls this to do
it. Each stage is timed with a wall clock into :class:`~lorapage.adapters.value.ReloadCosts`
(the engine's injected clock may be virtual), which is what eviction ranks by.

A read checks the bytes it uses against the version's content digest (the bytes hashed are the
bytes used), so a changed file fails its own version's requests instead of serving other weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from lorapage.adapters.digest import bytes_digest
from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.pack_recipe import PackRecipe, PackRecipes, header_bytes
from lorapage.adapters.peft_format import (
    AdapterSpec,
    at_path,
    load_adapter_tensors,
    read_config_bytes,
    read_weights,
    read_weights_stamped,
)
from lorapage.adapters.safetensors_buffer import ReadBuffer, tensor_views
from lorapage.adapters.value import LoadTier, ReloadCosts, Stage
from lorapage.adapters.variant_layout import BaseWeight, VariantSection, load_variant_tensors, pack_section
from lorapage.adapters.verified import VerifiedFiles
from lorapage.errors import AdapterIntegrityError
from lorapage.memory.pool import PagePool
from lorapage.model.config import ModelConfig
from lorapage.model.lora_tables import LoraTables

# Where a version's files are read from: a block holding them fetched from their source (for the
# version's owner) and verified against the digest; (source URI, digest, owner).
Locate = Callable[[str, str, str | None], AbstractAsyncContextManager[Path]]


@dataclass(frozen=True)
class Origin:
    """Where a version's files come from: its source URI (empty: the directory its spec names)
    and the tenant that owns it (whose roots and download slots a read goes through)."""

    source: str = ""
    owner: str | None = None


class Readable(Protocol):
    """What a read needs of a version (:class:`~lorapage.adapters.cache.AdapterEntry`)."""

    name: str
    spec: AdapterSpec
    layout: AdapterLayout
    digest: str  # content digest the files must match when read ("" : not checked)
    origin: Origin


AdapterTensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class RankShards(Protocol):
    """Tensor parallelism's part in a load (:class:`lorapage.parallel.TensorParallelGroup`): each
    rank's shard of an adapter's matrices, and the other ranks' packed shards sent to them."""

    model: ModelConfig  # the whole base's
    base_weight: BaseWeight  # its whole weights (DoRA's norms), which no rank holds

    def split(self, tensors: AdapterTensors) -> list[AdapterTensors]: ...  # one per rank, rank 0 first

    def split_section(self, section: torch.Tensor, vectors: bool) -> list[torch.Tensor]: ...  # variant data, per rank

    def send_pages(self, layout: AdapterLayout, packed: torch.Tensor, slot: int, pages: list[int]) -> None: ...


class AdapterLoader:
    """Reads and packs versions in the I/O pool and copies them into pool pages on the device."""

    def __init__(
        self,
        pool: PagePool,
        tables: LoraTables,
        dtype: torch.dtype,
        costs: ReloadCosts,
        *,
        io_executor: Executor,
        run_on_device: Callable[[Callable[[], None]], Awaitable[None]],
        locate: Locate | None = None,
        timer: Callable[[], float] = time.perf_counter,
        base_weight: BaseWeight | None = None,
        ranks: RankShards | None = None,
    ) -> None:
        self.pool, self.tables, self.dtype, self.costs = pool, tables, dtype, costs
        self.io = io_executor
        self.run_on_device = run_on_device  # the copy's thread: the forward thread on CUDA, a copy thread on a CPU
        self.locate = locate  # None: files are read from the directory the spec names
        self.base_weight = base_weight  # the base's module weights, for DoRA's column norms (None: DoRA refused)
        self._timer = timer
        # Under tensor parallelism a packed copy is [ranks, layers, ...]: every rank's shard.
        self.ranks = ranks
        self._read_buffer = ReadBuffer()  # each I/O thread's, reused by every read it does
        self.finite_digests: set[str] = set()  # digests of bytes validation found finite in ``dtype``
        self.verified = VerifiedFiles()  # weights files hashed before that only this server's user can write
        self.recipes = PackRecipes()  # packs of files by header, as byte runs (pack_recipe.py)

    async def read(
        self, version: Readable, tier: LoadTier, downloaded: Callable[[], None] = lambda: None
    ) -> torch.Tensor:
        """Fetch (from its source, when a locator is set), read and pack ``version`` off the event
        loop; ``downloaded`` is called once a remote source's download is done. The stages are
        timed into :attr:`costs`."""
        loop = asyncio.get_running_loop()
        pages = version.layout.num_pages
        started = self._timer()
        if self.locate is None or not version.origin.source:
            packed = await loop.run_in_executor(self.io, self._read_and_pack, version, version.spec)
            self.costs.observe(Stage.READ, self._timer() - started, pages)
            return packed
        async with contextlib.AsyncExitStack() as held:  # a disk cache keeps the entry while it is read
            origin = version.origin
            path = await held.enter_async_context(self.locate(origin.source, version.digest, origin.owner))
            located = self._timer()
            if tier is LoadTier.REMOTE:
                downloaded()
            packed = await loop.run_in_executor(self.io, self._read_and_pack, version, at_path(version.spec, path))
        done = self._timer()
        if tier is LoadTier.REMOTE:  # located = downloaded; otherwise locating was part of reading
            self.costs.observe(Stage.DOWNLOAD, located - started, pages)
            started = located
        self.costs.observe(Stage.READ, done - started, pages)
        return packed

    async def copy_in(self, layout: AdapterLayout, packed: torch.Tensor, slot: int, pages: list[int]) -> float:
        """Copy ``packed`` into ``pages`` and point ``slot``'s table rows at them; the seconds it
        took, timed into :attr:`costs` (on CUDA that includes waiting behind the step in flight)."""
        started = self._timer()
        await self.run_on_device(lambda: self.write_pages(layout, packed, slot, pages))
        seconds = self._timer() - started
        self.costs.observe(Stage.COPY, seconds, len(pages))
        return seconds

    def write_pages(self, layout: AdapterLayout, packed: torch.Tensor, slot: int, pages: list[int]) -> None:
        """Host RAM -> pool pages, then the slot's table rows (runs on the device's thread); under
        tensor parallelism the other ranks' shards are sent to them first."""
        if self.ranks is not None:
            self.ranks.send_pages(layout, packed[1:], slot, pages)
            packed = packed[0]
        write_adapter_pages(self.pool, self.tables, layout, packed, slot, pages)

    def read_verified(self, spec: AdapterSpec, into: ReadBuffer | None = None) -> tuple[torch.Tensor, str]:
        """The weights file's bytes and the content digest of the directory as read: the sha256
        of those bytes, or, where a read of a file only this server's user can write found the
        same stamp before, the digest that read computed (:mod:`lorapage.adapters.verified`)."""
        config = read_config_bytes(spec.path)
        weights, stamp = read_weights_stamped(spec, into)
        digest = self.verified.digest_of(config, stamp)
        if digest is None:
            digest = bytes_digest({"adapter_config.json": config, spec.weights_file.name: weights.numpy().data})
            self.verified.remember(config, stamp, digest)
        return weights, digest

    def _read_and_pack(self, version: Readable, spec: AdapterSpec) -> torch.Tensor:
        """Read both files once, check them against the registered digest (the bytes hashed are
        the bytes used, or bytes a stamp shows unchanged since they were hashed), then parse and pack."""
        if version.digest:
            weights, got = self.read_verified(spec, self._read_buffer)
            if got != version.digest:
                raise AdapterIntegrityError(
                    f"adapter {version.name}: files in {spec.path} changed after registration (sha256 {got}, "
                    f"registered {version.digest}); register the new content as a new version"
                )
        else:
            weights = read_weights(spec, self._read_buffer)
        # Bytes that match a digest validation returned are bytes it found finite in this dtype.
        # A version restored from the registry was checked by an earlier process, perhaps in
        # another dtype (bfloat16 weights can overflow float16): its loads check again.
        finite = bool(version.digest) and version.digest in self.finite_digests
        layout = version.layout
        plain = self.ranks is None and layout.section is None and layout.experts is None and not layout.quantized
        header = header_bytes(weights) if plain else None
        if header is not None and (recipe := self.recipes.get(header, layout, weights.numel())) is not None:
            packed = recipe.pack(weights, self.dtype)
            if finite or bool(torch.isfinite(packed).all()):
                return packed  # else the full path below names the weight that is not finite
        tensors = load_adapter_tensors(spec, self.dtype, weights, check_finite=not finite)
        section = None
        if (plan := version.layout.section) is not None:
            extras = load_variant_tensors(spec.path, tensor_views(weights), spec.model)
            if self.ranks is not None:  # computed whole (DoRA's norms span the ranks), then split
                whole = VariantSection.plan(spec.variants, self.ranks.model, self.pool.adapter_page_size, 0)
                assert whole is not None
                plan = whole
            section = pack_section(
                plan, spec, tensors, extras, self.pool.adapter_page_size, self.base_weight, self.dtype
            )
        # Kept in pageable memory, not pinned: PyTorch's pinned allocator rounds blocks up to a
        # power of two (ATen/core/CachingHostAllocator.h) and caches freed ones, so max_cpu_loras
        # pinned adapters could hold up to twice their size in page-locked RAM for good. A pageable
        # copy to the GPU is slower per byte (the driver stages it), a few ms per 7B adapter
        # against a sub-second TTFT budget.
        if self.ranks is None:
            pieces = layout.pieces(tensors, self.pool.adapter_page_size, section)
            if header is not None and not self.recipes.known(header):
                self.recipes.put(header, PackRecipe.record(layout, pieces, weights))
            return layout.join(pieces)
        shards = self.ranks.split(tensors)
        if section is not None:
            sections: list[torch.Tensor | None] = [*self.ranks.split_section(section, spec.variants.has_vectors)]
        else:
            sections = [None] * len(shards)
        size = self.pool.adapter_page_size
        return torch.stack([version.layout.pack(t, size, sec) for t, sec in zip(shards, sections, strict=True)])


def write_adapter_pages(
    pool: PagePool, tables: LoraTables, layout: AdapterLayout, packed: torch.Tensor, slot: int, pages: list[int]
) -> None:
    """Copy a packed adapter [layers, pages * adapter page] into ``pages`` and point ``slot`` at them."""
    n, size = len(pages), pool.adapter_page_size
    src = packed.view(packed.shape[0], n, size)
    storage = pool.adapter_storage
    if pages[-1] - pages[0] == n - 1:
        storage[:, pages[0] : pages[0] + n].copy_(src, non_blocking=True)
    else:
        storage[:, torch.tensor(pages, device=storage.device)] = src.to(storage.device, non_blocking=True)
    tables.write_slot(slot, layout, pages)


def content_digest(spec: AdapterSpec, weights: torch.Tensor) -> str:
    """The content digest of ``spec``'s directory, over the weights' bytes as read (``weights``)."""
    config = read_config_bytes(spec.path)
    return bytes_digest({"adapter_config.json": config, spec.weights_file.name: weights.numpy().data})
