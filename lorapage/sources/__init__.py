"""Where an adapter version's files come from, and how they reach the server verified.

A version's content is ``adapter_config.json`` and ``adapter_model.safetensors``; its digest is
:func:`lorapage.adapters.digest.content_digest` over them. :func:`parse_source` checks a source at
registration and gives its canonical ``uri`` (what the registry stores; passing it back with the
stored digest rebuilds the source on restart). :class:`AdapterSources` fetches it.

Source formats
--------------

``/abs/dir`` or ``file:///abs/dir``
    A directory on the server, only under an adapter root its owner may read from
    (:mod:`~lorapage.sources.roots`: its tenant's ``--adapter-root TENANT=DIR``, else the
    shared ones; symlinks resolved; an entry linking out of the root, or into another tenant's,
    is refused, 403). Read in place, regular files only; ``sha256`` optional. Each fetch re-checks
    the directory against the same roots and, given the registered digest, re-hashes it: files
    changed after registration fail with ``adapter_integrity_failed``. Canonical form:
    ``file:///resolved/dir``.

``https://host[:port]/base/path``
    The base URL of a directory: the server GETs ``<uri>/adapter_config.json`` and
    ``<uri>/adapter_model.safetensors``. ``sha256`` is required. No credentials in the URL, no
    query or fragment. Plain ``http://`` is accepted only for ``127.0.0.1``, ``localhost`` and
    ``::1``. A redirect is followed only to a URL a source could name itself (at most five). No
    host, named or redirected to, may be or resolve to a link-local address (cloud metadata), nor
    to a loopback or private one unless the server allows it (``--allow-private-adapter-sources``:
    a local mirror, tests). Canonical form: scheme and host lower case, no trailing slash.

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

A tenant may name an ``s3://`` bucket or an ``hf://`` organisation only when its entry in the
tenants file lists it (``s3_buckets``, ``hf_orgs``): the server's credentials are not the
tenant's to use on another's bucket or private repository.

Without ``sha256``, a remote source's digest is what its first fetch downloaded (the registry
then stores it, so later fetches are held to it). Every remote download (both files together) is
held to :class:`~lorapage.sources.download.DownloadLimits`: a byte cap (a declared size
over it fails before any byte is read, a body that grows past it fails as it does), a total
deadline and a minimum average rate; it lands in ``<cache_dir>/<digest>/`` only after it
matched, is shared by a tenant's concurrent fetches of the same version, and takes one of that
tenant's download slots. Errors: 400 (``invalid_request``) or 403 (``permission_denied``) at
registration; at fetch 502 ``adapter_source_failed`` (unreachable, HTTP error, refused address
or redirect, over the cap or the deadline, body ended early, missing extra) or 502
``adapter_integrity_failed`` (expected and received digest, and the uri). These go to the admin
who registered; a tenant whose request needed the version gets a generic error of the same code
(the server's log has the detail).
"""

from typing import TYPE_CHECKING

from lorapage._exports import lazy

if TYPE_CHECKING:
    from lorapage.sources.download import DownloadLimits as DownloadLimits
    from lorapage.sources.fetch import AdapterSources as AdapterSources, SourceStats as SourceStats
    from lorapage.sources.parse import (
        FileSource as FileSource,
        HfSource as HfSource,
        HttpsSource as HttpsSource,
        RemoteSource as RemoteSource,
        S3Source as S3Source,
        Source as Source,
        parse_source as parse_source,
    )
    from lorapage.sources.roots import (
        ANYWHERE as ANYWHERE,
        NO_ROOTS as NO_ROOTS,
        AdapterRoots as AdapterRoots,
        check_local_dir as check_local_dir,
    )

__getattr__, __dir__, __all__ = lazy(
    __name__,
    {
        "AdapterSources": "lorapage.sources.fetch",
        "SourceStats": "lorapage.sources.fetch",
        "DownloadLimits": "lorapage.sources.download",
        "FileSource": "lorapage.sources.parse",
        "HfSource": "lorapage.sources.parse",
        "HttpsSource": "lorapage.sources.parse",
        "RemoteSource": "lorapage.sources.parse",
        "S3Source": "lorapage.sources.parse",
        "Source": "lorapage.sources.parse",
        "parse_source": "lorapage.sources.parse",
        "ANYWHERE": "lorapage.sources.roots",
        "NO_ROOTS": "lorapage.sources.roots",
        "AdapterRoots": "lorapage.sources.roots",
        "check_local_dir": "lorapage.sources.roots",
    },
)
