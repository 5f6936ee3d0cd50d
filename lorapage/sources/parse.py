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
from lorapage.errors import InvalidRequestError
from lorapage.sources.roots import AdapterRoots

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


def parse_source(uri: str, *, sha256: str | None, roots: AdapterRoots, owner: str | None = None) -> Source:
    """The source ``uri`` names, in canonical form (its ``uri`` is what the registry stores), or
    InvalidRequestError / PermissionDeniedError saying what to change. A directory must be one
    a version owned by ``owner`` may be read from (:meth:`AdapterRoots.check`). ``sha256`` is
    checked for form here; https sources require it. Rebuild a stored source with the same call."""
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
        return _file_source(raw, raw, roots, owner)
    match scheme.lower():
        case "file":
            return _file_source(raw, _file_uri_path(raw), roots, owner)
        case "https" | "http":
            return _https_source(raw, sha256)
        case "s3":
            return _s3_source(raw)
        case "hf":
            return _hf_source(raw)
    raise InvalidRequestError(
        f"source scheme {scheme!r} is not supported; use file://, https://, s3:// or hf://", param=_PARAM
    )


def _file_uri_path(raw: str) -> str:
    parts = urlsplit(raw)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"file:// URIs must name a local path (file:///dir); got {raw!r}", param=_PARAM)
    if parts.query or parts.fragment:
        raise InvalidRequestError(f"file:// URI {raw!r}: percent-encode '?' and '#' in the path", param=_PARAM)
    return unquote(parts.path)


def _file_source(raw: str, path: str, roots: AdapterRoots, owner: str | None) -> FileSource:
    if not Path(path).is_absolute():
        raise InvalidRequestError(f"adapter path must be absolute; got {raw!r}", param=_PARAM)
    resolved = roots.check(Path(path), owner)
    return FileSource(uri=resolved.as_uri(), path=resolved)


def check_download_url(raw: str) -> str:
    """The host of ``raw``, a URL the server may download from: https (or plain http to the
    loopback), with a host and no credentials. Every redirect a download follows is held to it
    too. Raises InvalidRequestError saying what is wrong."""
    parts = urlsplit(raw)
    scheme, host = parts.scheme.lower(), (parts.hostname or "")
    if scheme not in ("https", "http"):
        raise InvalidRequestError(f"source {raw!r}: only https:// URLs are downloaded", param=_PARAM)
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
    return host


def _https_source(raw: str, sha256: str | None) -> HttpsSource:
    check_download_url(raw)
    parts = urlsplit(raw)
    scheme, host = parts.scheme.lower(), (parts.hostname or "")
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
