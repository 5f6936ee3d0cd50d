"""The sparse MLP of Mixtral and Qwen3-MoE: a top-k router over experts, each a SwiGLU MLP, with
every row's own LoRA inside the experts it is routed to.

Per layer the router picks each token's ``top_k`` experts (softmax in float32, then the top k;
Mixtral always renormalises them to sum to 1, Qwen3-MoE when ``norm_topk_prob``). Expert ``e``
then runs on the rows routed to it, gathered in token order: its base GEMMs, and for rows with an
adapter the same LoRA shrink / expand ops the dense projections use (every kernel backend), read
from the expert's rows of the lookup tables (:class:`~lorapage.model.lora_tables.LoraTables`).
A gathered subset of rows keeps each adapter's rows consecutive, so its segments are runs of the
subset's slots; the ops plan their batches for that call. Its output, weighted by the router,
is added into the tokens' rows in expert order, as transformers does.

Routing and gathering read the routing on the host and vary the shapes per step, so a MoE base
runs eagerly (no CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lorapage.kernels import LoraIndices
from lorapage.kernels.backend import KernelOps, Linear, PackWeight
from lorapage.kernels.linear_cpu import keep_weight
from lorapage.model.config import ModelConfig
from lorapage.model.lora_tables import EXPERT_GROUPS, LoraTables
from lorapage.model.moe_config import MoeConfig
from lorapage.model.rank_comm import RankComm, gather_shrink

# The keys a checkpoint may hold one layer's experts under (after ``model.layers.{i}.``):
# transformers' own fused tensors, then the hub's per-expert spellings (Mixtral's w1 / w3 / w2).
_BLOCKS = ("mlp.", "block_sparse_moe.")
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass
class ExpertLora:
    """What a step's expert LoRA reads: the lookup tables, the rows' slots (on the device and on
    the host) and the shrink's scratch buffer."""

    ops: KernelOps
    tables: LoraTables
    token_slot: Tensor  # [T] int32 on the device
    host_slots: np.ndarray  # [T]: the same, on the host
    h: Tensor  # [>= T, >= widest group rank] scratch for the shrink

    def indices(self, rows: np.ndarray, device_rows: Tensor) -> LoraIndices | None:
        """The LoRA indices of the gathered ``rows`` (ascending); None if none has an adapter."""
        slots = self.host_slots[rows]
        if not slots.any():
            return None
        cuts = [0, *(np.flatnonzero(np.diff(slots)) + 1).tolist(), len(slots)]
        segments = tuple((a, b, int(slots[a])) for a, b in zip(cuts, cuts[1:]) if slots[a])
        return LoraIndices(self.token_slot.index_select(0, device_rows).contiguous(), segments)

    def apply(
        self, y: Tensor, x: Tensor, slab: Tensor, layer: int, expert: int, group: int, lora: LoraIndices,
        out_start: tuple[int, ...],
    ) -> None:  # fmt: skip
        """``y += x``'s LoRA update through expert ``expert``'s group ``group`` (0: gate_up, 1: down)."""
        h = self.h[: x.shape[0]]
        self.shrink(h, x, slab, layer, expert, group, lora)
        self.expand(y, h, slab, layer, expert, group, lora, out_start)

    def shrink(
        self, h: Tensor, x: Tensor, slab: Tensor, layer: int, expert: int, group: int, lora: LoraIndices
    ) -> None:
        """``h`` = ``x``'s shrink through expert ``expert``'s group ``group``'s stacked A."""
        t = self.tables
        assert t.experts is not None
        e = t.experts
        self.ops.lora_shrink(
            h, x, slab, t.page_table, lora, e.a_offset[layer, :, expert, group], e.a_rows[layer, :, expert, group]
        )

    def expand(
        self, y: Tensor, h: Tensor, slab: Tensor, layer: int, expert: int, group: int, lora: LoraIndices,
        out_start: tuple[int, ...],
    ) -> None:  # fmt: skip
        """``y += h``'s expand through expert ``expert``'s group ``group``'s B's, scaled."""
        t = self.tables
        assert t.experts is not None
        e = t.experts
        m0, m1 = EXPERT_GROUPS[group]
        self.ops.lora_expand(
            y,
            h,
            slab,
            t.page_table,
            lora,
            e.b_offset[layer, :, expert, m0:m1],
            e.rank[layer, :, expert, m0:m1],
            e.h_start[layer, :, expert, m0:m1],
            e.scale[layer, :, expert, m0:m1],
            out_start,
        )


class MoeMlp:
    """One layer's router and experts (weights, and the forward over them)."""

    def __init__(self, config: MoeConfig, router: Tensor, gate_up: list[Tensor], down: list[Tensor]) -> None:
        self.config = config
        self.router = router  # [E, hidden]
        self.gate_up = gate_up  # per expert [2 * I, hidden]: gate's rows, then up's
        self.down = down  # per expert [hidden, I]
        self.pack_weight: PackWeight = keep_weight  # how the experts' weights are held (pack)

    @classmethod
    def load(cls, config: MoeConfig, state: dict[str, Tensor], prefix: str, get: Callable[[str], Tensor]) -> MoeMlp:
        """Take layer ``prefix``'s router and experts out of ``state``, in either spelling: fused
        ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] (transformers 5's
        modules), or one tensor per expert and matrix (what ``save_pretrained`` and the hub write)."""
        for block in _BLOCKS:
            p = prefix + block
            if p + "gate.weight" not in state:
                continue
            router = get(p + "gate.weight")
            if p + "experts.gate_up_proj" in state:
                return cls(config, router, list(get(p + "experts.gate_up_proj")), list(get(p + "experts.down_proj")))
            for gate, up, down in _PER_EXPERT:
                if p + f"experts.0.{gate}.weight" in state:
                    pre = [p + f"experts.{e}." for e in range(config.num_experts)]
                    gate_up = [torch.cat([get(q + f"{gate}.weight"), get(q + f"{up}.weight")]) for q in pre]
                    return cls(config, router, gate_up, [get(q + f"{down}.weight") for q in pre])
        raise ValueError(f"no router and experts under {prefix}mlp / block_sparse_moe in the checkpoint")

    def pack(self, pack: PackWeight) -> None:
        """Hold the experts' weights as the backend's GEMM reads them (the router stays plain)."""
        self.gate_up = [pack(w) for w in self.gate_up]
        self.down = [pack(w) for w in self.down]
        self.pack_weight = pack

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (float32), as transformers routes."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(
        self, x: Tensor, linear: Linear, lora: ExpertLora | None, layer: int, slab: Tensor,
        comm: RankComm | None = None,
    ) -> Tensor:  # fmt: skip
        """The MLP's output [T, hidden] for the normed hidden states ``x``; ``lora`` None: no row
        has an adapter. ``slab`` is layer ``layer``'s adapter pages. Under tensor parallelism
        (``comm``) each rank computes its partial output and the one all-reduce sums them."""
        if comm is not None:
            out = self._rank_share(x, linear, lora, layer, slab, comm)
            comm.all_reduce(out)
            return out
        experts, weights = self.route(x)
        if not self.config.float32_weights:
            weights = weights.to(x.dtype)
        host = experts.cpu().numpy()
        out = torch.zeros_like(x)
        inter = self.config.intermediate_size
        for e in np.unique(host).tolist():
            rows = np.flatnonzero((host == e).any(axis=1))
            device_rows = torch.from_numpy(rows).to(x.device)
            xe = x.index_select(0, device_rows)
            indices = lora.indices(rows, device_rows) if lora is not None else None
            gu = linear(xe, self.gate_up[e])
            if indices is not None and lora is not None:
                lora.apply(gu, xe, slab, layer, e, 0, indices, (0, inter))
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
            y = linear(act, self.down[e])
            if indices is not None and lora is not None:
                lora.apply(y, act, slab, layer, e, 1, indices, (0,))
            w = (weights.index_select(0, device_rows) * (experts.index_select(0, device_rows) == e)).sum(-1)
            out.index_add_(0, device_rows, (y * w[:, None]).to(x.dtype))
        return out

    def _rank_share(
        self, x: Tensor, linear: Linear, lora: ExpertLora | None, layer: int, slab: Tensor, comm: RankComm
    ) -> Tensor:
        """This rank's partial MLP output: every routed expert through the rank's share of its
        columns (``parallel/shards.py``), and its LoRA fully sharded as the dense MLP's, with the
        collectives batched over the step's experts: one all-gather of every gate_up shrink share,
        one all-reduce of every partial down shrink. Every rank routes the same all-reduced hidden
        states alike, so every rank runs the same experts and the same collectives."""
        experts, weights = self.route(x)
        if not self.config.float32_weights:
            weights = weights.to(x.dtype)
        host = experts.cpu().numpy()
        inter = self.config.intermediate_size
        runs: list[tuple[int, Tensor, Tensor, LoraIndices | None, int]] = []  # expert, rows, x, LoRA, h row
        start = 0
        for e in np.unique(host).tolist():
            rows = np.flatnonzero((host == e).any(axis=1))
            device_rows = torch.from_numpy(rows).to(x.device)
            indices = lora.indices(rows, device_rows) if lora is not None else None
            runs.append((e, device_rows, x.index_select(0, device_rows), indices, start))
            start += len(rows) if indices is not None else 0
        h_gate_up = h_down = None
        if lora is not None and start:  # the rows' shrinks, each tuned run's at its h row
            assert lora.tables.experts is not None
            h_gate_up, h_down = (lora.h.new_zeros(start, lora.h.shape[1]) for _ in range(2))
            shares = []
            for e, _, xe, indices, at in runs:
                if indices is not None:
                    lora.shrink(h_gate_up[at : at + xe.shape[0]], xe, slab, layer, e, 0, indices)
                    shares.append(lora.tables.experts.a_rows[layer, indices.token_slot.long(), e, 0])
            gather_shrink(h_gate_up, comm, torch.cat(shares))
        ys = []
        for e, _, xe, indices, at in runs:
            gu = linear(xe, self.gate_up[e])
            if indices is not None and lora is not None and h_gate_up is not None and h_down is not None:
                lora.expand(gu, h_gate_up[at : at + xe.shape[0]], slab, layer, e, 0, indices, (0, inter))
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
            if indices is not None and lora is not None and h_down is not None:
                lora.shrink(h_down[at : at + act.shape[0]], act, slab, layer, e, 1, indices)
            ys.append(linear(act, self.down[e]))
        if h_down is not None:
            comm.all_reduce(h_down)  # each rank's A held its input columns: partial shrinks
        out = torch.zeros_like(x)
        width = x.shape[1] // comm.world  # a rank's rows of each down B: its columns of the output
        for (e, device_rows, _, indices, at), y in zip(runs, ys, strict=True):
            if indices is not None and lora is not None and h_down is not None:
                part = y.new_zeros(y.shape[0], width)
                lora.expand(part, h_down[at : at + y.shape[0]], slab, layer, e, 1, indices, (0,))
                y[:, comm.rank * width : (comm.rank + 1) * width] += part
            w = (weights.index_select(0, device_rows) * (experts.index_select(0, device_rows) == e)).sum(-1)
            out.index_add_(0, device_rows, (y * w[:, None]).to(x.dtype))
        return out


def expert_lora(ops: KernelOps, tables: LoraTables, lora: LoraIndices, h: Tensor) -> ExpertLora | None:
    """The step's :class:`ExpertLora` for rows with slots ``lora.token_slot``; None when no row's
    adapter has LoRA on an expert. Rows whose adapter has none count as slot 0 in the experts."""
    assert tables.experts is not None
    slots = lora.token_slot.cpu().numpy()
    slots = np.where(tables.experts.targeted[slots], slots, 0)
    return ExpertLora(ops, tables, lora.token_slot, slots, h) if slots.any() else None


def norm_qk(
    qkv: Tensor, q_norm: Tensor, k_norm: Tensor, config: ModelConfig, rms_norm: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """q and k of ``qkv`` [T, q + k + v] after their RMSNorm, as ``[T, heads + kv heads, head_dim]``:
    per head (Qwen3-MoE) or over each whole projection (OLMoE, which then clamps q, k and v to
    ``clip_qkv`` when set; v in place in ``qkv``)."""
    assert config.moe is not None
    T, q_size, kv_size, d = qkv.shape[0], config.q_size, config.kv_size, config.head_dim
    q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
    if config.moe.qk_norm == "head":
        q, k = rms_norm(q.view(T, -1, d), q_norm), rms_norm(k.view(T, -1, d), k_norm)
    else:
        q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)
    qk = torch.cat([q.reshape(T, q_size), k.reshape(T, kv_size)], dim=1)
    if (clip := config.moe.clip_qkv) is not None:
        qk.clamp_(-clip, clip)
        qkv[:, q_size + kv_size :].clamp_(-clip, clip)
    return qk.view(T, -1, d)
