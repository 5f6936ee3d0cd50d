"""``lorapage serve --auto-promote`` promotes a hot adapter too, not only one outside the shared
envelope: the fleet ingress's rules (:class:`~lorapage.fleet.promotion.PromotionPolicy`) on each
answer's output tokens. First pure, on a fake clock with a stub primary; then over real HTTP with
the tiny model and the threshold lowered by the flags."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from server_harness import make_engine, running_server

from lorapage.serve.cli import build_parser, promotion_rules
from lorapage.serve.dedicated import ACTOR, LocalDedicated, LocalPromotion

COMP = "/v1/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def flags(*argv: str):
    return promotion_rules(build_parser().parse_args(list(argv)))


def stub_primary() -> SimpleNamespace:
    """What judging asks of the primary engine: an id's current version, on this base."""
    row = lambda name: SimpleNamespace(key=f"{name.split('@')[0]}@2", base_digest="d")  # noqa: E731
    return SimpleNamespace(admin=SimpleNamespace(catalog=SimpleNamespace(row=row)), digest="d")


def dedicated_on(clock: Clock, *, auto: bool = True) -> tuple[LocalDedicated, list[tuple[str, float]]]:
    """Thresholds by the flags: promote at 100 tokens/s held 20 s, demote under 10 held 60 s; the
    promotions it starts recorded (version, when), not carried out."""
    rules = flags("--promote-tokens-per-s", "100", "--demote-tokens-per-s", "10", "--promote-after", "20",
                  "--demote-after", "60")  # fmt: skip
    dedicated = LocalDedicated(stub_primary(), auto=auto, rules=rules, clock=clock, interval_s=5.0)  # type: ignore[arg-type]
    started: list[tuple[str, float]] = []

    def promote(key: str, actor: str) -> LocalPromotion:  # starting, for good: no engine is built
        started.append((key, clock.now))
        promotion = dedicated._by_id[key.split("@")[0]] = LocalPromotion(key.split("@")[0], key, "starting", actor, 0.0)
        return promotion

    dedicated.promote = promote  # type: ignore[method-assign]
    return dedicated, started


def test_an_adapter_whose_rate_stays_over_the_threshold_is_promoted_a_burst_is_not():
    """Rates decay with a 30 s half-life: a steady 300 tokens/s reaches 100 after ~17.5 s (t=118),
    stays over it 20 s (t=138), and is promoted at the next judgement (every 5 s at most)."""
    clock = Clock()
    dedicated, started = dedicated_on(clock)
    for _ in range(10):  # a burst: 2,000 tokens in one second (46 tokens/s at most), then nothing
        dedicated.observe("burst@1", 200)
        clock.now += 0.1
    for second in range(60):
        clock.now = 100.0 + second
        dedicated.observe("hot@1", 300)
        dedicated.observe(None, 10_000)  # the base: not an adapter's traffic
        dedicated.observe("cool@1", 50)  # 50 tokens/s: under the threshold for good
    assert [key for key, _ in started] == ["hot@2"]  # its current version, once (then it is starting)
    assert 138.0 <= started[0][1] < 138.0 + 5.0 + 1.0


def test_without_auto_nothing_is_counted():
    clock = Clock()
    dedicated, started = dedicated_on(clock, auto=False)
    for second in range(60):
        clock.now = float(second)
        dedicated.observe("hot@1", 1_000)
    assert started == [] and dedicated.policy.rates.keys() == []


async def test_an_automatic_promotion_gone_cold_is_demoted_an_admins_stays():
    clock = Clock()
    dedicated, _ = dedicated_on(clock)
    demoted: list[str] = []

    async def demote(adapter_id: str, actor: str) -> None:
        demoted.append(f"{adapter_id} by {actor}")

    dedicated.demote = demote  # type: ignore[method-assign]
    for adapter_id, actor in (("auto", ACTOR), ("pinned", "admin:ops")):
        dedicated._by_id[adapter_id] = LocalPromotion(adapter_id, f"{adapter_id}@1", "merged", actor, 0.0)
        dedicated.observe(f"{adapter_id}@1", 10)
    dedicated.judge()  # starts the wait under 10 tokens/s
    clock.now = 61.0
    dedicated.judge()
    await asyncio.sleep(0)
    assert demoted == ["auto by auto-promotion"]


@pytest.mark.asyncio(loop_scope="module")
async def test_serve_promotes_a_hot_adapter_and_serves_it_merged():
    rules = flags("--promote-tokens-per-s", "0.5", "--demote-tokens-per-s", "0", "--promote-after", "0")
    engine = make_engine()
    dedicated = LocalDedicated(engine, auto=True, rules=rules, interval_s=0.0)
    body = {"model": "acme", "prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    try:
        async with running_server(engine, dedicated=dedicated) as srv:
            status, first, _ = await srv.post(COMP, body)
            assert status == 200 and dedicated.promotions.get("acme") is None  # 12 tokens: ~0.28 tokens/s
            assert (await srv.post(COMP, {**body, "model": "globex"}))[0] == 200
            assert (await srv.post(COMP, body))[0] == 200  # ~0.55 tokens/s, over the flags' 0.5: promoted
            deadline = time.monotonic() + 60
            while (p := dedicated.promotions.get("acme")) is None or p.state != "merged":
                assert p is None or p.state == "starting", p
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            assert p.actor == ACTOR and p.check is not None and p.check["passed"]
            assert dedicated.promotions.get("globex") is None  # one answer: not hot
            status, merged, _ = await srv.post(COMP, body)
            assert status == 200 and merged["choices"][0]["text"] == first["choices"][0]["text"]
            assert dedicated.route(p.key) is p
    finally:
        await dedicated.close()
        await engine.close()


def test_serve_refuses_rules_without_hysteresis_naming_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        flags("--auto-promote", "--demote-tokens-per-s", "700")  # over the default 640
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--demote-" in err and "hysteresis" in err and "700" in err
