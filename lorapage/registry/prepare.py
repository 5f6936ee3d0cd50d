"""The first two steps of registering a version: prepare (fetch its files from a source) and
check (read them whole against this engine: format, shapes, finite weights, the base it was
trained on, the shared envelope, the pool). What comes out is a :class:`Checked` adapter that the
catalog stores and announces (:class:`~lorapage.registry.catalog.AdapterCatalog`), or a
:class:`PreparedVersion` that a registry held elsewhere (a fleet's, or another base's engine's)
stores. Nothing here writes to a registry or to the cache.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from lorapage.adapters.binding import BaseBinding
from lorapage.adapters.cache import AdapterCache
from lorapage.adapters.digest import digest_param, normalize_digest
from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.adapters.peft_variants import variants_from_json, variants_to_json
from lorapage.errors import AdapterFormatError, AdapterIntegrityError, InvalidRequestError
from lorapage.model.config import ModelConfig
from lorapage.registry.store import Registry, VersionRow
from lorapage.sources import AdapterRoots, AdapterSources, FileSource, parse_source

REGISTRATION_TIMEOUT_S = 30.0  # reading and checking one adapter may take this long


@dataclass(frozen=True)
class Checked:
    """An adapter directory read and checked against this engine (its base, envelope and pool)."""

    spec: AdapterSpec
    layout: AdapterLayout
    digest: str  # the content digest of the bytes checked (loads verify against it)


@dataclass(frozen=True)
class PreparedVersion:
    """An adapter fetched, checked and digested, committed nowhere yet: what a registry held
    elsewhere (the fleet's, :mod:`lorapage.fleet.registry`) stores as a version."""

    source: str  # canonical source URI
    digest: str
    base_digest: str
    spec: str  # spec_to_json
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    projected_cost_pct: float  # at the preparing engine's reference batch

    def store(
        self, registry: Registry, adapter_id: str, owner: str | None, *, activate: bool, actor: str | None
    ) -> VersionRow:
        """Commit it to ``registry`` as a new version of ``adapter_id`` (a blocking SQLite write)."""
        return registry.add_version(
            adapter_id,
            owner,
            digest=self.digest,
            source=self.source,
            base_digest=self.base_digest,
            spec=self.spec,
            activate=activate,
            projected_cost_pct=self.projected_cost_pct,
            actor=actor,
        )


class VersionPreparer:
    """Fetches an adapter from a source an owner may read and checks it against this engine."""

    def __init__(
        self,
        cache: AdapterCache,
        binding: BaseBinding,
        sources: AdapterSources,
        *,
        roots: AdapterRoots,
        download_cache: str | None,
        base_digest: Callable[[], str],
        io_executor: Executor,
        check_open: Callable[[], None],
    ) -> None:
        """``binding``: how a check tells the base an adapter was trained on; ``download_cache``:
        where remote sources land (None: directories only); ``check_open`` refuses once the
        engine is closed."""
        self.roots = roots
        """The directories each owner's versions may be read from."""
        self._cache, self._binding, self._sources = cache, binding, sources
        self._download_cache, self._base_digest, self._io = download_cache, base_digest, io_executor
        self._check_open = check_open

    @asynccontextmanager
    async def fetched(
        self, source: str | Path, sha256: str | None, owner: str | None
    ) -> AsyncIterator[tuple[str, Path]]:
        """``source`` (a directory ``owner`` may read, or a ``file://``, ``https://``, ``s3://``,
        ``hf://`` URI; see :mod:`lorapage.sources`) fetched and verified against ``sha256``
        when given: its canonical URI and its directory, held while in use."""
        src = await asyncio.to_thread(parse_source, str(source), sha256=sha256, roots=self.roots, owner=owner)
        if not isinstance(src, FileSource) and self._download_cache is None:
            raise InvalidRequestError(
                f"adapter source {src.uri}: this engine has no disk cache for downloads; start the server with "
                "--state-dir or --adapter-cache-dir (EngineConfig.state_dir / adapter_cache_dir)",
                param="source",
            )
        async with self._sources.use(src, normalize_digest(sha256) if sha256 else None, owner) as path:
            yield src.uri, path

    def check(
        self, path: Path, *, sha256: str | None = None, expected_base_digest: str | None = None, envelope: bool = True
    ) -> Checked:
        """Read and check an adapter directory (any thread); refuses a digest other than
        ``sha256``, an adapter not trained on the running base (``expected_base_digest``, else its
        metadata: see :class:`BaseBinding`) and, unless ``envelope`` is False, one outside the
        shared envelope."""
        running = self._base_digest()
        if expected_base_digest is not None:  # the caller's word: refused before any weight is read
            self._binding.bind(running, expected=expected_base_digest, trained_on=None)
        spec, layout, digest = self._cache.checks.validate(str(path), envelope=envelope)
        if sha256 is not None and digest_param(sha256, "sha256") != digest:
            raise AdapterIntegrityError(
                f"adapter at {path} has content digest {digest}, not the sha256 given ({sha256})", param="sha256"
            )
        self._binding.bind(running, expected=expected_base_digest, trained_on=spec.trained_on)
        return Checked(spec, layout, digest)

    async def check_in_worker(
        self,
        adapter_id: str,
        path: Path,
        *,
        sha256: str | None = None,
        expected_base_digest: str | None = None,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
        envelope: bool = True,
    ) -> Checked:
        """:meth:`check` in a worker thread, refused past ``timeout_s``."""
        work = asyncio.get_running_loop().run_in_executor(
            self._io,
            lambda: self.check(path, sha256=sha256, expected_base_digest=expected_base_digest, envelope=envelope),
        )
        try:
            return await asyncio.wait_for(work, timeout_s)
        except TimeoutError:
            raise AdapterFormatError(
                f"adapter {adapter_id!r} could not be read and checked within {timeout_s:g}s", param="path"
            ) from None

    async def prepare(
        self,
        source: str | Path,
        *,
        sha256: str | None = None,
        expected_base_digest: str | None = None,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
        owner: str | None = None,
        envelope: bool = True,
    ) -> PreparedVersion:
        """Fetch and check an adapter as a registration does (for ``owner``), committing it
        nowhere: the version a registry held elsewhere (a fleet's, or the primary engine's of a
        server running several bases) stores. ``envelope`` False: one outside the shared envelope
        is prepared too (tier ``dedicated``: a fleet serves it once promoted; this engine refuses
        its requests with the envelope's 400)."""
        self._check_open()
        async with self.fetched(source, sha256, owner) as (uri, path):
            checked = await self.check_in_worker(
                uri, path, sha256=sha256, expected_base_digest=expected_base_digest, timeout_s=timeout_s,
                envelope=envelope,
            )  # fmt: skip
        spec = checked.spec
        return PreparedVersion(
            source=uri,
            digest=checked.digest,
            base_digest=self._base_digest(),
            spec=spec_to_json(spec),
            rank=spec.max_rank,
            target_modules=spec.target_modules,
            size_bytes=spec.size_bytes,
            projected_cost_pct=self._cache.checks.cost_of(spec).projected_cost_pct,
        )


def spec_to_json(spec: AdapterSpec) -> str:
    """The spec as stored in the registry: enough to serve the version without re-reading it."""
    return json.dumps(
        {
            "path": str(spec.path),
            "weights_file": spec.weights_file.name,
            "modules": [
                [layer, module, spec.ranks[(layer, module)], spec.scales[(layer, module)]]
                for (layer, module) in sorted(spec.ranks)
            ],
            "target_modules": list(spec.target_modules),
            "max_rank": spec.max_rank,
            "size_bytes": spec.size_bytes,
            **({} if spec.variants.plain else {"variants": variants_to_json(spec.variants)}),
        }
        | ({"expert_geometry": list(spec.expert_geometry)} if spec.expert_geometry else {})
    )


def spec_from_json(text: str, model: ModelConfig | None = None) -> AdapterSpec:
    """The spec :func:`spec_to_json` stored, served on ``model`` (the base it was validated against:
    what splits a fused module's weights when they are read)."""
    data = json.loads(text)
    path = Path(data["path"])
    return AdapterSpec(
        path=path,
        weights_file=path / data["weights_file"],
        ranks={(layer, module): rank for layer, module, rank, _ in data["modules"]},
        scales={(layer, module): scale for layer, module, _, scale in data["modules"]},
        target_modules=tuple(data["target_modules"]),
        max_rank=data["max_rank"],
        size_bytes=data["size_bytes"],
        model=model,
        expert_geometry=tuple(data["expert_geometry"]) if "expert_geometry" in data else None,
        variants=variants_from_json(data.get("variants")),
    )
