"""Tenants: who may call, with which adapters, at what VTC share and quota. Parsed from TOML.

```toml
[admin]
key_sha256 = ["<sha256 hex of the admin key>"]
tenant = "default"            # optional: the admin keys are this tenant's keys too (single-tenant use)

[metrics]                     # optional: keys that may only scrape /metrics (the admin key may too)
key_sha256 = ["<sha256 hex of the scraper's key>"]

[tenants.acme]
key_sha256 = ["<sha256 hex of each API key>"]
adapters = ["acme-support"]   # adapters this tenant may use besides its own; "*": every shared one
weight = 1.0                  # VTC share
rpm = 600                     # requests per minute  (omit: unlimited)
rpm_burst = 600               # bucket size, default rpm
tpm = 200000                  # prompt + prompt-logprob rows + max_tokens x n per minute (omit: unlimited)
tpm_burst = 200000            # bucket size, default tpm; a larger request can never be admitted
max_concurrency = 32          # sequences in flight: prompts x n of each request (omit: its share of the queue)
s3_buckets = ["acme-adapters"]  # s3:// buckets the admin may register this tenant's adapters from
hf_orgs = ["acme"]            # hf:// organisations (or users) likewise; "*": any, in either list
prefix_cache_group = "acme-family"  # tenants naming one group share cached prompt prefixes (omit: its own)
default_max_tokens = 512      # the least a chat without max_tokens is given (it gets what its TPM holds, reserved)
slo_ttft_p95_s = 2.0          # SLO: 95% of first tokens within 2 s (omit: not judged)
slo_itl_p95_s = 0.1           # SLO: 95% of requests with a mean inter-token latency within 0.1 s
slo_error_rate = 0.01         # SLO: at most 1% of answered requests fail (5xx)

[defaults]                    # optional: SLO fields every tenant without its own takes
slo_ttft_p95_s = 5.0
```

SLOs (``slo_*``) are watched, never enforced: they set what ``/metrics`` reports as each tenant's
goodput and burn rates (:mod:`lorapage.tenancy.slo`) and what ``deploy/prometheus/alerts.yml``
alerts on. A tenant's own value wins over ``[defaults]``.

Access fails closed. A tenant may always use the base model and the adapters the admin registered
for it (their owner). ``adapters`` adds adapters without an owner (those from ``--lora-modules``):
by name, or all of them with ``"*"`` (:data:`SHARED`). Omitting it (or ``[]``) opens none. No list
can open an adapter whose owner is another tenant.

A registration for a tenant fetches from ``s3://`` or ``hf://`` with the server's credentials, so
it may name only the buckets and Hub organisations the tenant's ``s3_buckets`` and ``hf_orgs``
list (none by default): another tenant's bucket or a private repository the server can read is
not the tenant's to register from.

Nothing one tenant caches is observable by another unless the operator grouped them: cached
prompt prefixes are the tenant's own unless tenants name one ``prefix_cache_group`` (then, and only
then, one of them can tell by a faster first token that another sent a prompt).

One operator serving only itself (``lorapage serve --api-key KEY``, vLLM's flag) gets one tenant
whose keys are the admin keys (``[admin] tenant``): one key opens every route, as vLLM's
``--api-key`` does. Otherwise a key belongs to one tenant, or to ``[admin]`` or ``[metrics]``.

Keys are stored only as sha256 hex digests. A presented key is hashed once and looked up by its
digest in a dict: constant time in the number of keys, and what the lookup's timing depends on is
the digest, which says nothing usable about a key that would produce it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lorapage.tenancy.slo import NO_SLO, SloTargets

SHARED = "*"  # in a tenant's `adapters`: every adapter that has no owner
# Tenant fields a [defaults] table may set too (SloTargets' fields, "slo_" before each).
SLO_FIELDS = ("slo_ttft_p95_s", "slo_itl_p95_s", "slo_error_rate")

_TENANT_FIELDS = (
    "key_sha256", "adapters", "weight", "rpm", "rpm_burst", "tpm", "tpm_burst", "max_concurrency",
    "s3_buckets", "hf_orgs",
    "prefix_cache_group", "default_max_tokens",
    *SLO_FIELDS,
)  # fmt: skip
# What a chat without max_tokens reserves from its tenant's TPM up front (the rest of its answer
# is charged when it ends, and may put the tenant in debt until its bucket refills).
DEFAULT_MAX_TOKENS = 512
MAX_GROUP_NAME = 128  # characters of a prefix_cache_group
_KEY_SECTIONS = ("admin", "metrics")  # sections that hold nothing but key_sha256
_DEFAULTS = "defaults"  # the section of fields every tenant without its own takes


class TenantsConfigError(ValueError):
    """The tenants file is malformed; the message names the field and what it accepts."""


def hash_key(key: str) -> str:
    """The sha256 hex digest under which a key is stored in the tenants file."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(key: str) -> str:
    """A key's stable short id for audit rows and logs: the first 12 hex of its sha256, never the key."""
    return hash_key(key)[:12]


def _matches(digests: tuple[str, ...], key: str) -> bool:
    """Whether ``key`` hashes to one of ``digests``; every digest is compared (no early exit)."""
    digest = hash_key(key)
    return any([hmac.compare_digest(stored, digest) for stored in digests])


@dataclass(frozen=True)
class TenantConfig:
    """One tenant's keys, adapters, VTC weight and quota (``None``: unlimited)."""

    name: str
    key_sha256: tuple[str, ...] = ()
    adapters: frozenset[str] = frozenset()  # unowned adapters it may use; SHARED: all of them
    weight: float = 1.0
    rpm: int | None = None
    rpm_burst: int | None = None  # None: rpm
    tpm: int | None = None
    tpm_burst: int | None = None  # None: tpm
    max_concurrency: int | None = None
    s3_buckets: frozenset[str] = frozenset()  # s3:// buckets its adapters may come from; SHARED: any
    hf_orgs: frozenset[str] = frozenset()  # hf:// organisations (or users) likewise
    prefix_cache_group: str | None = None  # tenants naming one group share cached prefixes; None: its own
    # TPM reserved up front for a request without max_tokens; the difference is settled at its end.
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    slo: SloTargets = NO_SLO  # watched on /metrics, never enforced

    def may_read_bucket(self, bucket: str) -> bool:
        """Whether this tenant's adapters may come from the S3 bucket ``bucket``."""
        return SHARED in self.s3_buckets or bucket in self.s3_buckets

    def may_read_hf_org(self, org: str) -> bool:
        """Whether this tenant's adapters may come from the Hub organisation (or user) ``org``."""
        return SHARED in self.hf_orgs or org in self.hf_orgs

    @property
    def rpm_bucket(self) -> int | None:
        return self.rpm_burst if self.rpm_burst is not None else self.rpm

    @property
    def tpm_bucket(self) -> int | None:
        return self.tpm_burst if self.tpm_burst is not None else self.tpm


@dataclass(frozen=True)
class TenantsConfig:
    """Every tenant, the admin keys and the metrics keys; immutable (a reload builds a new one)."""

    tenants: Mapping[str, TenantConfig]
    admin_key_sha256: tuple[str, ...] = ()
    metrics_key_sha256: tuple[str, ...] = ()
    admin_tenant: str | None = None  # the tenant the admin keys authenticate as too (None: none)
    _tenant_of: Mapping[str, str] = field(default_factory=dict, repr=False)  # key digest -> tenant
    _open_to_all: tuple[str, ...] = field(default=(), repr=False)  # tenants whose `adapters` holds SHARED
    _named_by: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)  # adapter -> tenants naming it

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", MappingProxyType(dict(self.tenants)))
        sections = [("admin", "[admin]", self.admin_key_sha256), ("metrics", "[metrics]", self.metrics_key_sha256)]
        sections += [(f"tenants.{name}", f"tenants.{name}", t.key_sha256) for name, t in self.tenants.items()]
        owner: dict[str, str] = {}
        for where, label, digests in sections:
            for digest in digests:
                if owner.setdefault(digest, label) != label:
                    raise TenantsConfigError(
                        f"{where}.key_sha256: digest {digest[:12]}... is also a key of {owner[digest]}; "
                        "each API key must belong to one tenant, or to [admin] or [metrics]"
                    )
        tenant_of = {d: name for name, t in self.tenants.items() for d in t.key_sha256}
        if self.admin_tenant is not None:
            if self.admin_tenant not in self.tenants:
                raise TenantsConfigError(
                    f"admin.tenant: {self.admin_tenant!r} is not a tenant; add [tenants.{self.admin_tenant}]"
                )
            tenant_of.update(dict.fromkeys(self.admin_key_sha256, self.admin_tenant))
        object.__setattr__(self, "_tenant_of", MappingProxyType(tenant_of))
        named: dict[str, list[str]] = {}
        for name, t in self.tenants.items():
            for adapter in t.adapters - {SHARED}:
                named.setdefault(adapter, []).append(name)
        object.__setattr__(self, "_named_by", MappingProxyType({a: tuple(ts) for a, ts in named.items()}))
        object.__setattr__(self, "_open_to_all", tuple(n for n, t in self.tenants.items() if SHARED in t.adapters))

    @classmethod
    def load(cls, path: str | Path) -> TenantsConfig:
        path = Path(path)
        return cls.from_toml(path.read_text(encoding="utf-8"), source=str(path))

    @classmethod
    def from_toml(cls, text: str, source: str = "<tenants>") -> TenantsConfig:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise TenantsConfigError(f"{source}: not valid TOML: {e}") from e
        unknown = set(doc) - {*_KEY_SECTIONS, _DEFAULTS, "tenants"}
        if unknown:
            raise TenantsConfigError(
                f"{source}: unknown section(s) {sorted(unknown)}; "
                "expected [admin], [metrics], [defaults] and [tenants.<name>]"
            )
        keys = {}
        for section in _KEY_SECTIONS:
            table = _table(doc.get(section, {}), section)
            fields = ("key_sha256", "tenant") if section == "admin" else ("key_sha256",)
            extra = set(table) - set(fields)
            if extra:
                raise TenantsConfigError(f"{section}: unknown field(s) {sorted(extra)}; expected {', '.join(fields)}")
            keys[section] = _digests_field(table, section)
        admin_tenant = _table(doc.get("admin", {}), "admin").get("tenant")
        if admin_tenant is not None and not isinstance(admin_tenant, str):
            raise TenantsConfigError(f"admin.tenant: expected a tenant's name, got {admin_tenant!r}")
        defaults = _table(doc.get(_DEFAULTS, {}), _DEFAULTS)
        extra = set(defaults) - set(SLO_FIELDS)
        if extra:
            raise TenantsConfigError(
                f"{_DEFAULTS}: unknown field(s) {sorted(extra)}; a default may be set for {', '.join(SLO_FIELDS)}"
            )
        default_slo = _slo_targets(defaults, _DEFAULTS)
        tables = _table(doc.get("tenants", {}), "tenants")
        tenants = {name: _parse_tenant(name, _table(t, f"tenants.{name}"), default_slo) for name, t in tables.items()}
        return cls(tenants, keys["admin"], keys["metrics"], admin_tenant)

    def get(self, name: str) -> TenantConfig:
        try:
            return self.tenants[name]
        except KeyError:
            raise KeyError(f"unknown tenant {name!r}; configured: {sorted(self.tenants)}") from None

    def others_may_use_unowned(self, tenant: str, adapter: str) -> bool:
        """Whether a tenant other than ``tenant`` may use ``adapter`` if it has no owner (its
        ``adapters`` list names it or holds ``"*"``). Constant time in the number of tenants: at
        most two names of each list are looked at."""
        lists = (self._open_to_all, self._named_by.get(adapter, ()))
        return any(other != tenant for names in lists for other in names[:2])

    def slo_targets(self) -> dict[str, SloTargets]:
        """Each tenant's SLO targets (``[defaults]`` filled in)."""
        return {name: t.slo for name, t in self.tenants.items()}

    def weights(self) -> dict[str, float]:
        return {name: t.weight for name, t in self.tenants.items()}

    def authenticate(self, api_key: str) -> str | None:
        """The tenant owning ``api_key``, or None: one hash and one dict lookup, however many
        keys the file holds (a bogus key costs what a good one does)."""
        return self._tenant_of.get(hash_key(api_key))

    def is_admin(self, api_key: str) -> bool:
        return _matches(self.admin_key_sha256, api_key)

    def may_scrape(self, api_key: str) -> bool:
        """Whether ``api_key`` opens ``/metrics``: the admin key or a ``[metrics]`` key."""
        return _matches(self.admin_key_sha256 + self.metrics_key_sha256, api_key)


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TenantsConfigError(f"{where}: expected a table, got {type(value).__name__}")
    return value


def _parse_tenant(name: str, t: dict[str, Any], default_slo: SloTargets = NO_SLO) -> TenantConfig:
    where = f"tenants.{name}"
    unknown = set(t) - set(_TENANT_FIELDS)
    if unknown:
        raise TenantsConfigError(
            f"{where}: unknown field(s) {sorted(unknown)}; known fields: {', '.join(_TENANT_FIELDS)}"
        )
    adapters = t.get("adapters", [])
    if not (isinstance(adapters, list) and all(isinstance(a, str) for a in adapters)):
        raise TenantsConfigError(
            f'{where}.adapters: expected a list of adapter names (or ["{SHARED}"] for every shared adapter), '
            f"got {adapters!r}"
        )
    origins = {}
    for key, what in (("s3_buckets", "S3 bucket names"), ("hf_orgs", "Hugging Face organisations")):
        names = t.get(key, [])
        if not (isinstance(names, list) and all(isinstance(n, str) and n for n in names)):
            raise TenantsConfigError(
                f'{where}.{key}: expected a list of {what} (or ["{SHARED}"] for any), got {names!r}'
            )
        origins[key] = frozenset(names)
    weight = t.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise TenantsConfigError(f"{where}.weight: expected a number > 0, got {weight!r}")
    group = t.get("prefix_cache_group")
    if group is not None and not (isinstance(group, str) and 0 < len(group) <= MAX_GROUP_NAME):
        raise TenantsConfigError(
            f"{where}.prefix_cache_group: expected a name of 1 to {MAX_GROUP_NAME} characters "
            f"(tenants naming one group share cached prompt prefixes; omit it to share with none), got {group!r}"
        )
    limits = {k: _positive_int(t, k, where) for k in ("rpm", "rpm_burst", "tpm", "tpm_burst", "max_concurrency")}
    default_max_tokens = _positive_int(t, "default_max_tokens", where) or DEFAULT_MAX_TOKENS
    for burst, rate in (("rpm_burst", "rpm"), ("tpm_burst", "tpm")):
        if limits[burst] is not None and limits[rate] is None:
            raise TenantsConfigError(f"{where}.{burst}: set {rate} too (a burst size needs a rate)")
    return TenantConfig(
        name=name,
        key_sha256=_digests_field(t, where),
        adapters=frozenset(adapters),
        weight=float(weight),
        s3_buckets=frozenset(t.get("s3_buckets", [])),
        hf_orgs=frozenset(t.get("hf_orgs", [])),
        prefix_cache_group=group,
        default_max_tokens=default_max_tokens,
        slo=_slo_targets(t, where, default_slo),
        **limits,
    )


def _slo_targets(t: dict[str, Any], where: str, default: SloTargets = NO_SLO) -> SloTargets:
    """The ``slo_*`` fields of table ``t`` over ``default``: latency targets in seconds > 0, the
    error rate a fraction in (0, 1)."""
    ttft = _slo_number(t, "slo_ttft_p95_s", where, "a finite number of seconds > 0", upper=math.inf)
    itl = _slo_number(t, "slo_itl_p95_s", where, "a finite number of seconds > 0", upper=math.inf)
    rate = _slo_number(
        t, "slo_error_rate", where, "a fraction between 0 and 1, exclusive (0.01: at most 1% of requests fail)", upper=1
    )
    return SloTargets(
        ttft_p95_s=default.ttft_p95_s if ttft is None else ttft,
        itl_p95_s=default.itl_p95_s if itl is None else itl,
        error_rate=default.error_rate if rate is None else rate,
    )


def _slo_number(t: dict[str, Any], key: str, where: str, expected: str, upper: float) -> float | None:
    value = t.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < upper:
        raise TenantsConfigError(f"{where}.{key}: expected {expected} (omit it: not judged), got {value!r}")
    return float(value)


def _positive_int(t: dict[str, Any], key: str, where: str) -> int | None:
    value = t.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TenantsConfigError(f"{where}.{key}: expected an integer >= 1 (omit it for no limit), got {value!r}")
    return value


def _digests_field(t: dict[str, Any], where: str) -> tuple[str, ...]:
    digests = t.get("key_sha256", [])
    if not isinstance(digests, list):
        raise TenantsConfigError(f"{where}.key_sha256: expected a list of sha256 hex digests, got {digests!r}")
    out = []
    for d in digests:
        ok = isinstance(d, str) and len(d) == 64 and all(c in "0123456789abcdef" for c in d.lower())
        if not ok:
            raise TenantsConfigError(
                f"{where}.key_sha256: {d!r} is not a sha256 hex digest (64 hex characters); "
                "store sha256(api_key).hexdigest(), never the key itself"
            )
        out.append(d.lower())
    return tuple(out)
