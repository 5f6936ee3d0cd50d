"""Where an adapter version's files come from, and how they reach the server verified.

A version's content is ``adapter_config.json`` and ``adapter_model.safetensors``; its digest is
:func:`lorapage.adapters.digest.content_digest` over them. :func:`parse_source` checks a source at
registration and gives its canonical ``uri`` (what the registry stores; passing it back with the
stored digest rebuilds the source on restart). :class:`AdapterSources` fetches it.

Source formats
--------------

``/abs/dir`` or ``file:///abs/dir``
    A directory on the server, only under an ``--adapter-root`` (symlinks resolved; an entry
    linking out of the root is refused, 403). Read in place; ``sha256`` optional. Each fetch
    re-checks the directory and, given the registered digest, re-hashes it: files changed after
    registration fail with ``adapter_integrity_failed``. Canonical form: ``file:///resolved/dir``.

``https://host[:port]/base/path``
    The base URL of a directory: the server GETs ``<uri>/adapter_config.json`` and
    ``<uri>/adapter_model.safetensors``. ``sha256`` is required. No credentials in the URL, no
    query or fragment; redirects are followed. Plain ``http://`` is accepted only for
    ``127.0.0.1``, ``localhost`` and ``::1`` (tests, a local mirror). Canonical form: scheme and
    host lower case, no trailing slash.

``s3://bucket/prefix``
    Objects ``prefix/adapter_config.json`` and ``prefix/adapter_model.safetensors`` (no prefix:
    the bucket's top level). Needs the ``s3`` extra (boto3); credentials and region come from
    boto3's usual chain (environment, config files, instance role); the endpoint is configurable
    for S3-compatible stores. ``sha256`` optional. Canonical form: no trailing slash.

``hf://org/repo@revision``
    A Hugging Face Hub model repository; both files are downloaded at one commit of
    ``revision`` (a branch, tag or commit hash; ``main`` when left out — pinning a commit hash is
    recommended, since a branch can move). Needs the ``hf`` extra (huggingface_hub); a token
    comes from ``HF_TOKEN`` or the huggingface_hub login. ``sha256`` optional. Canonical form:
    the revision always spelled out.

Without ``sha256``, a remote source's digest is what its first fetch downloaded (the registry
then stores it, so later fetches are held to it). Every remote download is capped at
``max_download_bytes`` for both files together (a declared size over it fails before any byte is
read, a body that grows past it fails as it does), lands in ``<cache_dir>/<digest>/`` only
after it matched, and is shared by concurrent fetches of the same version. Errors: 400
(``invalid_request``) or 403 (``permission_denied``) at registration; at fetch 502
``adapter_source_failed`` (unreachable, HTTP error, over the cap, body ended early, missing
extra) or 502 ``adapter_integrity_failed`` (expected and received digest, and the uri).
"""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.adapters.sources.fetch import AdapterSources as AdapterSources, SourceStats as SourceStats
    from lorapage.adapters.sources.parse import (
        FileSource as FileSource,
        HfSource as HfSource,
        HttpsSource as HttpsSource,
        RemoteSource as RemoteSource,
        S3Source as S3Source,
        Source as Source,
        check_local_dir as check_local_dir,
        parse_source as parse_source,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "AdapterSources": "lorapage.adapters.sources.fetch",
        "SourceStats": "lorapage.adapters.sources.fetch",
        "FileSource": "lorapage.adapters.sources.parse",
        "HfSource": "lorapage.adapters.sources.parse",
        "HttpsSource": "lorapage.adapters.sources.parse",
        "RemoteSource": "lorapage.adapters.sources.parse",
        "S3Source": "lorapage.adapters.sources.parse",
        "Source": "lorapage.adapters.sources.parse",
        "check_local_dir": "lorapage.adapters.sources.parse",
        "parse_source": "lorapage.adapters.sources.parse",
    },
)
