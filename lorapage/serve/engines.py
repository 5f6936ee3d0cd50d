"""Several bases in one server: one :class:`~lorapage.engine.Engine` per base, and which one a request runs on.

``lorapage serve --model A --base B`` serves base A (the *primary*) and base B side by side, each
its own engine with its own pool, threads and config (the memory flags apply to each engine: on a
CPU, or with ``--num-pages``, two bases take twice the pool; on one CUDA device the engines share
``--gpu-memory-utilization``, :func:`utilization_share`). One registry: the primary's, in
``--state-dir``, which every admin route writes; each other engine keeps an in-memory copy of the
versions bound to its base, *mirrored* from the primary's live view whenever that changes
(:meth:`Engines.sync`, the fleet's replicas' mechanism), so a version registered or migrated while
both serve is served without a restart.

The routing rule (:func:`route_base`, pure) is: a request's adapter version runs on the base it is
bound to (409 naming its digest when no engine here runs that base); a request naming a base model
runs on that base; anything else on the primary. An alias (``id`` or ``id@channel``) at a version
migrated onto a base served here serves its migration, as it does on a server restarted over the
new base (:class:`~lorapage.registry.catalog.AdapterCatalog`): after ``POST
/v1/bases/{digest}/migrate`` the id's requests move to the new base's engine; ``id@N`` still names
the old version, on the old base.

Both bases must share a tokenizer and a context length: prompts are templated and tokenized once,
before the engine is chosen (a base upgrade keeps them; the drift check compares token ids anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lorapage.adapters.binding import shown_digest
from lorapage.bases.serving import ServedBase, check_alike, route_base, served_migrations, version_across
from lorapage.errors import (
    AdapterNotFoundError,
    ConflictError,
    LorapageError,
)
from lorapage.registry.store import VersionRow
from lorapage.usage.ledger import Key, Usage
from lorapage.usage.report import summed

if TYPE_CHECKING:
    from lorapage.engine import Engine

log = logging.getLogger("lorapage.server")


class Engines:
    """The engines of one server, the primary first (it holds the state dir and the registry)."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.primary = engines[0]
        self.engines = list(engines)
        # Digests hash the weights: with one base, nothing here needs it (the catalog asks when it must).
        self.bases = [ServedBase(e.base_name, e.digest) for e in engines] if len(engines) > 1 else []
        self._by_digest = {b.digest: e for b, e in zip(self.bases, engines, strict=False)}
        if self.several:
            _check_side_by_side(self.engines, self.bases)
        self._synced = -1  # the primary's catalog generation last mirrored
        self._mirrored: dict[str, tuple] = {}  # id -> (owner, current, rows) as last mirrored
        self._stored: dict[str, tuple] = {}  # id -> (owner, current, rows) in the primary's view at _synced
        self._busy: set[str] = set()  # ids whose dropped version still ran requests: mirrored again
        self.migrations: dict[str, str] = {}  # version key -> its migration onto a served base (another key)
        self.sync()

    @property
    def several(self) -> bool:
        return len(self.engines) > 1

    def engine_of(self, base: ServedBase) -> Engine:
        return self._by_digest[base.digest]

    def base_of_key(self, key: str) -> ServedBase | None:
        """The served base version ``key`` (``id@N``) is bound to (None: not served here)."""
        return route_base(self.bases, version_base=self.primary.admin.catalog.row(key).base_digest)

    def engine_for(self, adapter: str | None, model: str) -> Engine:
        """The engine a resolved request runs on: its adapter version's base's, else the base its
        ``model`` names, else the primary."""
        if not self.several:
            return self.primary
        base = self.base_of_key(adapter) if adapter is not None else route_base(self.bases, model=model)
        return self.primary if base is None else self.engine_of(base)

    def serving_key(self, name: str) -> str:
        """The version key ``name`` (``id``, ``id@N``, ``id@channel``) serves now, on whichever
        base: 404 when there is none, 409 (naming its digest) when no engine here runs its base,
        the serving engine's own refusals (an envelope's 400) otherwise."""
        if not self.several:
            return self.primary.admin.catalog.resolve_version(name)
        self.sync()
        key, base = version_across(name, self._stored_row, self.migrations, self.bases)
        return self.engine_of(base).admin.catalog.resolve_version(key)

    def _stored_row(self, name: str) -> VersionRow | None:
        try:
            return self.primary.admin.catalog.row(name)
        except AdapterNotFoundError:
            return None

    def served_ids(self) -> dict[str, tuple[str, str]]:
        """Each adapter id that serves a version now -> (that version's key, the name of the base it runs on)."""
        out = {}
        for adapter_id in self.primary.admin.catalog.index.ids():
            try:
                key = self.serving_key(adapter_id)
            except LorapageError:  # refused here (a base not served, outside the envelope): not listed
                continue
            base = self.base_of_key(key)
            if base is not None:
                out[adapter_id] = (key, base.name)
        return out

    def sync(self) -> None:
        """Mirror the primary's live view into the other engines when it changed since the last
        call (cheap otherwise: one comparison, and while a dropped version still runs requests on
        a side engine, that id alone mirrored again). Only the ids whose versions, alias or owner
        changed are mirrored; the migrations onto served bases are read again from the registry
        (a few rows per adapter, only after a change)."""
        if not self.several:
            return
        generation = self.primary.admin.catalog.generation
        if generation == self._synced:
            if self._busy:
                self._busy = self._mirror_ids(self._busy)
            return
        self._stored = {
            i: (owner, current, tuple(rows)) for i, owner, current, rows in self.primary.admin.catalog.index.stored()
        }
        changed = {i for i, state in self._stored.items() if self._mirrored.get(i) != state}
        changed |= {i for i in self._mirrored if i not in self._stored}  # gone
        self._busy = self._mirror_ids(changed | self._busy)
        self.migrations = self._served_migrations()
        self._synced = generation

    def _mirror_ids(self, ids: set[str]) -> set[str]:
        """Mirror ``ids`` as the primary's view at the last change has them (gone: none) into each
        other engine; returns those whose dropped version still runs requests there (again later)."""
        busy = set()
        for engine in self.engines[1:]:
            for adapter_id in ids:
                owner, current, rows = self._stored.get(adapter_id, (None, None, ()))
                if _mirror(engine, adapter_id, owner, current, list(rows)):
                    busy.add(adapter_id)
        for adapter_id in ids - busy:
            if adapter_id in self._stored:
                self._mirrored[adapter_id] = self._stored[adapter_id]
            else:
                self._mirrored.pop(adapter_id, None)
        return busy

    def _served_migrations(self) -> dict[str, str]:
        states = self.primary.admin.catalog.drift_record.migration_states()
        return served_migrations(states, {b.digest for b in self.bases})

    def serving(self, name: str) -> tuple[Engine, str]:
        """The engine that serves ``name`` and the name to ask it for (the version key on another
        base than the primary's); the refusals of :meth:`serving_key`."""
        if not self.several:
            return self.primary, name
        key = self.serving_key(name)
        return self.engine_for(key, ""), key

    def side_engine(self, digest: str) -> Engine | None:
        """The engine of base ``digest`` when it is served here beside the primary (None otherwise)."""
        engine = self._by_digest.get(digest) if self.several else None
        return engine if engine is not self.primary else None

    def on_primary(self, name: str, action: str) -> str:
        """``name`` when it runs on the primary base (or is refused by it); 409 when it runs on
        another base served here, where ``action`` (pin, load...) does not reach yet: its durable
        state is the primary's registry, its residency the other engine's."""
        if not self.several:
            return name
        engine, key = self.serving(name)
        if engine is self.primary:
            return name
        raise ConflictError(
            f"adapter {key} runs on base {engine.base_name!r} ({shown_digest(engine.digest)}), served beside the "
            f"primary base {self.primary.base_name!r}: {action} acts on the primary base's versions only",
            param="id",
        )

    def usage_rows(self, *, since_hour: int | None = None) -> list[tuple[Key, Usage]]:
        """Cost attribution over every base's engine, summed by (hour, tenant, adapter version)
        as a fleet sums its replicas' (a version runs on one base; the base model's rows add up)."""
        if not self.several:
            return self.primary.usage_rows(since_hour=since_hour)
        return summed(engine.usage_rows(since_hour=since_hour) for engine in self.engines)

    def set_tenant_weights(self, weights: Mapping[str, float]) -> None:
        for engine in self.engines:
            engine.set_tenant_weights(weights)

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` wherever it runs (an id unknown to an engine is nothing to it)."""
        for engine in self.engines:
            engine.abort(request_id)

    async def close(self) -> None:
        """Close every engine, the other bases first (the primary holds the state dir's lock)."""
        for engine in reversed(self.engines):
            await engine.close()


def _mirror(engine: Engine, adapter_id: str, owner: str | None, current: int | None, rows: list[VersionRow]) -> bool:
    """Mirror one id into ``engine``; True when a version to drop still has requests there (kept for now)."""
    busy = engine.admin.catalog.mirror(adapter_id, owner, current, rows)
    if busy:
        log.info("base %s keeps %s until its requests end", engine.base_name, ", ".join(busy))
    return bool(busy)


def _check_side_by_side(engines: Sequence[Engine], bases: Sequence[ServedBase]) -> None:
    """ValueError unless the bases can serve side by side: distinct digests and names, one
    tokenizer and one context length (prompts are tokenized before a base is chosen)."""
    digests, names = [b.digest for b in bases], [b.name for b in bases]
    if len(set(digests)) < len(digests) or len(set(names)) < len(names):
        raise ValueError(f"each base must be another checkpoint under another directory name; got {names}")
    check_alike([(e.base_name, e.tokenizer.backend.to_str(), e.max_model_len) for e in engines])
