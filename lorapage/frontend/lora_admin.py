"""vLLM's runtime LoRA routes, ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``,
as lorapage's own admin operations.

Both take the admin key (vLLM's take its ``--api-key``; in lorapage's single-tenant mode that key is
the admin key too, see :mod:`lorapage.tenancy.tenants`). A load is a registration with the rules of
``POST /v1/adapters`` (:mod:`lorapage.frontend.registration`): ``lora_name`` is the adapter id,
``lora_path`` its source (a directory under an ``--adapter-root``, or a URI). Its owner is the
body's ``tenant`` (a lorapage extension) when given; without one the adapter has no owner, like
a ``--lora-modules`` adapter, and the tenants whose ``adapters`` list names it (or holds
``"*"``) may use it. A name already registered is refused as vLLM refuses it, unless
``load_inplace``: then the files become a new version of the id (the same content is the same
version), which requests get from then on. An unload deletes every version of the id, draining:
requests running finish, new ones get 404 (as ``DELETE /v1/adapters/{id}?drain=true``).

Success is answered as vLLM answers it, with a line of plain text; a refusal is OpenAI's error
JSON (vLLM's error shape).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import msgspec

from lorapage.adapters.names import check_adapter_id
from lorapage.errors import AdapterNotFoundError, InvalidRequestError
from lorapage.frontend import protocol
from lorapage.frontend.auth import Access
from lorapage.frontend.registration import Registration, check_tenant


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's load body, with lorapage's registration fields as extensions."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    tenant: str | None = None  # lorapage: the owner (None: a shared adapter)
    sha256: str | None = None  # lorapage: the content digest it must have (required for https)
    expected_base_digest: str | None = None  # lorapage: the base it was trained on
    base_model_name: str | None = None  # vLLM's; must name the one base served, when given


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's engine-internal id: lorapage names adapters only


def lora_registration(body: bytes, base_name: str, access: Access, known_ids: Iterable[str]) -> Registration:
    """A load body, decoded and checked, as the registration it asks for."""
    req = protocol.decode(body, LoadLoraRequest)
    if not req.lora_name or not req.lora_path:
        raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    check_adapter_id(req.lora_name, base_name, param="lora_name")
    if req.tenant is not None:
        check_tenant(req.tenant, access)
    if req.base_model_name is not None and req.base_model_name != base_name:
        raise InvalidRequestError(
            f"base_model_name {req.base_model_name[:100]!r} is not the base this server runs ({base_name!r})",
            param="base_model_name",
        )
    if not req.load_inplace and req.lora_name in set(known_ids):
        raise InvalidRequestError(
            f"The lora adapter '{req.lora_name}' has already been loaded. Send load_inplace: true to register "
            "these files as its new version (or POST /v1/adapters).",
            param="lora_name",
        )
    return Registration(
        req.lora_name, req.tenant, req.lora_path, "lora_path", req.sha256, req.expected_base_digest, activate=True
    )


def lora_unload_name(body: bytes) -> str:
    """The adapter id an unload body names."""
    req = protocol.decode(body, UnloadLoraRequest)
    if req.lora_int_id is not None:
        raise InvalidRequestError(
            "lora_int_id is not supported by lorapage: name the adapter by lora_name", param="lora_int_id"
        )
    if not req.lora_name:
        raise InvalidRequestError("lora_name must name the adapter to unload", param="lora_name")
    return req.lora_name


@contextmanager
def lora_not_found(name: str) -> Iterator[None]:
    """An unknown adapter's 404 says so in vLLM's words."""
    try:
        yield
    except AdapterNotFoundError:
        raise AdapterNotFoundError(f"The lora adapter '{name[:200]}' cannot be found.", param="lora_name") from None


def lora_success_text(name: str, done: str) -> str:
    """vLLM's answer to a load (``done`` = "added") or an unload ("removed")."""
    return f"Success: LoRA adapter '{name}' {done} successfully."
