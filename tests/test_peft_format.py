"""PEFT directories: accepted variants and specific refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorapage.adapters.peft_format import load_adapter_tensors, read_adapter_spec
from lorapage.errors import AdapterFormatError
from lorapage.model.config import ModelConfig
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

MODEL = ModelConfig.from_dir(TINY_BASE_DIR)


@pytest.fixture
def acme(tmp_path):
    path = tmp_path / "acme"
    shutil.copytree(demo_adapter_dirs()["acme"], path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "bias"),
        ({"target_modules": ["embed_tokens", "q_proj"]}, "embedding"),
        ({"peft_type": "IA3"}, "LORA"),
    ],
)
def test_refused_configs_name_the_reason(acme, changes, message):
    _edit_config(acme, **changes)
    with pytest.raises(AdapterFormatError, match=message):
        read_adapter_spec(acme, MODEL, 64)


def test_rank_above_max_and_wrong_shapes_are_refused(acme, tmp_path):
    with pytest.raises(AdapterFormatError, match="max_lora_rank"):
        read_adapter_spec(acme, MODEL, 4)
    weights = load_file(acme / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key] = torch.zeros(weights[key].shape[0], MODEL.hidden_size + 8)
    save_file(weights, acme / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="do not fit the base"):
        read_adapter_spec(acme, MODEL, 64)


def test_embedding_lora_tensor_and_missing_half_are_refused(acme):
    weights = load_file(acme / "adapter_model.safetensors")
    weights["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 10)
    save_file(weights, acme / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="embeddings"):
        read_adapter_spec(acme, MODEL, 64)
    del weights["base_model.model.model.embed_tokens.lora_embedding_A"]
    key = next(k for k in weights if "lora_B" in k)
    del weights[key]
    save_file(weights, acme / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="not both"):
        read_adapter_spec(acme, MODEL, 64)


def test_key_variants_and_bin_files_read_the_same(acme, tmp_path):
    want = load_adapter_tensors(read_adapter_spec(acme, MODEL, 64), torch.float32)
    weights = load_file(acme / "adapter_model.safetensors")
    # ".default." adapter names and no "base_model.model." prefix.
    renamed = {k.replace("base_model.model.", "").replace(".weight", ".default.weight"): v for k, v in weights.items()}
    save_file(renamed, acme / "adapter_model.safetensors")
    got = load_adapter_tensors(read_adapter_spec(acme, MODEL, 64), torch.float32)
    assert got.keys() == want.keys() and all(torch.equal(got[k][0], want[k][0]) for k in want)
    (acme / "adapter_model.safetensors").unlink()
    torch.save(weights, acme / "adapter_model.bin")
    got = load_adapter_tensors(read_adapter_spec(acme, MODEL, 64), torch.float32)
    assert all(torch.equal(got[k][1], want[k][1]) for k in want)


def test_base_model_name_is_never_trusted(acme):
    _edit_config(acme, base_model_name_or_path="/does/not/exist")
    spec = read_adapter_spec(acme, MODEL, 64)
    assert spec.max_rank == 8 and "gate_proj" in spec.target_modules
