"""Tenants file parsing, validation errors, API-key lookup and who may use which adapter."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

import lorapage.tenancy.tenants as tenants_mod
from lorapage.frontend import Access, hash_key
from lorapage.tenancy.slo import SloTargets
from lorapage.tenancy.tenants import SHARED, TenantConfig, TenantsConfig, TenantsConfigError


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


EXAMPLE = f"""
[admin]
key_sha256 = ["{digest("admin-key")}"]

[tenants.acme]
key_sha256 = ["{digest("acme-1")}", "{digest("acme-2").upper()}"]
adapters = ["acme-support"]
weight = 2
rpm = 600
tpm = 200000
tpm_burst = 50000
max_concurrency = 32
prefix_cache_group = "acme-family"

[tenants.globex]
key_sha256 = ["{digest("globex-1")}"]

[tenants.initech]
adapters = ["*"]

[metrics]
key_sha256 = ["{digest("scraper")}"]
"""


def test_parses_the_documented_shape():
    cfg = TenantsConfig.from_toml(EXAMPLE)
    acme = cfg.get("acme")
    assert acme.weight == 2.0 and acme.rpm == 600 and acme.tpm == 200000 and acme.max_concurrency == 32
    assert acme.rpm_bucket == 600  # burst defaults to the per-minute limit
    assert acme.tpm_bucket == 50000
    assert acme.adapters == {"acme-support"}
    assert acme.prefix_cache_group == "acme-family"
    globex = cfg.get("globex")
    assert globex.adapters == frozenset()  # omitted: no shared adapter
    assert (globex.rpm, globex.tpm, globex.max_concurrency, globex.rpm_bucket) == (None, None, None, None)
    assert cfg.get("initech").adapters == {SHARED}
    assert globex.prefix_cache_group is None  # omitted: its cached prefixes are its own
    assert cfg.weights() == {"acme": 2.0, "globex": 1.0, "initech": 1.0}


def test_api_keys_resolve_by_digest():
    cfg = TenantsConfig.from_toml(EXAMPLE)
    assert cfg.authenticate("acme-1") == "acme"
    assert cfg.authenticate("acme-2") == "acme"  # stored upper-case, compared lower-case
    assert cfg.authenticate("globex-1") == "globex"
    assert cfg.authenticate("nope") is None
    assert cfg.authenticate(digest("acme-1")) is None  # the digest itself is not a key
    assert cfg.is_admin("admin-key") and not cfg.is_admin("acme-1") and not cfg.is_admin("scraper")
    assert cfg.may_scrape("scraper") and cfg.may_scrape("admin-key") and not cfg.may_scrape("acme-1")
    assert hash_key("acme-1") == digest("acme-1")


def test_access_fails_closed_and_the_owner_wins():
    access = Access(TenantsConfig.from_toml(EXAMPLE))
    # Unowned adapters (from --lora-modules): by name, or every one with "*"; never by omission.
    assert access.may_use("acme", "acme-support") and not access.may_use("acme", "shared-bot")
    assert access.may_use("initech", "shared-bot") and access.may_use("initech", "acme-support")
    assert not access.may_use("globex", "shared-bot") and not access.may_use("globex", "acme-support")
    # Owned adapters: their owner only, whatever a list says.
    access.set_owner("acme-support", "globex")
    access.set_owner("globex-bot", "globex")
    assert access.may_use("globex", "acme-support") and access.may_use("globex", "globex-bot")
    assert not access.may_use("acme", "acme-support")  # named in acme's list, but the admin gave it to globex
    assert not access.may_use("initech", "globex-bot")  # "*" opens unowned adapters only
    assert not access.may_use("nobody", "shared-bot")  # an unknown tenant gets nothing


def test_only_the_sole_user_of_an_adapter_may_see_where_it_is():
    """``x-adapter-tier`` shows another tenant's use of an adapter both may use: it is shown only
    to a tenant no other may use the adapter beside."""
    body = EXAMPLE + '[tenants.umbrella]\nadapters = ["acme-support", "umbrella-bot"]\n'
    access = Access(TenantsConfig.from_toml(body))
    assert not access.sole_user("acme", "acme-support")  # initech ("*") and umbrella may use it too
    assert not access.sole_user("umbrella", "umbrella-bot")  # initech may, through "*"
    assert not access.sole_user("globex", "acme-support")  # not globex's at all
    access = Access(TenantsConfig.from_toml(body.replace('adapters = ["*"]', "")))  # initech opens none
    assert access.sole_user("umbrella", "umbrella-bot") and not access.sole_user("acme", "acme-support")
    access.set_owner("acme-support", "globex")
    access.set_owner("umbrella-bot", "acme")
    assert access.sole_user("globex", "acme-support")  # the owner alone may use it, whatever the lists say
    assert not access.sole_user("umbrella", "umbrella-bot") and not access.sole_user("acme", "globex-bot")
    assert access.prefix_group("acme") == "acme-family" and access.prefix_group("globex") is None
    assert access.prefix_group("nobody") is None


def test_a_key_is_found_by_its_digest_whatever_the_number_of_keys(monkeypatch):
    """A presented key is hashed once and looked up: no comparison with any stored digest, so a
    bogus key costs the same at 50,000 keys as at 3 (it was compared with every one)."""
    compared, hashed = [], []
    real_compare, real_hash = tenants_mod.hmac.compare_digest, tenants_mod.hash_key
    monkeypatch.setattr(tenants_mod.hmac, "compare_digest", lambda a, b: compared.append(a) or real_compare(a, b))
    monkeypatch.setattr(tenants_mod, "hash_key", lambda key: hashed.append(key) or real_hash(key))
    many = {f"t{i}": TenantConfig(f"t{i}", key_sha256=(real_hash(f"key-{i}"),)) for i in range(50_000)}
    for cfg in (TenantsConfig.from_toml(EXAMPLE), TenantsConfig(many)):
        compared.clear()
        hashed.clear()
        assert cfg.authenticate("not-a-key") is None
        assert compared == [] and hashed == ["not-a-key"]
    assert TenantsConfig(many).authenticate("key-31337") == "t31337"
    assert TenantsConfig.from_toml(EXAMPLE).authenticate("acme-1") == "acme"
    compared.clear()
    assert TenantsConfig.from_toml(EXAMPLE).may_scrape("scraper")
    assert len(compared) == 2  # the few admin and metrics digests: each compared in constant time


def test_config_is_immutable():
    cfg = TenantsConfig.from_toml(EXAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.get("acme").rpm = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.tenants["evil"] = cfg.get("acme")  # type: ignore[index]


def test_load_from_file(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(EXAMPLE)
    assert sorted(TenantsConfig.load(path).tenants) == ["acme", "globex", "initech"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[tenants.a]\nrmp = 5\n", r"tenants\.a: unknown field\(s\) \['rmp'\]"),
        ("[tenants.a]\nweight = 0\n", r"tenants\.a\.weight: expected a number > 0"),
        ("[tenants.a]\nweight = true\n", r"tenants\.a\.weight"),
        ("[tenants.a]\nrpm = 0\n", r"tenants\.a\.rpm: expected an integer >= 1"),
        ("[tenants.a]\ntpm = 1.5\n", r"tenants\.a\.tpm: expected an integer"),
        ("[tenants.a]\nmax_concurrency = true\n", r"tenants\.a\.max_concurrency"),
        ("[tenants.a]\nrpm_burst = 10\n", r"tenants\.a\.rpm_burst: set rpm too"),
        ("[tenants.a]\nadapters = 'x'\n", r"tenants\.a\.adapters: expected a list"),
        ("[tenants.a]\nprefix_cache_group = ''\n", r"tenants\.a\.prefix_cache_group: expected a name of 1 to"),
        ("[tenants.a]\nprefix_cache_group = 3\n", r"tenants\.a\.prefix_cache_group"),
        (f"[tenants.a]\nprefix_cache_group = '{'g' * 129}'\n", r"tenants\.a\.prefix_cache_group"),
        ("[tenants.a]\nkey_sha256 = ['my-secret-key']\n", r"tenants\.a\.key_sha256: .*not a sha256 hex digest"),
        ("[tenants.a]\nkey_sha256 = 'abc'\n", r"tenants\.a\.key_sha256: expected a list"),
        ("[admin]\nkeys = []\n", r"admin: unknown field"),
        ("[metrics]\nkey = 'x'\n", r"metrics: unknown field"),
        ("[metrics]\ntenant = 'a'\n[tenants.a]\n", r"metrics: unknown field"),
        ("[admin]\ntenant = 'nobody'\n[tenants.a]\n", r"admin\.tenant: 'nobody' is not a tenant"),
        ("[admin]\ntenant = 3\n", r"admin\.tenant: expected a tenant's name"),
        ("[tenant.a]\n", r"unknown section"),
        ("tenants = 3\n", r"tenants: expected a table"),
        ("[tenants.a\n", r"not valid TOML"),
        ("[tenants.a]\nslo_ttft_p95_s = 0\n", r"tenants\.a\.slo_ttft_p95_s: expected a finite number of seconds > 0"),
        ("[tenants.a]\nslo_itl_p95_s = '0.1'\n", r"tenants\.a\.slo_itl_p95_s: expected a finite number"),
        ("[tenants.a]\nslo_itl_p95_s = inf\n", r"tenants\.a\.slo_itl_p95_s"),
        ("[tenants.a]\nslo_error_rate = 1\n", r"tenants\.a\.slo_error_rate: expected a fraction between 0 and 1"),
        ("[tenants.a]\nslo_error_rate = true\n", r"tenants\.a\.slo_error_rate"),
        ("[defaults]\nslo_error_rate = 0\n", r"defaults\.slo_error_rate: expected a fraction"),
        ("[defaults]\nweight = 2\n", r"defaults: unknown field\(s\) \['weight'\]; a default may be set for slo_"),
        ("defaults = 3\n", r"defaults: expected a table"),
    ],
)
def test_errors_name_the_bad_field(body, expected):
    with pytest.raises(TenantsConfigError, match=expected):
        TenantsConfig.from_toml(body)


def test_slo_targets_take_the_defaults_a_tenant_does_not_set():
    config = TenantsConfig.from_toml(
        "[defaults]\nslo_ttft_p95_s = 5\nslo_error_rate = 0.01\n"
        "[tenants.a]\nslo_ttft_p95_s = 0.5\nslo_itl_p95_s = 0.05\n"
        "[tenants.b]\n"
    )
    assert config.slo_targets() == {
        "a": SloTargets(ttft_p95_s=0.5, itl_p95_s=0.05, error_rate=0.01),
        "b": SloTargets(ttft_p95_s=5.0, itl_p95_s=None, error_rate=0.01),
    }
    assert TenantsConfig.from_toml("[tenants.c]\n").get("c").slo == SloTargets()  # none set: none judged


def test_a_key_belongs_to_one_tenant():
    body = f"[tenants.a]\nkey_sha256 = ['{digest('k')}']\n[tenants.b]\nkey_sha256 = ['{digest('k')}']\n"
    with pytest.raises(TenantsConfigError, match=r"tenants\.b\.key_sha256: .*also a key of tenants\.a"):
        TenantsConfig.from_toml(body)
    body = f"[admin]\nkey_sha256 = ['{digest('k')}']\n[tenants.a]\nkey_sha256 = ['{digest('k')}']\n"
    with pytest.raises(TenantsConfigError, match=r"also a key of \[admin\]"):
        TenantsConfig.from_toml(body)
    body = f"[admin]\nkey_sha256 = ['{digest('k')}']\n[metrics]\nkey_sha256 = ['{digest('k')}']\n"
    with pytest.raises(TenantsConfigError, match=r"metrics\.key_sha256: .*also a key of \[admin\]"):
        TenantsConfig.from_toml(body)


def test_single_tenant_use_makes_the_admin_keys_a_tenants_keys():
    """``[admin] tenant`` (what ``lorapage serve --api-key`` writes): the admin keys authenticate
    as that tenant too, so one key opens every route, as vLLM's --api-key does."""
    body = f"[admin]\nkey_sha256 = ['{digest('one')}', '{digest('two')}']\ntenant = 'default'\n[tenants.default]\n"
    config = TenantsConfig.from_toml(body)
    for key in ("one", "two"):
        assert config.authenticate(key) == "default" and config.is_admin(key) and config.may_scrape(key)
    assert config.authenticate("three") is None and not config.is_admin("three")
    assert TenantsConfig.from_toml(EXAMPLE).authenticate("admin-key") is None  # without it: admin routes only
