"""Versions pushed from memory: a trainer's new adapter weights stored as the next immutable
version of an id, with no file written by the caller (``engine.admin.push``, ``POST
/v1/adapters/{id}/versions``).

A push is a registration whose files the engine writes itself: the weights as safetensors bytes
and the config as JSON are written, in the engine's I/O thread, to a directory of their own under
the push root (``STATE_DIR/pushed/ID/DIGEST``, or a temporary directory for an engine without a
state dir) named by their content digest, and registered from there exactly as a directory is
(:meth:`~lorapage.registry.prepare.VersionPreparer.check`: PEFT config, tensor names and shapes
against the base, finite weights, the shared envelope, the pool, the base it was trained on). The
same content pushed twice is the same version. Loads then read those files like any version's.

Each pushed id may have a staleness bound ``k`` (:meth:`VersionPusher.set_staleness`): a request
naming a version older than current - k is refused (409 ``adapter_version_stale``), and versions
older than the last k + 1 that no request holds are retired: their cache entry goes (pool pages
and host copy freed) and their files are deleted, while the registry keeps their row, digest and
audit trail. That is what keeps a trainer pushing every step flat in memory and disk. The bounds
are kept in ``staleness.json`` under the push root, so a restarted engine refuses what it refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from concurrent.futures import Executor
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import save

from lorapage.adapters.cache import AdapterCache
from lorapage.adapters.digest import bytes_digest
from lorapage.adapters.names import check_adapter_id
from lorapage.adapters.safetensors_buffer import MAX_HEADER_BYTES
from lorapage.errors import AdapterFormatError, AdapterVersionStaleError, InvalidRequestError
from lorapage.registry.catalog import AdapterCatalog, VersionInfo
from lorapage.registry.prepare import REGISTRATION_TIMEOUT_S
from lorapage.registry.store import VersionRow

log = logging.getLogger("lorapage.adapters")

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
CONFIG_METADATA_KEY = "adapter_config"  # a pushed safetensors body's __metadata__ key holding the config JSON
MAX_STALENESS = 1 << 20
STALENESS_FILE = "staleness.json"  # {id: k} under the push root, rewritten whole at every change


def push_root(registry_path: str) -> Path:
    """Where pushed versions' files live: beside the registry (``STATE_DIR/pushed``), or in a
    temporary directory of this process for an in-memory registry."""
    if registry_path != ":memory:":
        return Path(registry_path).resolve().parent / "pushed"
    return Path(tempfile.mkdtemp(prefix="lorapage-pushed-"))


def config_of(body: bytes | memoryview) -> dict:
    """The adapter config a pushed safetensors body carries in its header's ``__metadata__``
    (key :data:`CONFIG_METADATA_KEY`, a JSON object as a string); 400 saying what is wrong."""
    view = memoryview(body)
    if view.nbytes < 8:
        raise InvalidRequestError("the body is not safetensors: shorter than its 8-byte header length", param="body")
    n = int.from_bytes(view[:8], "little")
    if n > min(MAX_HEADER_BYTES, view.nbytes - 8):
        raise InvalidRequestError(f"the body is not safetensors: a header of {n} bytes does not fit", param="body")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
        meta = header.get("__metadata__") or {}
        config = json.loads(meta[CONFIG_METADATA_KEY])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidRequestError(
            f"the safetensors header's __metadata__ must hold {CONFIG_METADATA_KEY!r}: the adapter_config.json "
            "object as a JSON string",
            param="body",
        ) from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"__metadata__[{CONFIG_METADATA_KEY!r}] must be a JSON object", param="body")
    return config


def encode(tensors: Mapping[str, torch.Tensor], config: Mapping) -> bytes:
    """``tensors`` (PEFT key naming) as the safetensors bytes a push stores, ``config`` in its
    metadata (what ``POST /v1/adapters/{id}/versions`` takes)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return save(cpu, metadata={CONFIG_METADATA_KEY: json.dumps(dict(config), sort_keys=True)})


class VersionPusher:
    """Pushed versions of an engine's ids: stored through ``catalog`` from bytes in memory, their
    files under ``root``; staleness bounds and retirement per id (see the module's docstring)."""

    def __init__(self, catalog: AdapterCatalog, cache: AdapterCache, root: Path, io_executor: Executor) -> None:
        self._catalog, self._cache, self.root, self._io = catalog, cache, root, io_executor
        # id -> k: versions below current - k are refused and retired (kept across restarts).
        self.staleness: dict[str, int] = _read_staleness(root / STALENESS_FILE)
        self.retired: set[str] = set()  # version keys retired (kept in the registry, served no more)
        self._serial: dict[str, asyncio.Lock] = {}
        if root.name.startswith("lorapage-pushed-"):  # this process's temporary root goes with it
            weakref.finalize(self, shutil.rmtree, str(root), True)
        catalog.freshness = self.check_fresh
        self._forget_missing()

    def _forget_missing(self) -> None:
        """Versions pushed before a restart whose files were deleted when they retired: retired."""
        for info in self._catalog.versions():
            path = _local_path(info.source)
            if path is not None and path.is_relative_to(self.root) and not path.is_dir():
                if info.key in self._cache.entries and not self._cache.residency.is_busy(info.key):
                    self._cache.unregister(info.key)
                self.retired.add(info.key)

    def set_staleness(self, adapter_id: str, k: int | None) -> None:
        """Bound ``adapter_id``'s staleness to ``k`` versions behind its current (None: unbounded)."""
        if k is not None and not 0 <= k <= MAX_STALENESS:
            raise InvalidRequestError(
                f"max_staleness must be between 0 and {MAX_STALENESS}; got {k}", param="max_staleness"
            )
        if self.staleness.get(adapter_id) == k:
            return
        if k is None:
            del self.staleness[adapter_id]
        else:
            self.staleness[adapter_id] = k
        # A few bytes, rewritten whole (temp file, then rename): a crash leaves the old or the new.
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{STALENESS_FILE}.tmp"
        tmp.write_text(json.dumps(self.staleness, sort_keys=True))
        os.replace(tmp, self.root / STALENESS_FILE)

    def serial(self, adapter_id: str) -> asyncio.Lock:
        """One push of ``adapter_id`` at a time, from its store to its move: a later push can never
        be made current before an earlier one."""
        return self._serial.setdefault(adapter_id, asyncio.Lock())

    def check_fresh(self, row: VersionRow) -> None:
        """409 for version ``row`` when it is older than its id's current - k, or retired."""
        k = self.staleness.get(row.adapter_id)
        current = self._catalog.index.current(row.adapter_id)
        if row.key in self.retired or (k is not None and current is not None and row.version < current - k):
            bound = f"max_staleness {k}" if k is not None else "retired"
            raise AdapterVersionStaleError(
                f"adapter version {row.key} is stale: the current version is {current} and {row.adapter_id!r} "
                f"serves versions {max(1, (current or 0) - (k or 0))} to {current} ({bound}); "
                "sample from a newer policy version",
                param="adapter_version",
            )

    async def store(
        self,
        name: str,
        weights: bytes,
        config: Mapping,
        *,
        owner: str | None = None,
        expected_base_digest: str | None = None,
        actor: str | None = None,
        timeout_s: float = REGISTRATION_TIMEOUT_S,
    ) -> VersionInfo:
        """``weights`` (safetensors bytes) and ``config`` written under the push root and
        registered as a version of ``name``, checked as a directory is (within ``timeout_s``),
        committed; not made current unless it is the id's first. ``owner``: the id's (None: the
        owner it has)."""
        catalog = self._catalog
        if "@" in name:
            raise InvalidRequestError(f"push a version of an id, not of {name!r}", param="id")
        check_adapter_id(name, "")  # it names a directory under the push root too: no separators
        owner = owner if owner is not None else catalog.index.owner(name)
        catalog.index.check_owner(name, owner)
        work = asyncio.get_running_loop().run_in_executor(self._io, self._write, name, weights, config)
        try:
            path = await asyncio.wait_for(work, timeout_s)
        except TimeoutError:
            raise AdapterFormatError(f"adapter {name!r} could not be written within {timeout_s:g}s") from None
        first = name not in catalog.index.ids()
        return await catalog.register_checked(
            name, path, expected_base_digest=expected_base_digest, owner=owner, activate=first, actor=actor
        )

    def _write(self, name: str, weights: bytes, config: Mapping) -> Path:
        """The version's two files in a directory named by their digest (blocking: the I/O thread)."""
        config_bytes = json.dumps(dict(config), sort_keys=True, indent=1).encode()
        digest = bytes_digest({CONFIG_FILE: config_bytes, WEIGHTS_FILE: weights})
        path = self.root / name / digest[:32]
        if path.is_dir():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=path.parent))
        (staging / CONFIG_FILE).write_bytes(config_bytes)
        (staging / WEIGHTS_FILE).write_bytes(weights)
        try:
            os.rename(staging, path)  # whole or absent: a reader never sees half a version
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not path.is_dir():
                raise
        return path

    def retire(self, adapter_id: str) -> list[str]:
        """Retire ``adapter_id``'s versions older than its last k + 1 that no request holds and no
        pin keeps: their pages and host copy freed, their files deleted; the registry keeps their
        rows. Returns their keys (a busy one is retired by a later call)."""
        k = self.staleness.get(adapter_id)
        current = self._catalog.index.current(adapter_id)
        if k is None or current is None:
            return []
        gone = []
        for info in self._catalog.versions(adapter_id):
            key = info.key
            if info.version >= current - k or key in self.retired or key not in self._cache.entries:
                continue
            residence = self._cache.residency.get(key)
            if residence.running or residence.waiting or residence.pinned:
                continue
            self._cache.unregister(key)
            self.retired.add(key)
            gone.append(key)
            path = _local_path(info.source)
            if path is not None and path.is_relative_to(self.root):
                self._io.submit(shutil.rmtree, path, True)
        return gone


def _read_staleness(path: Path) -> dict[str, int]:
    """The bounds a previous run kept; none when the file is absent or unreadable (logged)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): pushed ids start without staleness bounds", path, e)
        return {}
    ok = isinstance(data, dict) and all(isinstance(k, int) and 0 <= k <= MAX_STALENESS for k in data.values())
    if not ok:
        log.warning("%s does not hold {id: k}: pushed ids start without staleness bounds", path)
        return {}
    return data


def _local_path(source: str) -> Path | None:
    """The directory a ``file://`` source names (None for any other)."""
    if not source.startswith("file://"):
        return None
    return Path(unquote(urlparse(source).path))
