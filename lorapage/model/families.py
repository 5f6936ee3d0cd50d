"""What differs between the dense decoder families lorapage runs, as data: one row per family.

Every family here is the Llama decoder (pre-norm RMSNorm, rotary attention with GQA, SwiGLU MLP)
with a few switches: Qwen3 normalises each query and key head (``q_norm`` / ``k_norm``) before the
rotation; Phi-3 (and Phi-4, the same ``Phi3ForCausalLM``) stores the projection groups fused in
its checkpoint (``qkv_proj``, ``gate_up_proj``), so its PEFT adapters target those names. The
model always runs the groups fused (:data:`~lorapage.model.config.GROUPS`); a fused LoRA module is
split into its parts when read (A shared by the parts, B split by rows), so one per-module layout
in pages serves every family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lorapage.model.config import GROUPS, ModelConfig

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Family:
    """A decoder family's differences from Llama."""

    name: str
    # checkpoint projection -> the MODULES it holds, stacked by rows in that order
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    qk_norm: bool = False  # RMSNorm over head_dim on every query and key head, before the rotation

    def checkpoint_modules(self) -> tuple[str, ...]:
        """The projection names a checkpoint (and a PEFT adapter) of this family uses, in order."""
        names: list[str] = []
        for group in GROUPS:
            fused = self.fused_name(group)
            names += [fused] if fused else list(group)
        return tuple(names)

    def fused_name(self, group: tuple[str, ...]) -> str | None:
        """The checkpoint's one name for ``group``'s modules, when it stores them fused."""
        return next((name for name, parts in self.fused.items() if parts == group), None)


LLAMA = Family("llama")
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2"),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
    "Phi3ForCausalLM": Family(
        "phi3", fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    ),
}


def family_of(config: ModelConfig) -> Family:
    """The family of ``config``'s architecture (Llama's switches for one without a row)."""
    return FAMILIES.get(config.architecture, LLAMA)


def checkpoint_module_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of every projection as the checkpoint (and a PEFT adapter) names it: a
    fused module's d_out is its parts' summed."""
    dims, family = config.module_dims(), family_of(config)
    out: dict[str, tuple[int, int]] = {}
    for name in family.checkpoint_modules():
        parts = family.fused.get(name, (name,))
        out[name] = (dims[parts[0]][0], sum(dims[p][1] for p in parts))
    return out


def group_weight(get: Callable[[str], Tensor], prefix: str, config: ModelConfig, group: tuple[str, ...]) -> Tensor:
    """``group``'s fused weight [sum d_out, d_in] (or bias) read with ``get`` from the checkpoint
    keys ``prefix + module + suffix``: one tensor where the family stores the group fused, the
    parts' stacked by rows otherwise. ``prefix`` ends where the module name starts; ``get`` adds
    the suffix."""
    import torch

    fused = family_of(config).fused_name(group)
    if fused:
        return get(prefix + fused)
    return torch.cat([get(prefix + m) for m in group])


def split_fused_pairs(
    config: ModelConfig, pairs: Mapping[tuple[int, str], tuple[Tensor, Tensor]]
) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    """An adapter's (layer, module) -> (A, B) with every fused module split into its parts: each
    part shares the fused A [r, d_in] (the same tensor) and takes its rows of B. ``B_part @ A`` is
    then exactly the part's rows of ``B @ A``, so the per-module layout computes what PEFT does."""
    family, dims = family_of(config), config.module_dims()
    out: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    for (layer, module), (a, b) in pairs.items():
        if module not in family.fused:  # a plain module (or a MoE expert's, split by moe_format)
            out[(layer, module)] = (a, b)
            continue
        row = 0
        for part in family.fused[module]:
            rows = dims[part][1]
            out[(layer, part)] = (a, b[row : row + rows])
            row += rows
    return out


def split_fused_values(config: ModelConfig, values: Mapping[tuple[int, str], object]) -> dict:
    """Per-(layer, module) values (ranks, scales) with a fused module's value given to each part."""
    family = family_of(config)
    return {(layer, part): v for (layer, m), v in values.items() for part in family.fused.get(m, (m,))}


def refuse_foreign_module(config: ModelConfig, module: str) -> str | None:
    """Why an adapter's ``module`` cannot be served on ``config``'s family (a name of another
    family's checkpoints, e.g. ``q_proj`` on Phi-3 or ``qkv_proj`` on Llama), or None."""
    family = family_of(config)
    names = family.checkpoint_modules()
    if module in names:
        return None
    owners = sorted({f.name for f in FAMILIES.values() if module in f.checkpoint_modules()})
    trained = f"a module of {'/'.join(owners)} checkpoints" if owners else "not a projection lorapage knows"
    return (
        f"module {module!r} is {trained}; this base is {config.architecture} ({family.name}), whose LoRA target "
        f"modules are {', '.join(names)}. Was the adapter trained on another model family?"
    )
