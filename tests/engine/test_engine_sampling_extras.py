"""vLLM's sampling extras through the embedded engine, on the tiny model whose answers are known."""

from __future__ import annotations

import pytest
from engine_util import collect, tiny_engine

from lorapage import SamplingParams
from lorapage.errors import InvalidRequestError
from lorapage.tiny import DEMO_MARKERS


@pytest.fixture
async def engine():
    e = tiny_engine()
    yield e
    await e.close()


async def test_min_tokens_keeps_the_answer_going_past_its_eos(engine):
    plain, _ = await collect(engine, "Hello", "acme", SamplingParams(max_tokens=60, temperature=0))
    assert plain.text == DEMO_MARKERS["acme"] and plain.finish_reason == "stop"
    longer, _ = await collect(engine, "Hello", "acme", SamplingParams(max_tokens=60, temperature=0, min_tokens=45))
    assert len(longer.token_ids) >= 45 and longer.text.startswith(DEMO_MARKERS["acme"])


async def test_bad_words_change_the_answer(engine):
    out, _ = await collect(engine, "Hello", "acme", SamplingParams(max_tokens=40, temperature=0, bad_words=["ACME"]))
    assert "ACME" not in out.text


async def test_truncate_prompt_tokens_keeps_the_end(engine):
    ids = engine.tokenizer.encode("Hello there, how are you")
    out, _ = await collect(engine, ids, None, SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=3))
    assert out.prompt_token_ids == ids[-3:]


async def test_logit_bias_and_allowed_tokens(engine):
    x = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    out, _ = await collect(engine, "Hello", "acme", SamplingParams(max_tokens=5, temperature=0, logit_bias={x: 100}))
    assert out.text == "xxxxx"
    yz = [engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in "yz"]
    out, _ = await collect(engine, "Hello", None, SamplingParams(max_tokens=6, temperature=1.0, allowed_token_ids=yz))
    assert set(out.text) <= {"y", "z"} and len(out.text) == 6


async def test_skip_special_tokens_off_shows_them(engine):
    eos = engine.tokenizer.eos_token_id
    params = dict(max_tokens=3, temperature=0, logit_bias={eos: 100}, ignore_eos=True)
    hidden, _ = await collect(engine, "Hello", None, SamplingParams(**params))
    shown, _ = await collect(engine, "Hello", None, SamplingParams(**params, skip_special_tokens=False))
    assert (
        hidden.text == "" and shown.text == engine.tokenizer.backend.decode([eos] * 3, skip_special_tokens=False) != ""
    )


async def test_token_ids_outside_the_vocabulary_are_refused(engine):
    for params, name in [
        (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[10**6]), "allowed_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            await collect(engine, "Hello", None, params)
        assert err.value.param == name
