"""PEFT directories: accepted variants and specific refusals."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import re2
import torch
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file, save_file

from lorapage.adapters.peft_format import MAX_PATTERN_KEYS, load_adapter_tensors, read_adapter_spec
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
        # DoRA, modules_to_save and embedding LoRA are served (tests/model/test_peft_variants.py);
        # a DoRA config without its magnitudes is not.
        ({"use_dora": True}, "use_dora is set but layers.0.down_proj has no lora_magnitude_vector"),
        ({"lora_bias": True}, "lora_bias is set but layers.0.down_proj has no lora_B bias"),
        ({"modules_to_save": ["score"]}, "modules_to_save names 'score'"),
        ({"bias": "lora_only"}, "bias"),
        ({"target_modules": ["lm_head", "q_proj"]}, "LoRA on 'lm_head' is not served"),
        ({"target_modules": ["vision_tower.q_proj", "q_proj"]}, "outside the language model's decoder"),
        ({"fan_in_fan_out": True}, "Conv1D"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
        ({"use_dora": True, "lora_bias": True}, "PEFT itself refuses"),
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
    with pytest.raises(AdapterFormatError, match="lora_embedding_A but not both"):
        read_adapter_spec(acme, MODEL, 64)
    del weights["base_model.model.model.embed_tokens.lora_embedding_A"]
    key = next(k for k in weights if "lora_B" in k)
    del weights[key]
    save_file(weights, acme / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="not both"):
        read_adapter_spec(acme, MODEL, 64)


def test_key_variants_read_the_same(acme):
    want = load_adapter_tensors(read_adapter_spec(acme, MODEL, 64), torch.float32)
    weights = load_file(acme / "adapter_model.safetensors")
    # ".default." adapter names and no "base_model.model." prefix.
    renamed = {k.replace("base_model.model.", "").replace(".weight", ".default.weight"): v for k, v in weights.items()}
    save_file(renamed, acme / "adapter_model.safetensors")
    got = load_adapter_tensors(read_adapter_spec(acme, MODEL, 64), torch.float32)
    assert got.keys() == want.keys() and all(torch.equal(got[k][0], want[k][0]) for k in want)
    assert all(torch.equal(got[k][1], want[k][1]) for k in want)


def test_bin_pickles_are_never_opened(acme):
    weights = load_file(acme / "adapter_model.safetensors")
    (acme / "adapter_model.bin").write_bytes(b"not a pickle")  # would fail if it were read
    spec = read_adapter_spec(acme, MODEL, 64)
    assert spec.weights_file.name == "adapter_model.safetensors"
    load_adapter_tensors(spec, torch.float32)
    (acme / "adapter_model.safetensors").unlink()
    torch.save(weights, acme / "adapter_model.bin")  # a real PEFT .bin: still refused
    with pytest.raises(AdapterFormatError, match=r"adapter_model.bin \(a pickle\) is never loaded.*safetensors"):
        read_adapter_spec(acme, MODEL, 64)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_at_load_naming_the_tensor(acme, value):
    weights = load_file(acme / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("layers.1.mlp.down_proj.lora_B.weight"))
    weights[key][3, 2] = value
    save_file(weights, acme / "adapter_model.safetensors")
    spec = read_adapter_spec(acme, MODEL, 64)  # registration reads only the header
    with pytest.raises(AdapterFormatError, match=f"adapter weight '{re.escape(key)}' has NaN or Inf values"):
        load_adapter_tensors(spec, torch.float32)


def test_weights_overflowing_the_serving_dtype_are_refused(acme):
    weights = load_file(acme / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key][0, 0] = 1e6  # finite in float32, inf in float16
    save_file(weights, acme / "adapter_model.safetensors")
    spec = read_adapter_spec(acme, MODEL, 64)
    load_adapter_tensors(spec, torch.bfloat16)  # bfloat16 has float32's range
    with pytest.raises(AdapterFormatError, match=f"{re.escape(key)}' has values that overflow torch.float16"):
        load_adapter_tensors(spec, torch.float16)


def _scales(path, alpha_pattern) -> dict[str, float]:
    _edit_config(path, alpha_pattern=alpha_pattern)
    spec = read_adapter_spec(path, MODEL, 64)
    return {_module_name(k): v for k, v in spec.scales.items()}


def _module_name(pair: tuple[int, str]) -> str:
    layer, module = pair
    return f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"


@pytest.mark.parametrize(
    "alpha_pattern",
    [
        {"q_proj": 40},
        {"q_proj|v_proj": 40},  # PEFT groups the key: the alternation applies to the suffix
        {"layers.0.self_attn.k_proj": 24, "k_proj": 40},  # the first matching key wins
        {r"layers\.1\..*_proj": 32, "down_proj": 4},
        {"(?P<m>gate|up)_proj": 40, "proj": 1},  # "proj" is not a dotted suffix of any name: no match
        {"model.layers.1.mlp.up_proj": 8},
    ],
)
def test_alpha_pattern_matches_like_peft(acme, alpha_pattern):
    got = _scales(acme, alpha_pattern)
    r, alpha = 8, 16
    for name, scale in got.items():
        key = get_pattern_key(list(alpha_pattern), name)
        assert scale == alpha_pattern.get(key, alpha) / r, name


@pytest.mark.parametrize("key", ["(.*)*x", "(a+)+$", "((.*)*)*(q|k)_proj", "(.*.*.*.*.*.*)*z"])
def test_backtracking_keys_are_matched_in_linear_time(acme, key):
    # Python's re takes exponential time on these against a module name; RE2 cannot.
    got = _scales(acme, {key: 40, "o_proj": 32})
    for name, scale in got.items():
        want = 40 if re2.match(rf"(.*\.)?({key})$", name) else (32 if name.endswith("o_proj") else 16)
        assert scale == want / 8, name
    assert got["model.layers.0.self_attn.o_proj"] == 4.0 and got["model.layers.1.mlp.up_proj"] == 2.0


def test_one_key_per_module_up_to_the_bound_is_accepted(acme):
    keys = {f"layers.{i}.self_attn.q_proj": 8 * (i + 1) for i in range(MAX_PATTERN_KEYS)}
    got = _scales(acme, dict(reversed(keys.items())))  # the matching keys come last
    assert got["model.layers.0.self_attn.q_proj"] == 1.0 and got["model.layers.1.self_attn.q_proj"] == 2.0
    assert got["model.layers.1.self_attn.k_proj"] == 2.0  # lora_alpha 16 / r 8: no key matched


@pytest.mark.parametrize("field", ["alpha_pattern", "rank_pattern"])
@pytest.mark.parametrize(
    "patterns, message",
    [
        ({r"(q)\1_proj": 4}, "not a regex RE2 accepts"),  # backreference
        ({"(?=q)q_proj": 4}, "not a regex RE2 accepts"),  # lookahead
        ({"(a{1000}){1000}": 4}, "not a regex RE2 accepts"),  # a repetition RE2 refuses outright
        ({"[a-z]{999}" * 40: 4}, "pattern too large"),  # a compiled program over RE2's memory bound
        ({"[q_proj": 4}, "missing ]"),
        ({"q" * 513: 4}, "is 513 characters; at most 512"),
        ({f"layers.{i}.q_proj": 4 for i in range(1025)}, "1025 keys; at most 1024"),
        (["q_proj"], "must be a JSON object"),
    ],
)
def test_pathological_pattern_keys_are_refused(acme, field, patterns, message):
    _edit_config(acme, **{field: patterns})
    with pytest.raises(AdapterFormatError, match=message) as e:
        read_adapter_spec(acme, MODEL, 64)
    assert field in e.value.message and len(e.value.message) < 600


@pytest.mark.parametrize(
    "changes", [{"lora_alpha": float("nan")}, {"lora_alpha": "16"}, {"alpha_pattern": {"q_proj": 1e999}}]
)
def test_non_finite_or_non_numeric_alpha_is_refused(acme, changes):
    _edit_config(acme, **changes)
    with pytest.raises(AdapterFormatError, match="must be a finite number"):
        read_adapter_spec(acme, MODEL, 64)


def test_base_model_name_is_never_trusted(acme):
    _edit_config(acme, base_model_name_or_path="/does/not/exist")
    spec = read_adapter_spec(acme, MODEL, 64)
    assert spec.max_rank == 8 and "gate_proj" in spec.target_modules


def test_a_header_whose_dtype_is_not_a_string_is_refused_by_name(acme):
    """A dtype field that is a JSON list (unhashable) is a format error naming the tensor, not a
    TypeError from a dict lookup."""
    text = json.dumps({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}).encode()
    (acme / "adapter_model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + bytes(4))
    with pytest.raises(AdapterFormatError, match=r"tensor 'x': dtype \['F32'\] is not one of"):
        read_adapter_spec(acme, MODEL, 64)
