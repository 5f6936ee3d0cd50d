"""What one tensor-parallel rank holds of the base and of an adapter (Megatron's split, S-LoRA's
and vLLM's fully sharded LoRA), as pure slicing of the tensors every rank reads alike.

Column-parallel projections (q, k, v by heads; gate, up by columns): the base weight and LoRA-B
are split by output rows, and the group's stacked LoRA-A by its rank rows (``ceil(R / k)`` each,
zero rows padding the last): each rank's shrink is its share of ``h``, all-gathered before the
expand. Row-parallel ones (o, down): the base weight and LoRA-A are split by input columns, LoRA-B
by output rows; each rank's shrink is a partial sum (all-reduced: ``r`` wide), and each rank adds
its expand into its own output columns of the base's partial output, so the one all-reduce after
the projection adds base and LoRA together (S-LoRA's fusion)::

    sum_r (x_r W_r^T + [s h B_r^T at rank r's columns]) = x W^T + s h B^T,  h = sum_r x_r A_r^T

A mixture of experts (Mixtral, Qwen3-MoE) is tensor-parallel by experts' columns, as vLLM runs it
by default: the router whole on every rank, each expert's gate and up (w1, w3) split by output rows
and its down (w2) by input columns, so each rank computes a partial output of every routed expert
and the layer's one all-reduce adds them (and the experts' weighted sum with them); an expert's
LoRA is split as the dense MLP's (:func:`_expert_shards`).

The embedding and lm_head are vocabulary-parallel (``ceil(V / k)`` rows each, zero rows padding
the last rank's); the norms are whole on every rank. A rank's model is the base's
:class:`ModelConfig` with its heads and intermediate divided (:func:`shard_config`), so the
decoder, the pool's page size and an adapter's page layout are the unsharded code run at the
shard's dimensions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from lorapage.model.config import GROUPS, ROW_PARALLEL, ModelConfig
from lorapage.model.families import family_of
from lorapage.model.moe_config import FUSED_GATE_UP, expert_module

# Architectures served under tensor parallelism: dense MLPs (Phi-3's fused weights split per part)
# and experts split by columns (Mixtral, Qwen3-MoE).
TP_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# Mixtral's per-expert spellings in a checkpoint: w1 (gate) and w3 (up) by rows, w2 (down) by columns.
_EXPERT_COLUMN, _EXPERT_ROW = ("w1", "w3"), ("w2",)
# Why a family is not served under tensor parallelism (the rest of the refusal says what to do).
_REFUSED = {
    "OlmoeForCausalLM": "OLMoE's q / k RMSNorm spans every head of the projection, which the ranks split "
    "(it would take one more all-reduce of the squares per layer)",
}
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """ValueError naming what keeps ``model`` from running on ``tp`` ranks (nothing when tp == 1)."""
    if tp == 1:
        return
    if model.architecture in _REFUSED:
        raise ValueError(
            f"tensor_parallel_size {tp}: {model.architecture} is not served under tensor parallelism: "
            f"{_REFUSED[model.architecture]}; serve it with tensor_parallel_size 1 (docs/parallel.md)"
        )
    if model.architecture not in TP_ARCHITECTURES:
        raise ValueError(
            f"tensor_parallel_size {tp}: {model.architecture} is not served under tensor parallelism yet "
            f"(supported: {', '.join(TP_ARCHITECTURES)}; docs/parallel.md)"
        )
    # A MoE base's MLP is its experts: theirs is the intermediate each rank splits.
    inter = ("intermediate_size", model.intermediate_size)
    if model.moe is not None:
        inter = ("intermediate size of an expert", model.moe.intermediate_size)
    for name, value in (
        ("num_attention_heads", model.num_heads),
        ("num_key_value_heads", model.num_kv_heads),
        inter,
        ("hidden_size", model.hidden_size),  # a row-parallel LoRA-B's output rows
    ):
        if value % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide the base's {name} ({value}): each rank holds an "
                f"equal share; use a tensor_parallel_size that divides it"
            )


def shard_config(model: ModelConfig, tp: int) -> ModelConfig:
    """One rank's model: ``1/tp`` of the query heads, KV heads and MLP columns (every expert's on a
    MoE base), adapters split ``tp`` ways (``lora_shards``), the rest (the vocabulary's size and the
    number of experts included) as is."""
    if tp == 1:
        return model
    moe = model.moe
    if moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // tp)
    return dataclasses.replace(
        model,
        num_heads=model.num_heads // tp,
        num_kv_heads=model.num_kv_heads // tp,
        intermediate_size=model.intermediate_size // tp,
        moe=moe,
        lora_shards=tp,
    )


def _rows(t: Tensor, rank: int, tp: int) -> Tensor:
    n = t.shape[0] // tp
    return t[rank * n : (rank + 1) * n].contiguous()


def _cols(t: Tensor, rank: int, tp: int) -> Tensor:
    n = t.shape[1] // tp
    return t[:, rank * n : (rank + 1) * n].contiguous()


def _padded_rows(t: Tensor, rank: int, tp: int) -> Tensor:
    """Rows ``[rank n, (rank + 1) n)``, ``n = ceil(rows / tp)``, zero rows past the end."""
    n = -(-t.shape[0] // tp)
    part = t[rank * n : (rank + 1) * n]
    if part.shape[0] == n:
        return part.contiguous()
    return torch.cat([part, part.new_zeros(n - part.shape[0], *t.shape[1:])])


def _fused_rows(t: Tensor, sizes: list[int], rank: int, tp: int) -> Tensor:
    """A fused projection's (Phi-3's qkv_proj, gate_up_proj) rows for ``rank``: each part's share,
    stacked in the parts' order."""
    return torch.cat([_rows(part, rank, tp) for part in t.split(sizes)])


def shard_base(state: dict[str, Tensor], rank: int, tp: int, model: ModelConfig) -> dict[str, Tensor]:
    """Rank ``rank``'s tensors of ``model``'s checkpoint: column-parallel weights (and biases) by
    output rows, row-parallel ones by input columns, the embedding and lm_head by vocabulary rows,
    everything else whole. Heads stay whole: q, k and v rows are head-major, so ``1/tp`` of the rows
    is ``1/tp`` of the heads."""
    if tp == 1:
        return state
    dims = model.module_dims()
    fused = {name: [dims[p][1] for p in parts] for name, parts in family_of(model).fused.items()}
    out = {}
    for key, t in state.items():
        module = key.split(".")[-2] if key.count(".") >= 2 else ""
        expert = ".experts." in key
        if key.endswith(".experts.gate_up_proj"):  # transformers 5's fused [E, 2I, H]: gate's rows, up's
            e, rows, d = t.shape
            n = rows // 2 // tp
            out[key] = t.view(e, 2, rows // 2, d)[:, :, rank * n : (rank + 1) * n].reshape(e, 2 * n, d).contiguous()
        elif key.endswith(".experts.down_proj"):  # [E, H, I]: by input columns
            n = t.shape[2] // tp
            out[key] = t[:, :, rank * n : (rank + 1) * n].contiguous()
        elif expert and module in _EXPERT_COLUMN:
            out[key] = _rows(t, rank, tp)
        elif expert and module in _EXPERT_ROW:
            out[key] = _cols(t, rank, tp)
        elif key in VOCAB_PARALLEL:
            out[key] = _padded_rows(t, rank, tp)
        elif module in fused:
            out[key] = _fused_rows(t, fused[module], rank, tp)
        elif module in COLUMN_PARALLEL:
            out[key] = _rows(t, rank, tp)
        elif module in ROW_PARALLEL and key.endswith(".weight"):
            out[key] = _cols(t, rank, tp)
        else:
            out[key] = t
    return out


def _a_share(pairs: list[tuple[Tensor, Tensor]], rank: int, tp: int) -> list[Tensor]:
    """Rank ``rank``'s rows of a column-parallel group's stacked A (its targeted modules' A, in
    order), returned as each module's part of them (some empty) so that stacking the parts again is
    the share; the last rank's share ends in zero rows when ``tp`` does not divide the rows."""
    total = sum(a.shape[0] for a, _ in pairs)
    n = -(-total // tp)
    lo, hi = rank * n, (rank + 1) * n
    parts, start = [], 0
    for a, _ in pairs:
        end = start + a.shape[0]
        parts.append(a[max(lo, start) - start : max(min(hi, end), start) - start].contiguous())
        start = end
    short = n - sum(p.shape[0] for p in parts)
    if short:
        parts[-1] = torch.cat([parts[-1], parts[-1].new_zeros(short, pairs[-1][0].shape[1])])
    return parts


def shard_lora(
    tensors: dict[tuple[int, str], tuple[Tensor, Tensor]], rank: int, tp: int
) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """Rank ``rank``'s (A, B) of each (layer, module): on a column-parallel group, B's output rows
    and the rank's rows of the group's stacked A (:func:`_a_share`); on a row-parallel module, A's
    input columns and B's output rows. Each rank holds ``1/tp`` of the adapter (up to ``tp - 1``
    zero rows of A per group)."""
    out = {}
    layers = sorted({layer for layer, _ in tensors})
    for layer in layers:
        for group in GROUPS:
            keys = [(layer, m) for m in group if (layer, m) in tensors]
            if not keys:
                continue
            if group[0] in ROW_PARALLEL:
                for key in keys:
                    a, b = tensors[key]
                    out[key] = (_cols(a, rank, tp), _rows(b, rank, tp))
                continue
            pairs = [tensors[key] for key in keys]
            for key, a, (_, b) in zip(keys, _a_share(pairs, rank, tp), pairs, strict=True):
                out[key] = (a, _rows(b, rank, tp))
        out |= _expert_shards(tensors, layer, rank, tp)
    return out


def _expert_shards(
    tensors: dict[tuple[int, str], tuple[Tensor, Tensor]], layer: int, rank: int, tp: int
) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """Rank ``rank``'s (A, B) of layer ``layer``'s expert LoRA, split as the dense MLP's: an expert's
    gate_up group (gate and up, or PEFT's fused gate_up with one A and B ``[2I, r]``: each half's
    rows) column-parallel, its down row-parallel (``adapters/moe_layout.py`` lays out the shares)."""
    out = {}
    experts = sorted({int(m.split(".")[1]) for lay, m in tensors if lay == layer and m.startswith("experts.")})
    for e in experts:
        fused = (layer, expert_module(e, FUSED_GATE_UP))
        if fused in tensors:
            a, b = tensors[fused]
            out[fused] = (_a_share([(a, b)], rank, tp)[0], _fused_rows(b, [b.shape[0] // 2] * 2, rank, tp))
        keys = [k for m in ("gate_proj", "up_proj") if (k := (layer, expert_module(e, m))) in tensors]
        if keys:
            pairs = [tensors[key] for key in keys]
            for key, a, (_, b) in zip(keys, _a_share(pairs, rank, tp), pairs, strict=True):
                out[key] = (a, _rows(b, rank, tp))
        down = (layer, expert_module(e, "down_proj"))
        if down in tensors:
            a, b = tensors[down]
            out[down] = (_cols(a, rank, tp), _rows(b, rank, tp))
    return out


def checkpoint_weight(model_dir: str, model: ModelConfig) -> Callable[[int, str], Tensor]:
    """DoRA's base weights under tensor parallelism: ``module``'s whole weight [d_out, d_in] of layer
    ``layer`` in float32, read from the checkpoint's files (no rank holds it whole; its norm is over
    every input, which o and down split across ranks)."""
    from safetensors import safe_open

    from lorapage.model.loader import weight_files

    where: dict[str, object] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            where |= dict.fromkeys(f.keys(), path)
    dims, fused = model.module_dims(), family_of(model).fused

    def weight(layer: int, module: str) -> Tensor:
        prefix = f"model.layers.{layer}." + ("self_attn." if module in GROUPS[0] + GROUPS[1] else "mlp.")
        name, rows = module, slice(None)
        for fused_name, parts in fused.items():
            if module in parts:
                start = sum(dims[p][1] for p in parts[: parts.index(module)])
                name, rows = fused_name, slice(start, start + dims[module][1])
        key = prefix + name + ".weight"
        with safe_open(str(where[key]), framework="pt") as f:
            return f.get_tensor(key)[rows].float()

    return weight


def shard_section(section: Tensor, rank: int, tp: int, model: ModelConfig, vectors: bool = True) -> Tensor:
    """Rank ``rank``'s variant data from the whole model's (``adapters/variant_layout.py``): the DoRA
    and lora_bias rows [layers, 2 * its columns] from [layers, 2 * every module's output columns]
    when there are ``vectors``, then the embedding LoRA's data as it is (every rank adds the same
    delta to its whole embeddings, after their all-reduce). A column-parallel module's columns are
    the rank's output rows; a row-parallel module's output is whole on every rank (a partial sum,
    which DoRA's per-column factor scales as it scales the sum), so its DoRA factors are whole
    everywhere and its lora_bias is rank 0's alone (added once to the sum)."""
    dims = model.projection_dims()
    if not vectors:
        return section
    total = sum(d for _, d in dims.values())
    dora, bias, col = [], [], 0
    for module, (_, d_out) in dims.items():
        g, b = section[:, col : col + d_out], section[:, total + col : total + col + d_out]
        if module in ROW_PARALLEL:
            dora.append(g)
            bias.append(b if rank == 0 else torch.zeros_like(b))
        else:
            dora.append(_cols(g, rank, tp))
            bias.append(_cols(b, rank, tp))
        col += d_out
    return torch.cat([*dora, *bias, section[:, 2 * total :]], dim=1)
