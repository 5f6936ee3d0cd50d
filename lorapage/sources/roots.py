"""Which directories on the server an adapter may be read from, for which tenant.

``--adapter-root DIR`` is a shared root; ``--adapter-root TENANT=DIR`` is one of that tenant's.
A version registered for a tenant is read from the tenant's own roots when it has any, else from
the shared ones; the directory and every entry in it must resolve inside one of those roots and
outside every other tenant's (a shared root may hold tenants' roots: those stay theirs), so a
link planted in one tenant's directory cannot reach another tenant's weights. An owner-less
version (the operator's ``--lora-modules``) is read from the exact directories the operator named,
or from the shared roots. The rule is checked at registration and again at every load, so a
directory that later links out is refused then. A tenant's version may hold no hard-linked file
either: a hard link is the other file itself, wherever it was made, and no path check sees it.
An embedded engine's caller may name any
directory (:data:`ANYWHERE`); a server never lets an HTTP request do so (:meth:`for_requests`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lorapage.errors import InvalidRequestError, PermissionDeniedError

_PARAM = "source"
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_EVERYWHERE = (Path("/"),)


@dataclass(frozen=True)
class AdapterRoots:
    """The adapter roots of a server: shared ones, each tenant's, and the operator's directories."""

    shared: tuple[Path, ...] = ()
    tenants: Mapping[str, tuple[Path, ...]] = field(default_factory=dict)
    operator: tuple[Path, ...] = ()  # directories the operator named at start (--lora-modules): owner-less only
    anywhere: bool = False  # an embedded engine's caller: any directory, any owner

    @classmethod
    def parse(cls, values: Iterable[str], operator: Iterable[str | Path] = ()) -> AdapterRoots:
        """``--adapter-root`` values, ``DIR`` or ``TENANT=DIR`` (each resolved), and the operator's
        directories; ValueError naming a value that is neither."""
        shared: list[Path] = []
        tenants: dict[str, list[Path]] = {}
        for value in values:
            tenant, sep, path = value.partition("=")
            if not sep or "/" in tenant:  # a path (absolute, or holding '='), not TENANT=DIR
                shared.append(Path(value).resolve())
            elif _TENANT.fullmatch(tenant) and path:
                tenants.setdefault(tenant, []).append(Path(path).resolve())
            else:
                raise ValueError(f"--adapter-root takes DIR or TENANT=DIR; got {value!r}")
        return cls(
            tuple(shared),
            {t: tuple(p) for t, p in tenants.items()},
            tuple(Path(p).resolve() for p in operator),
        )

    def values(self) -> tuple[str, ...]:
        """The roots as ``--adapter-root`` values (:meth:`parse` reads them back; the operator's
        directories are not among them)."""
        return (*map(str, self.shared), *(f"{t}={p}" for t, paths in self.tenants.items() for p in paths))

    def all_roots(self) -> list[Path]:
        """Every root, shared and tenants' (for checking that they exist)."""
        return [*self.shared, *(p for paths in self.tenants.values() for p in paths)]

    def for_requests(self) -> AdapterRoots:
        """What an HTTP registration may name: these roots, but nothing for :data:`ANYWHERE`."""
        return NO_ROOTS if self.anywhere else self

    def check(self, path: Path, owner: str | None) -> Path:
        """The resolved directory ``path``, if a version owned by ``owner`` may be read from it
        (see the module's rule); else InvalidRequestError / PermissionDeniedError. Reads the file
        system (symlinks resolved), so call it in a worker."""
        if self.anywhere:
            return check_local_dir(path, _EVERYWHERE)
        if owner is None and _resolve(path) in self.operator:
            return check_local_dir(path, _EVERYWHERE)  # the operator's own: its entries may link anywhere
        roots = self.tenants.get(owner, ()) if owner is not None else ()
        foreign = tuple(p for tenant, paths in self.tenants.items() if tenant != owner for p in paths)
        return check_local_dir(path, roots or self.shared, foreign, owner)


ANYWHERE = AdapterRoots(anywhere=True)
NO_ROOTS = AdapterRoots()


def check_local_dir(
    path: Path, roots: tuple[Path, ...], foreign: tuple[Path, ...] = (), owner: str | None = None
) -> Path:
    """The resolved ``path``, a directory inside one of ``roots`` and outside every ``foreign``
    one, with no entry linking out of that root or into a foreign one; else InvalidRequestError /
    PermissionDeniedError. Reads the file system."""
    if not roots:
        who = f" for tenant {owner!r}" if owner is not None else ""
        raise PermissionDeniedError(
            f"adapters from a path on the server are disabled{who}: start the server with --adapter-root DIR "
            "(or --adapter-root TENANT=DIR) to allow adapter directories under DIR",
            param=_PARAM,
        )
    resolved = _resolve(path)
    root = next((r for r in map(_resolve, roots) if resolved.is_relative_to(r)), None)
    if root is None:
        shown = ", ".join(map(str, roots))
        raise PermissionDeniedError(
            f"adapter path {path} resolves to {resolved}, outside the adapter roots ({shown}); "
            "put the adapter under a root, or start the server with another --adapter-root",
            param=_PARAM,
        )
    if _inside(resolved, foreign):
        raise PermissionDeniedError(f"adapter path {path} lies in another tenant's adapter root", param=_PARAM)
    if not resolved.is_dir():
        raise InvalidRequestError(f"adapter at {path}: no such directory on the server", param=_PARAM)
    for entry in resolved.iterdir():
        target = _resolve(entry)
        if not target.is_relative_to(root) or _inside(target, foreign):
            raise PermissionDeniedError(
                f"adapter at {path}: {entry.name} links outside the adapter root {root}; copy the file in instead",
                param=_PARAM,
            )
        if owner is not None and target.is_file() and target.stat().st_nlink > 1:
            raise InvalidRequestError(
                f"adapter at {path}: {entry.name} is a hard link ({target.stat().st_nlink} names for one file), "
                "which a tenant's adapter may not hold; copy the file in instead",
                param=_PARAM,
            )
    return resolved


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(r) for r in roots)


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise InvalidRequestError(f"adapter path {path} cannot be resolved ({exc})", param=_PARAM) from None
