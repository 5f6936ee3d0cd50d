"""Several bases served side by side: the pure rules both front ends share.

Which base a request runs on (:func:`route_base`): its adapter version's bound base (409 naming
the digest when none served runs it), else the base model it names, else the primary. An alias at
a version migrated onto a served base serves the migration (:func:`served_migrations`,
:func:`followed`); a name resolves across the served bases by :func:`version_across`. Bases served
together share a tokenizer and a context length (:func:`check_alike`); a side base's config is the
primary's with its own model (:func:`side_config`), and on one CUDA device the bases share the
memory utilization (:func:`utilization_share`). ``lorapage serve`` applies them over its engines
(:mod:`lorapage.serve.engines`), the fleet over its deployments (:mod:`lorapage.fleet.bases`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorapage.adapters.binding import migration_route, shown_digest
from lorapage.adapters.names import parse_name, version_key
from lorapage.config import EngineConfig
from lorapage.errors import (
    AdapterBaseMismatchError,
    AdapterNotFoundError,
)
from lorapage.registry.drift_state import MIGRATED, MigrationRow
from lorapage.registry.store import VersionRow


@dataclass(frozen=True)
class ServedBase:
    """One base this server runs: the name requests and ``/v1/models`` use, and its digest."""

    name: str
    digest: str


def route_base(
    served: Sequence[ServedBase], *, version_base: str | None = None, model: str | None = None
) -> ServedBase | None:
    """The base a request runs on: its adapter version's (``version_base``; None when that base
    is not served here), else the base the ``model`` names, else the first (the primary)."""
    if version_base is not None:
        return next((b for b in served if b.digest == version_base), None)
    return next((b for b in served if b.name == model), served[0])


def followed(name: str, key: str, migrations: Mapping[str, str]) -> str:
    """The version ``name`` serves, where it resolved to ``key``: an alias or a channel (not an
    explicit ``id@N``) at a version migrated onto a served base serves that migration."""
    _, version = parse_name(name)
    return migrations.get(key, key) if version is None or version == -1 else key


def served_migrations(rows: Iterable[MigrationRow], served: Collection[str]) -> dict[str, str]:
    """Version key -> the version it was migrated to, for the migrations onto a base in ``served``
    (digests); of several for one version, the latest."""
    done = sorted(
        (m.updated, m.adapter_id, m.version, m.new_version)
        for m in rows
        if m.state == MIGRATED and m.new_version is not None and m.target in served
    )
    return {version_key(adapter_id, old): version_key(adapter_id, new) for _, adapter_id, old, new in done}


def version_across(
    name: str,
    row_of: Callable[[str], VersionRow | None],
    migrations: Mapping[str, str],
    bases: Sequence[ServedBase],
) -> tuple[str, ServedBase]:
    """The version key ``name`` (``id``, ``id@N``, ``id@channel``) serves now across ``bases``, and
    the base it runs on (``lorapage serve --base`` and ``lorapage fleet --base`` alike): ``row_of``
    reads a stored version (None: none); ``migrations``: version key -> its migration onto a base
    served here, which an alias follows. 404 when there is none; 409 naming its digest when no
    base here runs it."""
    row = row_of(name)
    if row is None:
        raise AdapterNotFoundError(f"adapter {name!r} does not exist", param="model")
    key = followed(name, row.key, migrations)
    moved = row_of(key)
    bound = moved.base_digest if moved is not None else row.base_digest
    base = route_base(bases, version_base=bound)
    if base is None:
        raise AdapterBaseMismatchError(unserved_message(key, bound, bases), param="model")
    return key, base


def unserved_message(key: str, bound: str, served: Sequence[ServedBase]) -> str:
    """Why version ``key``, bound to base ``bound``, is refused here: every base served, and the way forward."""
    running = ", ".join(f"{shown_digest(b.digest)} ({b.name})" for b in served)
    return (
        f"adapter {key} was trained on base {shown_digest(bound)}, which this server does not run (it runs "
        f"{running}); start it with --base on that base's directory, or {migration_route(served[0].digest)}"
    )


def side_config(config: EngineConfig, model: str) -> EngineConfig:
    """The config of the engine serving base ``model`` beside ``config``'s (the primary's): every
    flag the same (the pool's included: each engine sizes its own, within its share of the device
    on CUDA: :func:`utilization_share`), its registry in memory (the
    primary's is the record, mirrored), and downloads in a disk cache of its own beside the
    primary's, whose budget and evictions are its alone."""
    cache = config.adapter_cache_dir or (str(Path(config.state_dir) / "adapter-cache") if config.state_dir else None)
    name = Path(model).name
    return dataclasses.replace(
        config, model=model, state_dir=None, adapter_cache_dir=f"{cache}-{name}" if cache is not None else None
    )


def utilization_share(utilization: float, bases: int, k: int, reserved_bytes: int, total_bytes: int) -> float:
    """The ``gpu_memory_utilization`` engine ``k`` (0: the primary) of ``bases`` engines on one
    CUDA device is built with, so that each pool gets an equal share of ``utilization``: the cap
    counts all memory in use when an engine sizes its pool (the engines built before it
    included), so engine k's is (k+1)/bases of it, less what those engines left free for their
    steps (``reserved_bytes``: activations and headroom, allocated only as steps run)."""
    return utilization * (k + 1) / bases - reserved_bytes / total_bytes


def check_alike(bases: Sequence[tuple[str, str, int]]) -> None:
    """ValueError unless every base, ``(name, tokenizer JSON, context length)``, has the first's
    tokenizer and context length: prompts are templated and tokenized once, before a base is
    chosen (``lorapage serve --base`` and ``lorapage fleet --base``)."""
    first_name, first_tokenizer, first_len = bases[0]
    for name, tokenizer, context in bases[1:]:
        if tokenizer != first_tokenizer:
            raise ValueError(f"base {name!r} has another tokenizer than {first_name!r}")
        if context != first_len:
            raise ValueError(
                f"base {name!r} serves {context} tokens of context, {first_name!r} {first_len}: give --max-model-len"
            )
