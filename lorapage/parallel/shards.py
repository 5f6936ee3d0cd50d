"""What one tensor-parallel rank holds of the base and of an adapter (Megatron's split, S-LoRA's
LoRA shards), as pure slicing of the tensors every rank reads alike.

Column-parallel projections (q, k, v by heads; gate, up by columns): the base weight and LoRA-B
are split by output rows, LoRA-A is whole on every rank (its shrink is computed on each rank:
``r`` columns, cheaper than gathering it). Row-parallel ones (o, down): the base weight and LoRA-A
are split by input columns, LoRA-B is whole; each rank's base output plus its LoRA expand is a
partial sum, and one all-reduce per projection adds base and LoRA together::

    sum_r (x_r W_r^T + s (x_r A_r^T) B^T) = x W^T + s (x A^T) B^T

The embedding, lm_head and norms are whole on every rank (vocabulary-parallel is a later step).
A rank's model is the base's :class:`ModelConfig` with its heads and intermediate divided
(:func:`shard_config`), so the decoder, the pool's page size and an adapter's page layout are the
unsharded code run at the shard's dimensions.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from lorapage.model.config import ModelConfig

# Architectures served under tensor parallelism: separate q/k/v and gate/up weights, dense MLP.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """ValueError naming what keeps ``model`` from running on ``tp`` ranks (nothing when tp == 1)."""
    if tp == 1:
        return
    if model.architecture not in TP_ARCHITECTURES:
        raise ValueError(
            f"tensor_parallel_size {tp}: {model.architecture} is not served under tensor parallelism yet "
            f"(supported: {', '.join(TP_ARCHITECTURES)}; fused Phi-3 weights, Gemma and MoE run with "
            "tensor_parallel_size 1; docs/parallel.md)"
        )
    for name, value in (
        ("num_attention_heads", model.num_heads),
        ("num_key_value_heads", model.num_kv_heads),
        ("intermediate_size", model.intermediate_size),
    ):
        if value % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide the base's {name} ({value}): each rank holds an "
                f"equal share; use a tensor_parallel_size that divides it"
            )


def shard_config(model: ModelConfig, tp: int) -> ModelConfig:
    """One rank's model: ``1/tp`` of the query heads, KV heads and MLP columns, the rest as is."""
    if tp == 1:
        return model
    return dataclasses.replace(
        model,
        num_heads=model.num_heads // tp,
        num_kv_heads=model.num_kv_heads // tp,
        intermediate_size=model.intermediate_size // tp,
    )


def _rows(t: Tensor, rank: int, tp: int) -> Tensor:
    n = t.shape[0] // tp
    return t[rank * n : (rank + 1) * n].contiguous()


def _cols(t: Tensor, rank: int, tp: int) -> Tensor:
    n = t.shape[1] // tp
    return t[:, rank * n : (rank + 1) * n].contiguous()


def shard_base(state: dict[str, Tensor], rank: int, tp: int) -> dict[str, Tensor]:
    """Rank ``rank``'s tensors of a checkpoint: column-parallel weights (and biases) by output rows,
    row-parallel ones by input columns, everything else whole. Heads stay whole: q, k and v rows
    are head-major, so ``1/tp`` of the rows is ``1/tp`` of the heads."""
    if tp == 1:
        return state
    out = {}
    for key, t in state.items():
        module = key.split(".")[-2] if key.count(".") >= 2 else ""
        if module in COLUMN_PARALLEL:
            out[key] = _rows(t, rank, tp)
        elif module in ROW_PARALLEL and key.endswith(".weight"):
            out[key] = _cols(t, rank, tp)
        else:
            out[key] = t
    return out


def shard_lora(
    tensors: dict[tuple[int, str], tuple[Tensor, Tensor]], rank: int, tp: int
) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """Rank ``rank``'s (A, B) of each (layer, module): B by output rows on a column-parallel
    module, A by input columns on a row-parallel one; the other matrix whole."""
    out = {}
    for (layer, module), (a, b) in tensors.items():
        if module in ROW_PARALLEL:
            out[(layer, module)] = (_cols(a, rank, tp), b)
        else:
            out[(layer, module)] = (a, _rows(b, rank, tp))
    return out
