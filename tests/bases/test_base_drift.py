"""A base upgrade's drift check: a base that differs slightly passes, one that differs a lot fails,
with the numbers a customer notice carries (``lorapage base check`` end to end)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_reference import make_peft_adapter, make_random_llama

from lorapage.bases.cli import main
from lorapage.bases.drift import DriftThresholds, PromptDrift, prompt_drift, verdict
from lorapage.request import TokenLogprob


def perturbed(base: Path, out: Path, scale: float, seed: int) -> Path:
    """``base`` with every weight matrix nudged by relative noise of ``scale``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((base / f).read_bytes())
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    old = make_random_llama(root / "old", seed=3)
    adapters = {
        f"a{i}": make_peft_adapter(old, root / f"a{i}", r=8, targets=["q_proj", "v_proj", "down_proj"], seed=i)
        for i in range(2)
    }
    near = perturbed(old, root / "near", 0.002, seed=1)
    far = make_random_llama(root / "far", seed=9)
    prompts = root / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"Hello number {i}, what is {i * 7}?"}) for i in range(8)]
    lines.append(json.dumps({"adapter": "a1", "prompt": "only for a1"}))
    prompts.write_text("\n".join(lines) + "\n")
    return old, near, far, adapters, prompts


def check(old, new, adapters, prompts, capsys) -> tuple[int, dict]:
    modules = [f"{n}={p}" for n, p in adapters.items()]
    code = main(
        ["check", str(old), str(new), "--lora-modules", *modules, "--prompts", str(prompts), "--max-tokens", "16"]
    )
    out = capsys.readouterr().out
    return code, json.loads(out.strip().splitlines()[-1])


def test_a_slightly_different_base_passes_and_a_different_one_fails(bases, capsys):
    old, near, far, adapters, prompts = bases
    code, report = check(old, near, adapters, prompts, capsys)
    assert code == 0, json.dumps(report)[-1500:]
    a0, a1 = report["adapters"]["a0"], report["adapters"]["a1"]
    assert a0["passed"] and a1["passed"] and a0["prompts"] == 8 and a1["prompts"] == 9
    assert a0["token_agreement"] >= 0.9 and a0["kl"] < 0.1
    code, report = check(old, far, adapters, prompts, capsys)
    assert code == 1
    for r in report["adapters"].values():
        assert not r["passed"] and r["token_agreement"] < 0.5 and r["reasons"]


def test_the_same_base_shows_no_drift(bases, capsys):
    old, _, _, adapters, prompts = bases
    code, report = check(old, old, adapters, prompts, capsys)
    r = report["adapters"]["a0"]
    assert code == 0 and r["token_agreement"] == 1.0 and r["changed_fraction"] == 0.0
    assert r["mean_abs_dlogprob"] < 1e-4 and r["kl"] < 1e-4 and r["any_change_fraction"] == 0.0


def test_kl_and_agreement_from_logprobs():
    lp = math.log
    old = [
        TokenLogprob(5, lp(0.6), ((5, lp(0.6)), (7, lp(0.3)))),
        TokenLogprob(7, lp(0.5), ((7, lp(0.5)), (5, lp(0.4)))),
    ]
    same = prompt_drift(old, old, [5, 7])
    assert same.token_agreement == 1.0 and same.kl < 1e-12 and not same.changed
    flipped = [
        TokenLogprob(5, lp(0.3), ((7, lp(0.6)), (5, lp(0.3)))),
        TokenLogprob(7, lp(0.5), ((7, lp(0.5)), (5, lp(0.4)))),
    ]
    d = prompt_drift(old, flipped, [7, 7])
    assert d.token_agreement == 0.5 and d.changed
    assert d.mean_abs_dlogprob == pytest.approx(abs(lp(0.6) - lp(0.3)) / 2)
    want = 0.6 * lp(0.6 / 0.3) + 0.3 * lp(0.3 / 0.6) + 0.1 * lp(0.1 / 0.1)
    assert d.kl == pytest.approx(want / 2)
    report = verdict([d], DriftThresholds())
    assert not report.passed and any("agreement" in r for r in report.reasons)
    assert verdict([same]).passed and not verdict([]).passed
    assert isinstance(verdict([same]).notice("acme", "a" * 64, "b" * 64), str)
    assert PromptDrift(0, 1.0, 0.0, 0.0, False).positions == 0


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_the_drift_check_runs_against_the_quantized_base(bases, capsys, quantization):
    """``--quantization int8`` (or w8a8) serves the new base quantized: against itself unquantized,
    the adapters' answers drift by the quantization alone (a measure, not a fixed verdict)."""
    old, _, _, adapters, prompts = bases
    modules = [f"{n}={p}" for n, p in adapters.items()]
    argv = ["check", str(old), str(old), "--lora-modules", *modules, "--prompts", str(prompts)]
    main([*argv, "--max-tokens", "8", "--quantization", quantization])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = report["adapters"]["a0"]
    assert r["prompts"] == 8 and 0 < r["mean_abs_dlogprob"] < 0.5 and r["token_agreement"] > 0.5
