"""The embedded engine's defaults agree with each other (issue 38, finding 17): a user who sets
``max_lora_rank`` has those ranks served unless they set an envelope too, and the pre-warm that
moved to ``engine.admin.load`` is still reachable as ``Engine.load_adapter``, with a warning that
names its replacement."""

from __future__ import annotations

import pytest
from hf_reference import make_peft_adapter

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import LorapageError
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_default_envelope_follows_max_lora_rank():
    assert EngineConfig(max_lora_rank=64).envelope_rules == "all:64"
    assert EngineConfig(max_lora_rank=8).envelope_rules == "all:8"
    assert EngineConfig(max_lora_rank=64, shared_envelope="attention:16").envelope_rules == "attention:16"
    assert EngineConfig(shared_envelope="").envelope_rules == ""  # no shape rule, as before


@pytest.fixture(scope="module")
def rank32(tmp_path_factory):
    return make_peft_adapter(TINY_BASE_DIR, tmp_path_factory.mktemp("r32") / "wide", r=32, targets=ALL, seed=3)


@pytest.mark.asyncio
async def test_a_rank_under_max_lora_rank_is_served_without_an_envelope(rank32):
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), max_lora_rank=64, max_loras=2))
    try:
        info = engine.add_adapter("wide", rank32)  # refused (tier dedicated, none here) before
        assert info.rank == 32 and info.serving_tier == "shared"
        out = await engine.run_to_end("Hello", "wide", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 4
    finally:
        await engine.close()


@pytest.mark.asyncio
async def test_an_envelope_the_user_sets_still_refuses(rank32):
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), max_lora_rank=64, max_loras=2, shared_envelope="all:16"))
    try:
        with pytest.raises(LorapageError, match="dedicated"):
            engine.add_adapter("wide", rank32)
    finally:
        await engine.close()


@pytest.mark.asyncio
async def test_load_adapter_is_a_deprecated_alias_of_admin_load():
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), max_loras=2))
    try:
        engine.add_adapter("acme", demo_adapter_dirs()["acme"])
        assert engine.admin.info("acme").status != "resident"
        with pytest.warns(DeprecationWarning, match=r"engine\.admin\.load"):
            await engine.load_adapter("acme")
        assert engine.admin.info("acme").status == "resident"
    finally:
        await engine.close()
