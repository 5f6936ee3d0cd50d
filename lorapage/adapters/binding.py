"""Which base an adapter was trained on: the digest registration binds each version to.

A LoRA trained on one checkpoint and applied to another does not fail: it degrades, silently. So
every version is bound to the digest of the base it was trained on (sha256 over the base's weight
files, :func:`~lorapage.model.loader.model_digest`) and served only on that base. Registration
takes that digest from, first to last:

1. the registration's ``expected_base_digest``: the operator's word, over anything the files say;
2. the adapter's ``base_model_name_or_path`` (PEFT's metadata) looked up in the base-names table,
   ``--base-names FILE`` (TOML, one ``"NAME" = "sha256:HEX"`` a line);
3. the same name naming the running base itself: its directory as a path (absolute, or any trailing
   part of it, e.g. ``lorapage/assets/tiny/base`` or just ``base``), its ``config.json``'s
   ``_name_or_path``, or ``org/name`` when it was loaded from a Hugging Face cache snapshot
   (``models--org--name/snapshots/...``). The table is asked first, so an operator can say that a
   name the running base also answers to means another checkpoint.

Nothing found: refused (400 ``adapter_base_unknown``, the message says how to bind it), unless the
engine allows unbound adapters (``--allow-unbound``), which are then bound to the running base, as
they were before this rule. A digest other than the running base's: refused (409
``adapter_base_mismatch``) naming both digests and the migration route: an adapter moves to a new
base only once its drift check (:mod:`lorapage.bases`) passes, never by registering it again.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from lorapage.adapters.digest import digest_param, normalize_digest
from lorapage.errors import AdapterBaseMismatchError, AdapterBaseUnknownError

_HUB_CACHE_PREFIX = "models--"  # huggingface_hub's cache: models--{org}--{name}/snapshots/{commit}
_SHOWN_CHARS = 120  # a name longer than this is cut in messages (it comes from an adapter's files)


def shown_digest(digest: str) -> str:
    """A stored (bare hex) digest as users give it."""
    return f"sha256:{digest}"


def migration_route(new: str) -> str:
    """What moves an adapter trained on another base onto base ``new`` (a stored digest): its drift
    check and migration (:mod:`lorapage.frontend.bases_route`). Every base-mismatch message ends with it."""
    return (
        f"an adapter moves to another base only once its drift check passes: on a server running the base it "
        f'was trained on, POST /v1/bases/{new}/validate {{"model": NEW_BASE_DIR}}, then POST '
        f"/v1/bases/{new}/migrate, or `lorapage base check OLD_DIR NEW_DIR --state-dir DIR` over both model directories"
    )


def mismatch_message(subject: str, trained_on: str, running: str, *, server: str = "server") -> str:
    """``subject`` (an adapter, as the caller names it) was trained on base ``trained_on``, not the
    ``running`` one: both digests and the way forward."""
    return (
        f"{subject} was trained on base {shown_digest(trained_on)}, but this {server} runs base "
        f"{shown_digest(running)}; {migration_route(running)}"
    )


def load_base_names(path: str | Path) -> dict[str, str]:
    """The base-names table in the TOML file ``path``: base name (as an adapter's
    ``base_model_name_or_path`` says it) -> stored digest. ValueError saying what is wrong."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not valid TOML ({exc})") from None
    table = {}
    for name, value in data.items():
        if not isinstance(value, str):
            raise ValueError(f'{name!r}: expected a digest string, as "{name}" = "sha256:<64 hex digits>"')
        try:
            table[name.strip()] = normalize_digest(value)
        except ValueError as exc:
            raise ValueError(f"{name!r}: {exc}") from None
    return table


@dataclass(frozen=True)
class BaseNames:
    """The names an adapter's ``base_model_name_or_path`` may give a base by: the table's, and
    the running base's own."""

    table: Mapping[str, str] = field(default_factory=dict)  # name -> stored digest (--base-names)
    running_paths: tuple[tuple[str, ...], ...] = ()  # the running base's directory as path parts: normalised, resolved
    running_aliases: frozenset[str] = frozenset()  # its config's _name_or_path; org/name of a hub cache snapshot

    @classmethod
    def of_base(cls, model_dir: str | Path, table: Mapping[str, str] | None = None) -> BaseNames:
        """The names of the base in ``model_dir`` (which is read: its ``config.json``) beside ``table``."""
        paths = {Path(os.path.abspath(model_dir)).parts, Path(model_dir).resolve().parts}
        aliases = set()
        try:
            declared = json.loads((Path(model_dir) / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            declared = None  # the engine's own reading of config.json reports what is wrong with it
        if isinstance(declared, str) and declared.strip():
            aliases.add(declared.strip())
        for parts in paths:
            for part in parts:
                if part.startswith(_HUB_CACHE_PREFIX):
                    aliases.add(part.removeprefix(_HUB_CACHE_PREFIX).replace("--", "/"))
        return cls(dict(table or {}), tuple(sorted(paths)), frozenset(aliases))

    def names_running(self, name: str) -> bool:
        """Whether ``name`` is one of the running base's own names: an alias, its directory's
        absolute path, or a trailing part of that path."""
        if name in self.running_aliases:
            return True
        parts = PurePosixPath(name).parts
        if not parts:
            return False
        if PurePosixPath(name).is_absolute():
            return any(parts == running for running in self.running_paths)
        return any(len(parts) <= len(running) and running[-len(parts) :] == parts for running in self.running_paths)

    def digest_of(self, name: str, running: str) -> str | None:
        """The stored digest of the base ``name`` names (``running`` for the running base's own
        names, unless the table says otherwise), or None when it names no base known here."""
        name = name.strip()
        if name in self.table:
            return self.table[name]
        return running if name and self.names_running(name) else None


@dataclass(frozen=True)
class BaseBinding:
    """The rule registration applies: which base an adapter was trained on, refused unless it is
    the running one (see the module's docstring)."""

    names: BaseNames = field(default_factory=BaseNames)
    allow_unbound: bool = False  # an adapter whose base is unknown is bound to the running base

    def bind(self, running: str, *, expected: str | None, trained_on: str | None) -> str:
        """The stored digest of the base an adapter was trained on, which is ``running``: from
        ``expected`` (a registration's ``expected_base_digest``) when given, else from
        ``trained_on`` (its ``base_model_name_or_path``). Raises AdapterBaseMismatchError for
        another base, AdapterBaseUnknownError (unless ``allow_unbound``) for none."""
        param: str | None
        if expected is not None:
            bound = digest_param(expected, "expected_base_digest")
            subject, param = "this adapter (per the registration's expected_base_digest)", "expected_base_digest"
        else:
            named = self.names.digest_of(trained_on, running) if trained_on is not None else None
            if named is None or trained_on is None:
                if self.allow_unbound:
                    return running
                raise AdapterBaseUnknownError(self._unknown(trained_on, running), param="expected_base_digest")
            # Only the table can name another base: the running base's own names map to it.
            bound, param = named, None
            subject = f"this adapter (base_model_name_or_path {_shown(trained_on)}, per --base-names)"
        if bound != running:
            raise AdapterBaseMismatchError(mismatch_message(subject, bound, running), param=param)
        return bound

    def _unknown(self, trained_on: str | None, running: str) -> str:
        why = (
            "its adapter_config.json has no base_model_name_or_path"
            if trained_on is None or not trained_on.strip()
            else f"its base_model_name_or_path {_shown(trained_on)} is not in the base-names table and does not name "
            "the running base"
        )
        return (
            f"cannot tell which base this adapter was trained on: {why}. Bind it by giving expected_base_digest "
            f"(the digest of the base it was trained on; this server runs {shown_digest(running)}), by mapping that "
            'name to the digest in the --base-names file ("NAME" = "sha256:..."), or start the server with '
            "--allow-unbound to bind such adapters to the running base (EngineConfig.base_names / allow_unbound)"
        )


def _shown(name: str) -> str:
    return repr(name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "...")
