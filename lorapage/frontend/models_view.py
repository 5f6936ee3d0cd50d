"""``GET /v1/models`` per tenant, cheap: an index of adapter ids by owner, answers cached per tenant.

Listing every registered adapter and asking, one by one, whether the tenant may use it cost
220 ms of event loop per call at 5,000 adapters. Here the adapters that serve a version are
indexed once per change (by owner, and the unowned ones apart), a tenant's list is its own
adapters plus the unowned ones its ``adapters`` list opens, and the encoded answer is kept per
tenant (the most recent :data:`CACHED_TENANTS`) until the view's key changes: the registry's
generation, the owners' and tenants file's (:attr:`Access.generation`), and whatever the server
adds (versions being deleted). Shared by ``lorapage serve`` and the fleet's ingress.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import msgspec

from lorapage.frontend.auth import Access
from lorapage.frontend.responses import Model, ModelList
from lorapage.tenancy.tenants import SHARED

CACHED_TENANTS = 256  # encoded answers kept (least recently used out first)


@dataclass(frozen=True)
class BaseCard:
    """What every entry of the list says about the base model."""

    name: str
    max_model_len: int
    created: int
    serves_base: bool = True  # False: a dedicated deployment, whose one model is its merged adapter

    def base(self) -> Model:
        return Model(
            id=self.name, created=self.created, owned_by="lorapage", root=self.name, max_model_len=self.max_model_len
        )

    def adapter(self, model_id: str, tenant: str) -> Model:
        return Model(
            id=model_id,
            created=self.created,
            owned_by=tenant,
            parent=self.name,
            root=self.name,
            max_model_len=self.max_model_len,
        )


class ModelsView:
    """A tenant's ``/v1/models`` body: the base, then the adapters it may use that serve a version now."""

    def __init__(
        self,
        access: Access,
        card: BaseCard,
        *,
        serving: Callable[[], Iterable[str]],
        key: Callable[[], Hashable],
        more_bases: Sequence[BaseCard] = (),
        base_of: Callable[[str], str | None] | None = None,
    ) -> None:
        """``more_bases``: the other bases a server runs beside ``card``'s (listed after it);
        ``base_of``: the name of the base an adapter id runs on (None: ``card``'s), asked when
        the view is rebuilt, after ``serving``."""
        self.access, self.card = access, card
        self._cards = {c.name: c for c in (card, *more_bases)}
        self._base_of = base_of
        self._parents: dict[str, BaseCard] = {}  # adapter id -> the card of the base it runs on, when not ``card``
        self._serving = serving  # adapter ids that serve a version now (read once per change)
        self._key = key
        self._built: Hashable = None
        self._owned: dict[str, list[str]] = {}  # tenant -> its adapter ids, sorted
        self._shared: list[str] = []  # adapter ids without an owner, sorted
        self._shared_set: frozenset[str] = frozenset()
        self._bodies: OrderedDict[str, bytes] = OrderedDict()

    def card_named(self, name: str | None) -> BaseCard:
        """The card of the base named ``name`` (None, or a name not served: the first base's)."""
        return self._cards.get(name, self.card) if name is not None else self.card

    def body(self, tenant: str) -> bytes:
        """The encoded model list for ``tenant``."""
        self._refresh()
        body = self._bodies.get(tenant)
        if body is None:
            base = [c.base() for c in self._cards.values()] if self.card.serves_base else []
            parents = self._parents
            data = [*base, *(parents.get(i, self.card).adapter(i, tenant) for i in self.adapter_ids(tenant))]
            body = msgspec.json.encode(ModelList(data=data))
            self._bodies[tenant] = body
            if len(self._bodies) > CACHED_TENANTS:
                self._bodies.popitem(last=False)
        else:
            self._bodies.move_to_end(tenant)
        return body

    def adapter_ids(self, tenant: str) -> list[str]:
        """The adapter ids ``tenant`` may use that serve a version now, sorted."""
        self._refresh()
        own = self._owned.get(tenant, [])
        config = self.access.tenants.tenants.get(tenant)
        if config is None:
            return own
        if SHARED in config.adapters:
            shared = self._shared
        else:
            shared = sorted(i for i in config.adapters if i in self._shared_set)
        return sorted([*own, *shared]) if own and shared else own or shared

    def _refresh(self) -> None:
        key = (self._key(), self.access.generation)
        if key == self._built:
            return
        owned: dict[str, list[str]] = {}
        shared = []
        self._parents = {}
        for adapter_id in self._serving():
            name = self._base_of(adapter_id) if self._base_of is not None else None
            if name is not None and name != self.card.name:
                self._parents[adapter_id] = self._cards[name]
            owner = self.access.owners.get(adapter_id)
            if owner is None:
                shared.append(adapter_id)
            else:
                owned.setdefault(owner, []).append(adapter_id)
        self._owned = {tenant: sorted(ids) for tenant, ids in owned.items()}
        self._shared = sorted(shared)
        self._shared_set = frozenset(shared)
        self._bodies.clear()
        self._built = key
