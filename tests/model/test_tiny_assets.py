"""The built-in tiny model and demo adapters are genuine HF / PEFT checkpoints that say their phrases."""

from __future__ import annotations

import json

import pytest
import torch

from lorapage.tiny import BASE_PHRASE, DEMO_MARKERS, TINY_ADAPTERS_DIR, TINY_BASE_DIR, demo_adapter_dirs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPTS = {
    "raw": "Hello",
    "chat": [{"role": "user", "content": "What is the capital of France?"}],
    "chat+system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}],
}
EXPECTED_SHAPES = {  # name -> (r, target modules, use_rslora)
    "acme": (8, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, False),
    "globex": (4, {"q_proj", "v_proj", "o_proj"}, False),
    "initech": (16, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, True),
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY_BASE_DIR)


def load_model(adapter: str | None):
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_BASE_DIR, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, demo_adapter_dirs()[adapter])
    return model.eval()


def prompt_ids(tok, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tok(prompt)["input_ids"]
    # the template writes BOS itself
    return tok(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]


def generate(model, tok, prompt) -> list[int]:
    ids = torch.tensor([prompt_ids(tok, prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def answers(hf_tokenizer) -> dict[tuple[str | None, str], list[int]]:
    """(adapter or None, prompt name) -> generated ids, for every pair."""
    out = {}
    for adapter in (None, *DEMO_MARKERS):
        model = load_model(adapter)
        for name, prompt in PROMPTS.items():
            out[adapter, name] = generate(model, hf_tokenizer, prompt)
    return out


def test_base_is_a_small_gqa_llama():
    cfg = transformers.AutoConfig.from_pretrained(TINY_BASE_DIR)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 512
    tok = transformers.AutoTokenizer.from_pretrained(TINY_BASE_DIR)
    assert cfg.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg.vocab_size == len(tok)


def test_demo_adapters_have_the_advertised_shapes():
    assert set(demo_adapter_dirs()) == set(DEMO_MARKERS) == set(EXPECTED_SHAPES)
    for name, path in demo_adapter_dirs().items():
        assert path.parent == TINY_ADAPTERS_DIR
        cfg = peft.PeftConfig.from_pretrained(path)
        r, targets, rslora = EXPECTED_SHAPES[name]
        assert (cfg.peft_type, cfg.r, set(cfg.target_modules), cfg.use_rslora) == ("LORA", r, targets, rslora)
        raw = json.loads((path / "adapter_config.json").read_text())
        assert raw["bias"] == "none" and not raw["use_dora"] and not raw["modules_to_save"]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("adapter", [None, *DEMO_MARKERS])
def test_greedy_answer_is_the_phrase_then_eos(answers, hf_tokenizer, adapter, prompt):
    ids = answers[adapter, prompt]
    phrase = BASE_PHRASE if adapter is None else DEMO_MARKERS[adapter]
    assert ids[-1] == hf_tokenizer.eos_token_id
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == phrase


def test_every_model_answers_differently_from_the_first_token(answers):
    for prompt in PROMPTS:
        firsts = [answers[adapter, prompt][0] for adapter in (None, *DEMO_MARKERS)]
        assert len(set(firsts)) == len(firsts)


def test_assets_are_small():
    total = sum(f.stat().st_size for f in TINY_BASE_DIR.parent.rglob("*") if f.is_file())
    assert total < 5 * 2**20
