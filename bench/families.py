"""The engine bench's family column: c/a (32 rows on 32 distinct rank-16 all-module adapters over
base only, decode tokens/s) per family, on checkpoints of one shape written without
transformers: Llama (``make_llama``), Qwen3 (the same weights plus per-head q/k norms and its own
``head_dim``), Phi-3 (the groups fused in the checkpoint, and adapters on the fused modules,
which the engine splits into parts: qkv's A is held three times, gate_up's twice), Gemma 2 (four
norms, GeGLU, soft-caps, windowed layers, tied embeddings) and Qwen3-MoE (8 experts of a quarter
width, top-2; adapters on attention and every expert).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from harness import median
from make_llama import write_adapter, write_model
from safetensors.torch import load_file, save_file
from workloads import decode_rate

from lorapage import Engine, EngineConfig

BATCH = 32
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _edit(path: Path, config: dict, weights: Callable[[dict], dict]) -> Path:
    """Rewrite the Llama checkpoint at ``path``: ``config`` merged into its config.json and its
    tensors passed through ``weights``."""
    cfg = json.loads((path / "config.json").read_text()) | config
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights(load_file(path / "model.safetensors")), path / "model.safetensors")
    return path


def write_qwen3(path: Path, **shape) -> Path:
    """A Qwen3 checkpoint: the Llama one of ``shape`` with q/k norms (head_dim given explicitly)."""
    write_model(path, **shape)
    head_dim = shape["hidden"] // shape["heads"]

    def norms(w: dict) -> dict:
        for i in range(shape["layers"]):
            for n in ("q_norm", "k_norm"):
                w[f"model.layers.{i}.self_attn.{n}.weight"] = torch.ones(head_dim)
        return w

    return _edit(path, {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": head_dim}, norms)


def write_phi3(path: Path, **shape) -> Path:
    """A Phi-3 checkpoint: the Llama one of ``shape`` with qkv and gate_up fused."""
    write_model(path, **shape)

    def fuse(w: dict) -> dict:
        for i in range(shape["layers"]):
            p = f"model.layers.{i}."
            qkv = [w.pop(f"{p}self_attn.{m}_proj.weight") for m in "qkv"]
            w[f"{p}self_attn.qkv_proj.weight"] = torch.cat(qkv)
            gate_up = [w.pop(f"{p}mlp.{m}_proj.weight") for m in ("gate", "up")]
            w[f"{p}mlp.gate_up_proj.weight"] = torch.cat(gate_up)
        return w

    return _edit(path, {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}, fuse)


def write_phi3_adapter(path: Path, model_dir: Path, *, rank: int, seed: int, std: float = 0.01) -> Path:
    """A PEFT adapter of ``rank`` on Phi-3's fused modules, as PEFT saves one."""
    write_adapter(path, model_dir, rank=rank, seed=seed, targets=("o_proj", "down_proj"), std=std)
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    qkv = h + 2 * kv * h // cfg["num_attention_heads"]
    g = torch.Generator().manual_seed(seed + 10_000)
    w = load_file(path / "adapter_model.safetensors")
    for i in range(cfg["num_hidden_layers"]):
        for part, m, d_out in (("self_attn", "qkv_proj", qkv), ("mlp", "gate_up_proj", 2 * inter)):
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            w[f"{key}.lora_A.weight"] = torch.randn(rank, h, generator=g) * std
            w[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * std
    save_file(w, path / "adapter_model.safetensors")
    adapter_cfg = json.loads((path / "adapter_config.json").read_text()) | {"target_modules": list(PHI3_TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(adapter_cfg))
    return path


def write_gemma2(path: Path, **shape) -> Path:
    """A Gemma 2 checkpoint: the Llama one of ``shape`` with its four norms a layer (``1 + w``,
    so zeros are ones), GeGLU, tied embeddings, both soft-caps and a 4096 window on every other
    layer (longer than the bench's sequences: the windowed kernels run, reading everything)."""
    write_model(path, **shape)
    head_dim = shape["hidden"] // shape["heads"]

    def norms(w: dict) -> dict:
        w.pop("lm_head.weight", None)
        for i in range(shape["layers"]):
            for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                w[f"model.layers.{i}.{n}.weight"] = torch.zeros(shape["hidden"])
        return w

    config = {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    return _edit(path, config, norms)


# The MoE row's experts: 8 of a quarter of the dense MLP's width, 2 per token (Qwen3-MoE's form).
MOE = dict(experts=8, top_k=2, divide=4)


def write_qwen3_moe(path: Path, **shape) -> Path:
    """A Qwen3-MoE checkpoint: the Qwen3 one of ``shape`` with each layer's MLP replaced by a router
    and ``MOE["experts"]`` experts of ``intermediate / MOE["divide"]`` (random, one tensor per
    expert and matrix as ``save_pretrained`` writes them)."""
    write_qwen3(path, **shape)
    h, inter = shape["hidden"], shape["intermediate"] // MOE["divide"]
    g = torch.Generator().manual_seed(7)

    def experts(w: dict) -> dict:
        for i in range(shape["layers"]):
            p = f"model.layers.{i}.mlp."
            for m in ("gate_proj", "up_proj", "down_proj"):
                w.pop(p + m + ".weight")
            w[p + "gate.weight"] = torch.randn(MOE["experts"], h, generator=g) * 0.02
            for e in range(MOE["experts"]):
                for m, shp in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                    w[f"{p}experts.{e}.{m}.weight"] = torch.randn(*shp, generator=g) * 0.02
        return w

    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": MOE["experts"],
        "num_experts_per_tok": MOE["top_k"],
        "moe_intermediate_size": inter,
        "norm_topk_prob": True,
    }
    return _edit(path, config, experts)


def write_moe_adapter(path: Path, model_dir: Path, *, rank: int, seed: int, std: float = 0.01) -> Path:
    """A PEFT adapter of ``rank`` on attention and on every expert's gate / up / down (transformers
    4's per-expert form: the experts' LoRA a row reaches through its routing)."""
    write_adapter(path, model_dir, rank=rank, seed=seed, targets=("q_proj", "k_proj", "v_proj", "o_proj"), std=std)
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator().manual_seed(seed + 20_000)
    w = load_file(path / "adapter_model.safetensors")
    for i in range(cfg["num_hidden_layers"]):
        for e in range(cfg["num_experts"]):
            for m, (d_in, d_out) in (("gate_proj", (h, inter)), ("up_proj", (h, inter)), ("down_proj", (inter, h))):
                key = f"base_model.model.model.layers.{i}.mlp.experts.{e}.{m}"
                w[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * std
                w[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * std
    save_file(w, path / "adapter_model.safetensors")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter_cfg = json.loads((path / "adapter_config.json").read_text()) | {"target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(adapter_cfg))
    return path


FAMILIES: dict[str, tuple[Callable[..., Path], Callable[..., Path]]] = {
    "llama": (write_model, write_adapter),
    "qwen3": (write_qwen3, write_adapter),
    "phi3": (write_phi3, write_phi3_adapter),
    "gemma2": (write_gemma2, write_adapter),
    "qwen3_moe": (write_qwen3_moe, write_moe_adapter),
}


async def family_rates(root: Path, shape: dict, prompt_len: int, new_tokens: int, rounds: int) -> dict[str, dict]:
    """Per family: median decode tokens/s of (a) 32 base rows and (c) 32 rows on 32 distinct
    adapters, each the median of ``rounds`` passes taken in turn, and their c/a."""
    out = {}
    for family, (write_base, write_lora) in FAMILIES.items():
        model = write_base(root / family, **shape)
        engine = Engine(
            EngineConfig(
                model=str(model),
                max_loras=BATCH,
                max_resident_loras=BATCH,
                max_lora_rank=16,
                max_num_seqs=BATCH,
                max_model_len=256,
                scheduler="fcfs",
                enable_prefix_caching=False,
            )
        )
        names = [f"{family}{i}" for i in range(BATCH)]
        for i, n in enumerate(names):
            engine.add_adapter(n, write_lora(root / n, model, rank=16, seed=i))
            await engine.admin.load(n)
        await decode_rate(engine, [None] * 4, prompt_len, 3)  # warm-up
        a, c = [], []
        for _ in range(rounds):
            a.append(await decode_rate(engine, [None] * BATCH, prompt_len, new_tokens))
            c.append(await decode_rate(engine, names, prompt_len, new_tokens))
        pages = engine.admin.info(names[0]).num_pages
        await engine.close()
        out[family] = {"a_base": median(a), "c_distinct": median(c), "c_over_a": median(c) / median(a), "pages": pages}
    return out


def print_families(rates: dict[str, dict]) -> None:
    print(f"{'family (decode, 32 requests)':<30}{'(a) base':>10}{'(c) distinct':>14}{'c/a':>7}{'adapter pages':>15}")
    for family, r in rates.items():
        print(f"  {family:<28}{r['a_base']:>10.1f}{r['c_distinct']:>14.1f}{r['c_over_a']:>7.2f}{r['pages']:>15}")
