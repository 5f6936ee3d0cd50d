"""Adapter source URIs: checked and put in canonical form at registration, rebuilt from the
stored form on restart. Quick and synchronous; only ``file://`` touches the file system (call it
in a worker for those)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from urllib.parse import unquote, urlsplit

from lorapage.adapters.digest import normalize_digest
from lorapage.errors import InvalidRequestError, PermissionDeniedError

_PARAM = "source"
# Plain http only to the loopback, so tests and a local mirror can serve without TLS.
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_HF_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")  # branch, tag or commit hash
_PIN_HINT = "pin a commit hash (hf://org/repo@<40-hex commit>) so the content cannot move"


@dataclass(frozen=True)
class FileSource:
    """An adapter directory on the server, resolved, under one of the adapter roots."""

    uri: str  # file:///resolved/dir
    path: Path
    scheme: ClassVar[str] = "file"


@dataclass(frozen=True)
class HttpsSource:
    """A base URL of a directory holding the adapter files."""

    uri: str  # no trailing slash, query or fragment

    scheme: ClassVar[str] = "https"

    def url(self, name: str) -> str:
        return f"{self.uri}/{name}"


@dataclass(frozen=True)
class S3Source:
    """A bucket and a key prefix; the adapter files are ``prefix/<file>``."""

    uri: str  # s3://bucket/prefix, no trailing slash
    bucket: str
    prefix: str  # "" for the bucket's top level
    scheme: ClassVar[str] = "s3"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name


@dataclass(frozen=True)
class HfSource:
    """A Hugging Face Hub model repository at a revision."""

    uri: str  # hf://org/repo@revision, revision always spelled out
    repo_id: str
    revision: str
    scheme: ClassVar[str] = "hf"

    @property
    def pinned(self) -> bool:
        """Whether the revision is a full commit hash (a branch or tag can move)."""
        return re.fullmatch(r"[0-9a-f]{40}", self.revision) is not None

    def pin_hint(self) -> str:
        return "" if self.pinned else f"; revision {self.revision!r} can move: {_PIN_HINT}"


RemoteSource = HttpsSource | S3Source | HfSource
Source = FileSource | RemoteSource


def parse_source(uri: str, *, sha256: str | None, adapter_roots: tuple[Path, ...]) -> Source:
    """The source ``uri`` names, in canonical form (its ``uri`` is what the registry stores), or
    InvalidRequestError / PermissionDeniedError saying what to change. ``sha256`` is checked for
    form here; https sources require it. Rebuild a stored source with the same call."""
    if sha256 is not None:
        try:
            normalize_digest(sha256)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="sha256") from None
    raw = uri.strip()
    if not raw:
        raise InvalidRequestError("source is empty; give file://, https://, s3:// or hf:// URI", param=_PARAM)
    scheme, sep, _ = raw.partition("://")
    if not sep:
        return _file_source(raw, raw, adapter_roots)
    match scheme.lower():
        case "file":
            return _file_source(raw, _file_uri_path(raw), adapter_roots)
        case "https" | "http":
            return _https_source(raw, sha256)
        case "s3":
            return _s3_source(raw)
        case "hf":
            return _hf_source(raw)
    raise InvalidRequestError(
        f"source scheme {scheme!r} is not supported; use file://, https://, s3:// or hf://", param=_PARAM
    )


def check_local_dir(path: Path, roots: tuple[Path, ...]) -> Path:
    """The resolved ``path``, a directory inside one of ``roots`` with no entry linking out of
    that root; else InvalidRequestError / PermissionDeniedError. Reads the file system."""
    if not roots:
        raise PermissionDeniedError(
            "adapters from a path on the server are disabled: start the server with --adapter-root DIR "
            "to allow adapter directories under DIR",
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
    if not resolved.is_dir():
        raise InvalidRequestError(f"adapter at {path}: no such directory on the server", param=_PARAM)
    for entry in resolved.iterdir():
        if not _resolve(entry).is_relative_to(root):
            raise PermissionDeniedError(
                f"adapter at {path}: {entry.name} links outside the adapter root {root}; copy the file in instead",
                param=_PARAM,
            )
    return resolved


def _file_uri_path(raw: str) -> str:
    parts = urlsplit(raw)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"file:// URIs must name a local path (file:///dir); got {raw!r}", param=_PARAM)
    if parts.query or parts.fragment:
        raise InvalidRequestError(f"file:// URI {raw!r}: percent-encode '?' and '#' in the path", param=_PARAM)
    return unquote(parts.path)


def _file_source(raw: str, path: str, roots: tuple[Path, ...]) -> FileSource:
    if not Path(path).is_absolute():
        raise InvalidRequestError(f"adapter path must be absolute; got {raw!r}", param=_PARAM)
    resolved = check_local_dir(Path(path), roots)
    return FileSource(uri=resolved.as_uri(), path=resolved)


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise InvalidRequestError(f"adapter path {path} cannot be resolved ({exc})", param=_PARAM) from None


def _https_source(raw: str, sha256: str | None) -> HttpsSource:
    parts = urlsplit(raw)
    scheme, host = parts.scheme.lower(), (parts.hostname or "")
    if not host:
        raise InvalidRequestError(f"source {raw!r} has no host", param=_PARAM)
    if scheme == "http" and host not in _LOOPBACK_HOSTS:
        raise InvalidRequestError(
            f"source {raw!r}: plain http is only allowed to 127.0.0.1 / localhost; use https://", param=_PARAM
        )
    if parts.username is not None or parts.password is not None:
        raise InvalidRequestError(
            f"source URL for host {host!r} carries credentials; they would be stored and shown, so serve "
            "the adapter without them",
            param=_PARAM,
        )
    if parts.query or parts.fragment:
        raise InvalidRequestError(
            f"source {raw!r}: give the base URL of a directory (the file names are appended), "
            "without a query or fragment",
            param=_PARAM,
        )
    if sha256 is None:
        raise InvalidRequestError(
            f"an https source needs the adapter's sha256 (`lorapage adapter digest DIR` prints it); got none "
            f"for {raw!r}",
            param="sha256",
        )
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return HttpsSource(uri=f"{scheme}://{netloc}{parts.path.rstrip('/')}")


def _s3_source(raw: str) -> S3Source:
    bucket, _, prefix = raw.partition("://")[2].partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.fullmatch(bucket):
        raise InvalidRequestError(
            f"source {raw!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -); "
            "the form is s3://bucket/prefix",
            param=_PARAM,
        )
    _require_extra("boto3", "s3")
    return S3Source(uri=f"s3://{bucket}/{prefix}".rstrip("/"), bucket=bucket, prefix=prefix)


def _hf_source(raw: str) -> HfSource:
    repo_id, at, revision = raw.partition("://")[2].partition("@")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_HF_PART.fullmatch(p) for p in parts):
        raise InvalidRequestError(
            f"source {raw!r}: the form is hf://org/repo@revision (revision defaults to main; {_PIN_HINT})",
            param=_PARAM,
        )
    revision = revision if at else "main"
    if not _HF_REVISION.fullmatch(revision) or ".." in revision:
        raise InvalidRequestError(f"source {raw!r}: {revision!r} is not a revision; {_PIN_HINT}", param=_PARAM)
    _require_extra("huggingface_hub", "hf")
    return HfSource(uri=f"hf://{repo_id}@{revision}", repo_id=repo_id, revision=revision)


def _require_extra(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise InvalidRequestError(
            f"{extra}:// adapter sources need {module}, which this server does not have: "
            f"pip install 'lorapage[{extra}]'",
            param=_PARAM,
        )
