"""The content digest of a PEFT adapter: one sha256 over its config and its weights.

It names an adapter version's content wherever the bytes come from (a directory on the server,
https, s3, the Hugging Face hub), so a download is checked against the digest given at
registration and two registrations of the same bytes are known to be one version. Each file is
framed by its name and length, so moving bytes from one file to the other changes the digest.
``lorapage adapter digest DIR`` prints it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from lorapage.adapters.files import open_regular
from lorapage.errors import InvalidRequestError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what a version's content is
_CHUNK = 1 << 20


def bytes_digest(contents: dict[str, bytes | memoryview]) -> str:
    """:func:`content_digest` of files already read (name -> bytes or a byte buffer, every one of ADAPTER_FILES):
    hashing what was read, not the file again, so what is verified is what is used."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        data = contents[name]
        h.update(name.encode() + b"\0" + memoryview(data).nbytes.to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def content_digest(path: str | Path, max_bytes: int | None = None) -> str:
    """The hex sha256 over ``ADAPTER_FILES`` in ``path``: for each, its name, a NUL, its length
    as 8 little-endian bytes, then its bytes. Reads in chunks (hashlib releases the GIL) regular
    files only, each of at most ``max_bytes`` when given (else UntrustedFileError, an OSError, before reading)."""
    root = Path(path)
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        f, size = open_regular(root / name, max_bytes)
        with f:
            h.update(name.encode() + b"\0" + size.to_bytes(8, "little"))
            got = 0
            while chunk := f.read(_CHUNK):
                got += len(chunk)
                h.update(chunk)
        if got != size:
            raise OSError(f"{name} changed size while it was hashed ({size} bytes when opened)")
    return h.hexdigest()


def normalize_digest(raw: str) -> str:
    """A digest as given by a user (``sha256:HEX`` or ``HEX``, any case) in the stored form, or
    ValueError saying what is expected."""
    value = raw.strip().lower().removeprefix("sha256:")
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"sha256 must be 64 hex digits (optionally prefixed 'sha256:'); got {raw!r}")
    return value


def digest_param(raw: str, param: str) -> str:
    """:func:`normalize_digest` of the request field ``param``: a 400 naming it when malformed."""
    try:
        return normalize_digest(raw)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param=param) from None
