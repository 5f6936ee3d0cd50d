"""Where a registered version's files are read from when it loads: its stored ``source``, checked
again against the roots its owner may read from (a directory may have moved or a root been
dropped since registration), through the download cache for a remote one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from lorapage.errors import AdapterSourceError, LorapageError
from lorapage.sources.fetch import AdapterSources
from lorapage.sources.parse import FileSource, parse_source
from lorapage.sources.roots import AdapterRoots


class VersionFiles:
    """Where a registered version's files are read from: its ``source``, checked against the roots
    its owner may read from, through the download cache for a remote one."""

    def __init__(self, roots: AdapterRoots, sources: AdapterSources) -> None:
        self.roots, self.sources = roots, sources

    @asynccontextmanager
    async def locate(self, source: str, digest: str, owner: str | None) -> AsyncIterator[Path]:
        """A version's files from its ``source``, checked against the roots ``owner`` may read
        from (a directory) and verified against its ``digest``."""
        try:
            src = await asyncio.to_thread(parse_source, source, sha256=digest, roots=self.roots, owner=owner)
        except LorapageError as exc:  # a directory that moved, links out now, or a root dropped
            raise AdapterSourceError(f"adapter source {source} is no longer usable: {exc.message}") from None
        # A directory in place is checked as it is read (the bytes hashed are the bytes loaded);
        # a remote one was checked when it landed in the disk cache.
        async with self.sources.use(
            src, None if isinstance(src, FileSource) else digest, owner, registered=True
        ) as path:
            yield path
