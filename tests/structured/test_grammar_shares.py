"""Grammar compiles are shared among tenants (issue 38, finding 3): one tenant's slow schemas
wait behind each other, not in front of another tenant's; a compile past its deadline is refused
and no longer holds a thread the others need; a request's branches (and later requests for a
cached spec) copy one compile. A compile is made slow here by holding it on an event, so each
case asserts on what finished before what, never on elapsed time."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from engine_util import collect, tiny_engine

import lorapage.structured.grammars as grammars
from lorapage import SamplingParams
from lorapage.errors import InvalidRequestError
from lorapage.structured import StructuredSpec

GUARD_S = 30.0  # a bound on waits that must end long before it; only a hang reaches it


def _schema(i: int) -> StructuredSpec:
    return StructuredSpec("json", json.dumps({"type": "object", "properties": {f"h{i}": {"type": "integer"}}}))


def _held(compiler: grammars.GrammarCompiler, held: set[StructuredSpec]) -> tuple[threading.Event, list[str]]:
    """Compiles of ``held`` specs wait for the returned event; every spec compiled is listed."""
    release, compiled = threading.Event(), []
    text = compiler._text

    def slow(spec: StructuredSpec) -> str:
        compiled.append(spec.kind)
        if spec in held:
            release.wait(GUARD_S)
        return text(spec)

    compiler._text = slow  # type: ignore[method-assign]
    return release, compiled


async def test_one_tenants_slow_compiles_do_not_hold_anothers() -> None:
    engine = tiny_engine()
    compiler = engine.debug.grammars
    hostile = {_schema(i) for i in range(4)}
    release, _ = _held(compiler, hostile)
    try:
        stuck = [asyncio.ensure_future(compiler.constraint(spec, "H")) for spec in hostile]
        await asyncio.sleep(0)
        mine = await asyncio.wait_for(compiler.constraint(StructuredSpec("json_object", ""), "B"), GUARD_S)
        assert mine.error is None and not any(t.done() for t in stuck)  # B compiled while H's four waited
    finally:
        release.set()
        await asyncio.gather(*stuck, return_exceptions=True)
        await engine.close()


async def test_a_compile_past_its_deadline_is_refused_and_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammars, "COMPILE_TIMEOUT_S", 0.2)
    engine = tiny_engine()
    compiler = engine.debug.grammars
    slow, other = _schema(0), _schema(1)
    release, _ = _held(compiler, {slow, other})
    workers = compiler._workers
    try:
        with pytest.raises(InvalidRequestError, match="took longer than 0.2 s to compile") as err:
            await compiler.constraint(slow, "H")
        assert err.value.param == "response_format" and workers.spares == 1  # the running compile is covered
        with pytest.raises(InvalidRequestError):
            await compiler.constraint(other, "C")  # a second overrun, another tenant's: covered too
        assert workers.spares == 2
        mine = await asyncio.wait_for(compiler.constraint(StructuredSpec("json_object", ""), "B"), GUARD_S)
        assert mine.error is None  # two threads still serve the others
    finally:
        release.set()
    for _ in range(200):  # the overruns end once released; their spares retire
        if workers.spares == 0:
            break
        await asyncio.sleep(0.05)
    assert workers.spares == 0
    await engine.close()


async def test_a_requests_branches_and_later_requests_copy_one_compile() -> None:
    engine = tiny_engine()
    compiler = engine.debug.grammars
    release, compiled = _held(compiler, set())
    spec = StructuredSpec.of_choices(["yes", "no"])
    try:
        await collect(engine, "Hi", None, SamplingParams(max_tokens=4, n=8, seed=1, structured=spec), tenant="A")
        await collect(engine, "Hello", None, SamplingParams(max_tokens=4, structured=spec), tenant="B")
        assert compiled == ["choice"], compiled  # one compile: 8 branches and a later request copy it
        copies = await compiler.constraints(spec, 2, "B")
        assert copies[0].matcher is not copies[1].matcher
    finally:
        release.set()
        await engine.close()
