"""PEFT LoRA on a MoE base's experts, in the two forms PEFT writes, read as per-expert modules.

* **Per expert** (``target_modules`` on transformers 4's per-expert Linears, what most hub
  adapters hold): ``layers.{l}.block_sparse_moe.experts.{e}.w1.lora_A.weight`` (Mixtral: w1 gate,
  w3 up, w2 down) or ``layers.{l}.mlp.experts.{e}.gate_proj.lora_A.weight`` (Qwen3-MoE), each
  ``[r, d_in]`` / ``[d_out, r]``: the module ``experts.{e}.gate_proj`` of the adapter's ranks.
* **Fused** (``target_parameters`` on transformers 5's ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``mlp.experts.down_proj`` [E, H, I]): one ``lora_A`` ``[r * E, d_in]`` and ``lora_B``
  ``[d_out, r * E]`` per tensor under ``layers.{l}.mlp.experts.`` (the second targeted tensor's
  wrapper nests the first's, which is why its keys carry ``base_layer.``). Expert e's A is rows
  ``[e * r, (e + 1) * r)``, its B the columns ``k * E + e`` (``peft.tuners.lora.layer.ParamWrapper``).
  Which tensor a pair adapts follows from its shapes: gate_up's A reads ``hidden`` and its B writes
  ``2 * I``; down's the reverse (the two cannot coincide). A fused gate_up pair is the module
  ``experts.{e}.gate_up_proj``: one A for gate and up, B's first ``I`` rows gate's.

LoRA on the router (``mlp.gate``, ``block_sparse_moe.gate``) is refused: it would change which
experts a row's tokens reach, which no merged or batched form here reproduces.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lorapage.errors import AdapterFormatError
from lorapage.model.config import MODULES, ModelConfig
from lorapage.model.moe_config import FUSED_GATE_UP, expert_module, split_expert_module

_PREFIX = r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\."
_EXPERT_KEY = re.compile(_PREFIX + r"(\d+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_FUSED_KEY = re.compile(_PREFIX + r"((?:base_layer\.)*)lora_([AB])(?:\.[\w-]+)?\.weight$")
_ROUTER_KEY = re.compile(r"\.(?:block_sparse_moe|mlp)\.gate\.(?:base_layer\.)*lora_")
_HUB_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

T = TypeVar("T")


def _fail(path: Path, why: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter at {path}: {why}")


def parse_expert_key(path: Path, key: str) -> tuple[int, str, str] | None:
    """(layer, ``experts.{e}.{name}``, "A" | "B") of a per-expert LoRA key; None for another key;
    a refusal for LoRA on the router."""
    if _ROUTER_KEY.search(key):
        raise _fail(path, f"tensor {key}: LoRA on the MoE router (gate) is not supported; train without it")
    m = _EXPERT_KEY.match(key)
    if m is None:
        return None
    name = _HUB_NAMES.get(m.group(3), m.group(3))
    return int(m.group(1)), expert_module(int(m.group(2)), name), m.group(4)


def peft_module_name(layer: int, module: str) -> str:
    """The module name PEFT's ``rank_pattern`` / ``alpha_pattern`` keys are matched against."""
    if split_expert_module(module) is not None:
        return f"model.layers.{layer}.mlp.{module}"
    return f"model.layers.{layer}.{'self_attn' if module in (*MODULES[:4], 'qkv_proj') else 'mlp'}.{module}"


def expert_geometry(model: ModelConfig) -> tuple[int, int, int] | None:
    """(experts, hidden, expert intermediate) of a MoE base: what splitting fused expert LoRA
    needs (an adapter's spec keeps it); None for a dense base."""
    moe = model.moe
    return None if moe is None else (moe.num_experts, model.hidden_size, moe.intermediate_size)


def split_fused(
    path: Path,
    items: dict[str, T],
    geometry: tuple[int, int, int] | None,
    shape: Callable[[T], list[int]],
    take: Callable[[T, str, int, int], T],
) -> dict[str, T]:
    """``items`` (a weights file's keys, to shapes or tensors) with each fused expert pair replaced
    by one per-expert pair per expert, keyed in the per-expert spelling. ``geometry`` is the
    base's (:func:`expert_geometry`); ``take(item, "A" | "B", expert, rank)`` cuts one expert's
    matrix out of a fused one."""
    fused: dict[tuple[int, str], dict[str, str]] = {}
    out: dict[str, T] = {}
    for key, item in items.items():
        m = _FUSED_KEY.match(key)
        if m is None:
            out[key] = item
        else:
            fused.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = key
    if fused and geometry is None:
        raise _fail(path, "it holds LoRA on fused experts (mlp.experts.lora_A / lora_B), but the base has no experts")
    parts: set[tuple[int, str]] = set()
    for (layer, _), keys in sorted(fused.items()):
        if set(keys) != {"A", "B"}:
            raise _fail(path, f"layers.{layer}.mlp.experts: a fused lora_{''.join(keys)} without its pair")
        a, b = shape(items[keys["A"]]), shape(items[keys["B"]])
        assert geometry is not None
        part, rank = _fused_part(path, layer, a, b, geometry)
        if (layer, part) in parts:
            raise _fail(path, f"layers.{layer}.mlp.experts: two fused LoRA pairs on {part}")
        parts.add((layer, part))
        for e in range(geometry[0]):
            for ab in "AB":
                key = f"model.layers.{layer}.mlp.experts.{e}.{part}.lora_{ab}.weight"
                out[key] = take(items[keys[ab]], ab, e, rank)
    return out


def _fused_part(path: Path, layer: int, a: list[int], b: list[int], geometry: tuple[int, int, int]) -> tuple[str, int]:
    """Which fused tensor an A / B pair adapts, and its rank per expert."""
    experts, hidden, inter = geometry
    shapes = {FUSED_GATE_UP: (hidden, 2 * inter), "down_proj": (inter, hidden)}
    rows = a[0] if len(a) == 2 else -1
    for part, (d_in, d_out) in shapes.items():
        if a == [rows, d_in] and b == [d_out, rows] and rows > 0 and rows % experts == 0:
            return part, rows // experts
    raise _fail(
        path,
        f"layers.{layer}.mlp.experts: fused lora_A {a} / lora_B {b} fit neither gate_up_proj "
        f"([r*{experts}, {hidden}] / [{2 * inter}, r*{experts}]) nor down_proj ([r*{experts}, {inter}] / "
        f"[{hidden}, r*{experts}]); was it trained on another model?",
    )


def check_expert_forms(path: Path, modules: set[tuple[int, str]]) -> None:
    """Refuse an adapter that adapts one expert's gate or up both fused and on its own."""
    for layer, module in modules:
        parts = split_expert_module(module)
        if parts is not None and parts[1] == FUSED_GATE_UP:
            alone = {expert_module(parts[0], m) for m in ("gate_proj", "up_proj")}
            if any((layer, m) in modules for m in alone):
                raise _fail(path, f"layers.{layer}.{module}: gate_up_proj is adapted both fused and per module")
