"""PEFT variants over the admin API: what registers (DoRA, embedding LoRA; their variant bytes in
the projected cost, kept across a restart) and what is refused, each with its own reason
(modules_to_save: the envelope's 400 with its bytes; the rest: invalid_adapter naming the field)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from hf_reference import make_peft_adapter
from server_harness import assert_openai_error, make_roots, running_server

from lorapage import Engine, EngineConfig
from lorapage.adapters.cost import project_cost
from lorapage.adapters.peft_format import read_adapter_spec
from lorapage.adapters.peft_variants import variant_params
from lorapage.errors import AdapterFormatError
from lorapage.model.config import ModelConfig
from lorapage.registry.prepare import spec_from_json, spec_to_json
from lorapage.registry.store import REGISTRY_FILE
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

MODEL = ModelConfig.from_dir(TINY_BASE_DIR)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Demo adapter acme, and PEFT-made DoRA, embedding-LoRA and modules_to_save adapters."""
    root = tmp_path_factory.mktemp("variants") / "root"
    root.mkdir()
    shutil.copytree(demo_adapter_dirs()["acme"], root / "acme")
    make_peft_adapter(TINY_BASE_DIR, root / "dora", r=4, targets=["q_proj", "v_proj"], seed=1, use_dora=True)
    make_peft_adapter(TINY_BASE_DIR, root / "embedding", r=4, targets=["embed_tokens", "q_proj"], seed=2)
    make_peft_adapter(TINY_BASE_DIR, root / "saved", r=4, targets=["q_proj"], seed=3, modules_to_save=["lm_head"])
    return root


def engine_at(state: Path, root: Path) -> Engine:
    cfg = EngineConfig(model=str(TINY_BASE_DIR), block_size=4, max_lora_rank=16, state_dir=str(state))
    return Engine(cfg, adapter_roots=make_roots(root))


async def register(srv, adapter_id: str, source: Path):
    return await srv.post(
        "/v1/adapters", {"id": adapter_id, "source": str(source), "tenant": "alpha"}, headers=srv.admin()
    )


async def completions(srv, adapters: tuple[str, ...]) -> list[tuple[str, list[float]]]:
    """Each adapter's greedy text and logprobs for one prompt."""
    out = []
    for name in adapters:
        body = {"model": name, "prompt": [5, 9, 17, 33], "max_tokens": 4, "temperature": 0, "logprobs": 0}
        status, got, _ = await srv.post("/v1/completions", body)
        assert status == 200, got
        choice = got["choices"][0]
        out.append((choice["text"], choice["logprobs"]["token_logprobs"]))
    return out


async def test_variants_register_with_their_bytes_costed_and_survive_a_restart(root, tmp_path):
    state, names = tmp_path / "state", ("dora", "embedding")
    engine = engine_at(state, root)
    async with running_server(engine) as srv:
        for name in names:
            status, created, _ = await register(srv, name, root / name)
            assert status == 201, created
            spec = read_adapter_spec(root / name, MODEL, 16)
            extra = variant_params(spec.variants, MODEL)
            assert extra > 0
            want = project_cost(
                MODEL, spec.ranks, base_bytes_per_param=4, adapter_bytes_per_param=4, extra_params=extra
            )
            assert created["projected_cost_pct"] == pytest.approx(want.projected_cost_pct, rel=1e-12)
        before = await completions(srv, names)
    await engine.close()
    restarted = engine_at(state, root)  # its specs come from the registry, variants included
    async with running_server(restarted) as srv:
        after = await completions(srv, names)
    await restarted.close()
    for (text_b, lps_b), (text_a, lps_a) in zip(before, after):
        assert text_a == text_b
        assert lps_a == pytest.approx(lps_b, abs=1e-6)


def test_a_spec_with_variants_round_trips_through_the_registry_json(root):
    for name in ("dora", "embedding", "acme"):
        spec = read_adapter_spec(root / name, MODEL, 16)
        assert spec_from_json(spec_to_json(spec)).variants == spec.variants


async def test_modules_to_save_is_refused_with_its_bytes_and_tier(root, tmp_path):
    """A whole lm_head of its own: the envelope's 400, with the matrix, its bytes and the
    projected cost (the matrix counted), its tier dedicated; nothing stored."""
    state = tmp_path / "state"
    engine = engine_at(state, root)
    async with running_server(engine) as srv:
        status, body, _ = await register(srv, "saved", root / "saved")
        assert status == 400, body
        assert_openai_error(body, 400, "source")
        err = body["error"]
        assert err["code"] == "adapter_outside_envelope"
        matrix = f"lm_head [{MODEL.vocab_size}, {MODEL.hidden_size}]"
        assert f"modules_to_save: {matrix}" in err["message"]
        spec = read_adapter_spec(root / "saved", MODEL, 16)
        full = MODEL.vocab_size * MODEL.hidden_size
        cost = project_cost(MODEL, spec.ranks, base_bytes_per_param=4, adapter_bytes_per_param=4, extra_params=full)
        assert f"projected +{cost.projected_cost_pct:.1f}% decode cost at batch 64" in err["message"]
        assert "its tier is dedicated" in err["message"] and "merge_and_unload" in err["message"]
        assert (await srv.request("GET", "/v1/adapters/saved", srv.admin()))[0] == 404
    await engine.close()
    db = sqlite3.connect(state / REGISTRY_FILE)
    try:
        assert db.execute("SELECT count(*) FROM versions").fetchone() == (0,)
    finally:
        db.close()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"fan_in_fan_out": True}, "fan_in_fan_out=true is for GPT-2 style Conv1D layers"),
        ({"target_modules": ["vision_tower.q_proj"]}, "outside the language model's decoder"),
        ({"target_modules": ["lm_head", "q_proj"]}, "LoRA on 'lm_head' is not served"),
        ({"bias": "all"}, "bias='all' trains the base layers' own biases"),
        ({"use_dora": True}, "use_dora is set but layers.0.down_proj has no lora_magnitude_vector"),
        ({"peft_type": "LOHA"}, "peft_type 'LOHA' is not LORA"),
    ],
)
async def test_unsupported_variants_are_refused_by_name_over_http(root, tmp_path, changes, message):
    edited = tmp_path / "root" / "edited"
    shutil.copytree(root / "acme", edited)
    cfg = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    engine = engine_at(tmp_path / "state", tmp_path / "root")
    async with running_server(engine) as srv:
        status, body, _ = await register(srv, "edited", edited)
        assert status == 400, body
        assert_openai_error(body, 400)
        assert body["error"]["code"] == "invalid_adapter" and message in body["error"]["message"]
    await engine.close()


def test_a_vision_tower_tensor_is_refused_by_what_it_is(root, tmp_path):
    """A target_modules regex string is judged by the tensors it produced: one on a vision tower is
    refused as such, not as an unknown name."""
    from safetensors.torch import load_file, save_file

    edited = tmp_path / "vision"
    shutil.copytree(root / "acme", edited)
    cfg = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": r".*(q_proj|v_proj)"}))
    weights = load_file(edited / "adapter_model.safetensors")
    weights["base_model.model.vision_tower.blocks.0.attn.q_proj.lora_A.weight"] = weights[next(iter(weights))].clone()
    save_file(weights, edited / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="outside the language model's decoder"):
        read_adapter_spec(edited, MODEL, 64)
