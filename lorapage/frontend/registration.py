"""Registering an adapter version over HTTP: what the body asked for, checked, and its files' source.

Shared by every route that registers (``POST /v1/adapters`` and vLLM's ``POST
/v1/load_lora_adapter``), in ``lorapage serve`` and in the fleet. Registration is the one place
where the server reads a path or fetches a URI named in a request: a directory only under the
adapter roots the owner may read from (its own ``--adapter-root TENANT=DIR``, else the shared
ones; resolved first, symlinks and ``..`` followed, and so is every file in it, so neither the path
nor a link inside it reaches outside those roots or into another tenant's; without a root it is
refused), an https source, or an s3 / hf one from a bucket or organisation the owner's entry in
the tenants file lists (see :mod:`lorapage.sources`). A version without an owner (a
shared one) reads only the shared roots and https.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lorapage.adapters.names import check_adapter_id
from lorapage.errors import AdapterFormatError, AdapterSourceError, InvalidRequestError, PermissionDeniedError
from lorapage.frontend import protocol
from lorapage.frontend.auth import Access
from lorapage.registry.drift_state import check_prompts_param
from lorapage.sources import AdapterRoots, HfSource, S3Source, Source, parse_source
from lorapage.tenancy.tenants import TenantConfig


# Matched whole (fullmatch): with ``match`` and ``$``, "a-priv\n" passed and was listed beside "a-priv".
@dataclass(frozen=True)
class Registration:
    """A new version asked for (``POST /v1/adapters``, or vLLM's ``POST /v1/load_lora_adapter``):
    the id, its owner (None: no tenant's, shared like ``--lora-modules``), where its files are and
    the body field that named them (for errors), what it must hash to, the base it was trained
    on, and whether the id moves to it now."""

    id: str
    owner: str | None
    source: str
    source_param: str = "source"
    sha256: str | None = None
    expected_base_digest: str | None = None
    activate: bool = True
    check_prompts: tuple[str, ...] | None = None  # checked against the bounds (drift_state)
    sample_check_prompts: bool | None = None


def check_tenant(tenant: str, access: Access, param: str = "tenant") -> None:
    """400 unless ``tenant`` is in the tenants file (a registration's owner)."""
    if not access.is_tenant(tenant):
        raise InvalidRequestError(f"tenant {tenant[:100]!r} is not in the tenants file", param=param)


def registration(body: bytes, base_name: str, access: Access) -> Registration:
    """A ``POST /v1/adapters`` body, decoded and checked: the id, the tenant, one source field."""
    req = protocol.decode(body, protocol.AdapterCreateRequest)
    check_adapter_id(req.id, base_name)
    check_tenant(req.tenant, access)
    if (req.source is None) == (req.path is None):
        raise InvalidRequestError("give the adapter's files as `source` (or the older `path`), once", param="source")
    source, param = (req.source, "source") if req.source is not None else (req.path, "path")
    assert source is not None
    prompts = check_prompts_param(req.check_prompts) if req.check_prompts is not None else None
    return Registration(
        req.id,
        req.tenant,
        source,
        param,
        req.sha256,
        req.expected_base_digest,
        req.activate,
        prompts,
        req.sample_check_prompts,
    )


async def checked_source(reg: Registration, roots: AdapterRoots, access: Access) -> str:
    """The registration's source as a canonical URI: a directory only under the ``roots`` its
    owner may read from (the shared ones for no owner), a bucket or an organisation only one its
    owner's entry lists. Checked in a worker (the file system is read: symlinks resolved, roots
    enforced)."""
    parsed = await asyncio.get_running_loop().run_in_executor(
        None, lambda: parse_source(reg.source, sha256=reg.sha256, roots=roots.for_requests(), owner=reg.owner)
    )
    check_origin(parsed, access.tenants.get(reg.owner) if reg.owner is not None else None)
    return parsed.uri


def check_origin(source: Source, tenant: TenantConfig | None) -> None:
    """Refuse (403) an s3 bucket or an hf organisation ``tenant``'s entry does not list (with no
    tenant, any): the server's credentials reach buckets and private repositories that are not
    the tenant's."""
    if isinstance(source, S3Source):
        field, name = "s3_buckets", source.bucket
        allowed = tenant is not None and tenant.may_read_bucket(name)
    elif isinstance(source, HfSource):
        field, name = "hf_orgs", source.repo_id.partition("/")[0]
        allowed = tenant is not None and tenant.may_read_hf_org(name)
    else:
        return
    if allowed:
        return
    if tenant is None:
        raise PermissionDeniedError(
            f"an adapter without an owner may not come from {name!r}: name the tenant it is for (its "
            f"tenants.<name>.{field} in the tenants file must list {name!r})",
            param="source",
        )
    raise PermissionDeniedError(
        f"tenant {tenant.name!r} may not register adapters from {name!r}: list it in tenants.{tenant.name}.{field} "
        "in the tenants file",
        param="source",
    )


@contextmanager
def source_errors(reg: Registration) -> Iterator[None]:
    """Errors about the adapter's files name the field the caller used (``source``, ``path``, ``lora_path``)."""
    try:
        yield
    except (AdapterFormatError, AdapterSourceError, InvalidRequestError, PermissionDeniedError) as exc:
        if exc.param in (None, "source", "path"):
            exc.param = reg.source_param
        raise
