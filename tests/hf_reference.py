"""Helpers that build genuine HF checkpoints and PEFT adapters with transformers + peft, and run
them as the reference lorapage is compared against."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from lorapage.tiny import TINY_BASE_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_random_llama(
    path: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 96,
    vocab: int | None = None,
    seed: int = 0,
    **extra,
) -> Path:
    """A random Llama-shaped checkpoint saved by transformers, with the tiny model's tokenizer."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = vocab or json.loads((TINY_BASE_DIR / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
        bos_token_id=None,
        **extra,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger-than-default weights so outputs are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, path / f)
    return path


def make_random_model(
    path: Path, config_class, *, seed: int = 0, max_shard_size: str | None = None, **config_kwargs
) -> Path:
    """A random checkpoint of any family, built from ``config_class`` (e.g. ``Qwen3Config``) with
    ``config_kwargs`` and saved by transformers beside the tiny model's tokenizer. 2-D weights are
    drawn at 0.08 (outputs far from uniform) and every 1-D weight (norms, q/k norms, biases) as
    ``1 + 0.1 * noise``, so a norm the engine skipped or misread shows in the logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**config_kwargs))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    for f in TOKENIZER_FILES:
        shutil.copy(TINY_BASE_DIR / f, path / f)
    return path


def make_peft_adapter(
    base_dir: Path, path: Path, *, r: int, targets: list[str], seed: int, alpha: float | None = None, **lora_kwargs
) -> Path:
    """A PEFT LoRA adapter with random (non-zero) A and B (an embedding LoRA's too), saved by
    peft; DoRA's magnitudes moved off the norms peft initialises them to, so its column scale is
    not 1."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        target_modules=targets,
        lora_dropout=0.0,
        init_lora_weights=False,
        **lora_kwargs,
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.3 / max(r, 1) ** 0.5)
            elif "lora_A" in name or "lora_embedding_A" in name:
                p.normal_(0, 0.3)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompt: list[int], max_tokens: int, merged: bool = False
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from transformers (+ peft), one row alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    ids = list(prompt)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            t = int(torch.argmax(logits))
            tokens.append(t)
            logprobs.append(float(lp[t]))
            ids.append(t)
    return tokens, logprobs


def peft_prompt_logprobs(base_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities [len(prompt), vocab] from transformers (+ peft): row k is
    the distribution of token k + 1 given the prompt's first k + 1 tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
