"""Reading a checkpoint's quantization_config: each compressed-tensors scheme lorapage serves mapped
to its quantization name, each one it cannot serve refused with a reason naming the scheme."""

from __future__ import annotations

import pytest

from lorapage.model.quant_scheme import CheckpointQuantization, checkpoint_quantization, serving_quantization

INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
TOKEN_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def config(weights=INT8_CHANNEL, acts=None, fmt="int-quantized", **extra):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "format": fmt}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, **extra}
    qc.setdefault("ignore", ["lm_head"])
    return {"quantization_config": qc}


@pytest.mark.parametrize(
    "raw, want",
    [
        ({}, None),
        (config(), CheckpointQuantization("int8", "channel", packed=False)),
        (config(fmt="pack-quantized"), CheckpointQuantization("int8", "channel", packed=True)),
        (config(acts=TOKEN_INT8), CheckpointQuantization("w8a8", "channel", packed=False)),
        (config(weights={**INT8_CHANNEL, "type": "float", "strategy": "tensor"}, fmt="float-quantized"),
         CheckpointQuantization("fp8", "tensor", packed=False)),
        (config(weights={**INT8_CHANNEL, "type": "float"}, fmt="naive-quantized"),
         CheckpointQuantization("fp8", "channel", packed=False)),
    ],
)  # fmt: skip
def test_each_served_scheme_gets_its_name(raw, want):
    assert checkpoint_quantization(raw) == want


@pytest.mark.parametrize(
    "raw, reason",
    [
        (config(weights={**INT8_CHANNEL, "num_bits": 4, "strategy": "group", "group_size": 128}, fmt="pack-quantized"),
         "4-bit int weights, strategy group: lorapage serves 8-bit weights only"),
        (config(weights={**INT8_CHANNEL, "strategy": "group", "group_size": 128}),
         "strategy group: only per-channel or per-tensor scales"),
        (config(weights={**INT8_CHANNEL, "strategy": "block"}), "strategy block"),
        (config(weights={**INT8_CHANNEL, "symmetric": False}), "asymmetric"),
        (config(weights={**INT8_CHANNEL, "type": "float"}, acts={**TOKEN_INT8, "type": "float"}, fmt="float-quantized"),
         "8-bit float activations, strategy token, dynamic True: activation quantization is served only as"),
        (config(acts={**TOKEN_INT8, "dynamic": False, "strategy": "tensor"}), "dynamic False"),
        (config(fmt="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized' is not supported"),
        (config(fmt="pack-quantized", weights={**INT8_CHANNEL, "type": "float"}), "pack-quantized fp8"),
        (config(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (config(transform_config={"config_groups": {"u": {}}}), "transforms"),
        (config(quantization_status="frozen"), "quantization_status 'frozen'"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq' is not supported"),
    ],
)  # fmt: skip
def test_a_scheme_lorapage_cannot_serve_is_refused_by_name(raw, reason):
    with pytest.raises(ValueError, match="config.json quantization_config: ") as err:
        checkpoint_quantization(raw)
    assert reason in str(err.value) and "\n" not in str(err.value)


def test_two_schemes_in_one_checkpoint_are_refused():
    raw = config()
    groups = raw["quantization_config"]["config_groups"]
    groups["group_1"] = {**groups["group_0"], "input_activations": TOKEN_INT8}
    with pytest.raises(ValueError, match="2 different schemes across config_groups"):
        checkpoint_quantization(raw)


def test_the_requested_quantization_must_agree_with_the_checkpoint():
    int8 = CheckpointQuantization("int8", "channel", packed=False)
    assert serving_quantization(None, int8) == "int8" == serving_quantization("int8", int8)
    assert serving_quantization("fp8", None) == "fp8" and serving_quantization(None, None) is None
    with pytest.raises(ValueError, match="'fp8' disagrees with the checkpoint, which is already quantized int8"):
        serving_quantization("fp8", int8)
