"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/4) over the unified page pool.

The base runs one fused GEMM per projection group (qkv, o, gate_up, down) for the whole batch;
each group's LoRA update is a shrink into ``h`` then an expand into the group's output, every
token using its own adapter slot. Attention writes the step's K and V into the tokens' pages,
then reads each sequence's context back from its pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lorapage.kernels import LoraIndices
from lorapage.kernels.backend import KernelOps, Linear, PackWeight
from lorapage.kernels.linear_cpu import keep_weight, linear_ref
from lorapage.kernels.linear_int8 import dense_weight
from lorapage.model.config import GROUPS, MODULES, ROW_GROUPS, ModelConfig
from lorapage.model.families import family_of, group_weight
from lorapage.model.lora_tables import LoraTables
from lorapage.model.lora_variants import add_embedding_lora, apply_vectors
from lorapage.model.moe import MoeMlp, expert_lora, norm_qk
from lorapage.model.rank_comm import RankComm, gather_shrink, vocab_embed, vocab_logits
from lorapage.model.rope import rope_tables


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the pool and what each sequence attends to.

    Rows ``[0, num_decode)`` are decode tokens (one per sequence); the rest are prefill tokens,
    sequence by sequence. Tensors are views of buffers the runner allocated once.
    """

    slot_mapping: Tensor  # [T] int64: page * block_size + offset of each token's K/V
    num_decode: int
    decode_block_table: Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: Tensor  # [num_decode] int32
    prefill_block_table: Tensor  # [num_prefill, max_blocks] int32
    prefill_query_starts: list[int]  # offsets (from num_decode) of each prefill sequence's tokens, + end
    prefill_context_lens: list[int]


def _group_module_slices() -> list[tuple[int, int]]:
    """(first, end) module indices of each group in the MODULES order."""
    out, i = [], 0
    for group in GROUPS:
        out.append((i, i + len(group)))
        i += len(group)
    return out


GROUP_MODULES = _group_module_slices()
# The key of each group's fused weight in LlamaModel.layers, in GROUPS' order.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


class LlamaModel:
    """Weights and forward pass. Stateless across steps: the KV lives in the pool."""

    def __init__(
        self, config: ModelConfig, state: dict[str, Tensor], device: torch.device, dtype: torch.dtype, max_len: int
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        c = config
        get = lambda k: state.pop(k).to(device=device, dtype=dtype)  # noqa: E731
        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie_word_embeddings or "lm_head.weight" not in state else get("lm_head.weight")
        state.pop("lm_head.weight", None)
        self.final_norm = get("model.norm.weight")
        weight = lambda k: get(k + ".weight")  # noqa: E731
        self.layers = []
        self.moe_layers: list[MoeMlp] = []  # a MoE family's sparse MLPs, one per layer (moe.py)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "in_norm": get(p + "input_layernorm.weight"),
                "post_norm": get(p + "post_attention_layernorm.weight"),
                "qkv": group_weight(weight, p + "self_attn.", c, GROUPS[0]),
                "o": get(p + "self_attn.o_proj.weight"),
            }
            if c.moe is None:
                layer["gate_up"] = group_weight(weight, p + "mlp.", c, GROUPS[2])
                layer["down"] = get(p + "mlp.down_proj.weight")
            else:
                self.moe_layers.append(MoeMlp.load(c.moe, state, p, get))
            if c.moe is not None and c.moe.qk_norm:
                layer["q_norm"], layer["k_norm"] = (
                    get(p + "self_attn.q_norm.weight"),
                    get(p + "self_attn.k_norm.weight"),
                )
            if c.attention_bias:
                layer["qkv_bias"] = group_weight(lambda k: get(k + ".bias"), p + "self_attn.", c, GROUPS[0])
            if family_of(c).qk_norm:  # one [q heads + kv heads, head_dim] weight: both norms in one op
                q_norm, k_norm = get(p + "self_attn.q_norm.weight"), get(p + "self_attn.k_norm.weight")
                layer["qk_norm"] = torch.cat([q_norm.expand(c.num_heads, -1), k_norm.expand(c.num_kv_heads, -1)])
            self.layers.append(layer)
        dims = c.module_dims()
        # Column where each module's output starts inside its group's fused output.
        self.out_starts = []
        self.out_widths: list[int] = []  # each group's fused output width
        for group in GROUPS:
            starts, col = [], 0
            for m in group:
                starts.append(col)
                col += dims.get(m, (0, 0))[1]  # a MoE base has no dense MLP
            self.out_starts.append(tuple(starts))
            self.out_widths.append(col)
        # cos / sin for every position, computed once in float32 exactly as HF does per step.
        cos, sin = rope_tables(c, max_len)
        self.cos_cache = cos.to(device, dtype)
        self.sin_cache = sin.to(device, dtype)
        self.scale = c.head_dim**-0.5
        # The projections' GEMM, and the layout their weights are held in (pack_weights).
        self.linear: Linear = linear_ref
        self._pack: PackWeight = keep_weight
        # Tensor parallelism (lorapage.parallel): this rank's collectives, which sum a row-parallel
        # projection's partial output (o, down: base and LoRA together), gather the sharded LoRA's
        # shrink and the vocabulary-parallel embedding and logits; None on one device.
        self.comm: RankComm | None = None

    def pack_weights(self, pack: PackWeight, linear: Linear, pack_logits: PackWeight | None = None) -> None:
        """Hold every projection's weight (and the logits', as ``pack_logits`` when given) as
        ``pack`` lays it out, and compute them with ``linear``: the kernel backend's pair, once at
        start-up. A tied ``lm_head`` gets a packed copy of its own (the embedding lookup reads the plain table)."""
        for layer in self.layers:
            for key in PROJECTIONS:
                if key in layer:
                    layer[key] = pack(layer[key])
        for moe in self.moe_layers:
            moe.pack(pack)
        self.lm_head = (pack_logits or pack)(self.lm_head)
        self.linear, self._pack = linear, pack

    def dense_weight(self, layer: int, key: str) -> Tensor:
        """Layer ``layer``'s fused projection ``key`` [d_out, d_in] as a plain tensor: the one the
        model holds (edits land in place) unless it is packed, then an unpacked copy for
        :meth:`store_weight`."""
        return dense_weight(self.layers[layer][key])

    def store_weight(self, layer: int, key: str, weight: Tensor) -> None:
        """Make ``weight`` (from :meth:`dense_weight`, edited) the projection's, packed as the rest."""
        if weight is not self.layers[layer][key]:
            self.layers[layer][key] = self._pack(weight)

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _paged_attention(
        self,
        ops: KernelOps,
        q: Tensor,
        kv: Tensor,
        attn: AttentionMetadata,
        window: int | None,
        softcap: float | None = None,
    ) -> Tensor:
        """Each token's attention [T, H * D] over its sequence's pages: the decode rows', then the
        prefill rows', through a layer's sliding ``window`` (None: global) and logit ``softcap``."""
        T, nd = q.shape[0], attn.num_decode
        out = torch.empty_like(q)
        if nd:
            ops.paged_decode_attention(
                out[:nd], q[:nd], kv, attn.decode_block_table, attn.decode_context_lens, self.scale, window, softcap
            )
        if T > nd:
            ops.prefill_attention(
                out[nd:],
                q[nd:],
                kv,
                attn.prefill_block_table,
                attn.prefill_query_starts,
                attn.prefill_context_lens,
                self.scale,
                window,
                softcap,
            )
        return out.view(T, -1)

    def _project(
        self,
        ops: KernelOps,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        layer: int,
        group: int,
        slab: Tensor,
        tables: LoraTables,
        lora: LoraIndices | None,
        h: Tensor,
    ) -> Tensor:
        """``x``'s projection by one group's fused ``weight`` (and ``bias``), with this step's
        LoRA update of the group added. Where the backend has a side thread (``ops.lora_side``)
        and the update is the C kernels' alone (short segments, no PEFT variant rows, one device),
        the update runs there while this thread runs the projection (kernels/lora_side.py)."""
        if lora is None:
            return self.linear(x, weight, bias)
        side, group_op = ops.lora_side, ops.lora_group
        if (
            side is None
            or group_op is None
            or self.comm is not None
            or lora.cells is None
            or lora.batches != ()
            or tables.variants.in_step(lora)
        ):
            y = self.linear(x, weight, bias)
            self._lora(ops, y, x, layer, group, slab, tables, lora, h, bias)
            return y
        a, b, scale = tables.group_views(layer, group, GROUP_MODULES[group])
        page_table, starts = tables.page_table, self.out_starts[group]
        delta = side.start(
            x.shape[0],
            self.out_widths[group],
            lambda out: group_op(out, h, x, slab, page_table, lora, *a, *b, scale, starts, threads=1),
        )
        y = self.linear(x, weight, bias)
        side.finish()
        return y.add_(delta)

    def _lora(
        self,
        ops: KernelOps,
        y: Tensor,
        x: Tensor,
        layer: int,
        group: int,
        slab: Tensor,
        tables: LoraTables,
        lora: LoraIndices,
        h: Tensor,
        bias: Tensor | None = None,
    ) -> None:
        a, b, scale = tables.group_views(layer, group, GROUP_MODULES[group])
        comm = self.comm
        if comm is None:
            if ops.lora_group is not None:  # the two in one op (the C kernels: one call)
                ops.lora_group(y, h, x, slab, tables.page_table, lora, *a, *b, scale, self.out_starts[group])
            else:
                ops.lora_shrink(h, x, slab, tables.page_table, lora, *a)
                ops.lora_expand(y, h, slab, tables.page_table, lora, *b, scale, self.out_starts[group])
        else:  # under TP a collective sits between the shrink and the expand
            ops.lora_shrink(h, x, slab, tables.page_table, lora, *a)
            out = y
            if group in ROW_GROUPS:
                # A split by input columns: a partial shrink, summed; B split by output rows: this
                # rank's expand lands in its columns, and the base's all-reduce adds the rest.
                comm.all_reduce(h)
                out = y.new_zeros(y.shape[0], y.shape[1] // comm.world)
            else:  # A split by rank rows: each rank's share of h, gathered
                gather_shrink(h, comm, a[1][lora.token_slot.long()])
            ops.lora_expand(out, h, slab, tables.page_table, lora, *b, scale, self.out_starts[group])
            if out is not y:
                y[:, comm.rank * out.shape[1] : (comm.rank + 1) * out.shape[1]] += out
        if tables.variants.in_step(lora):  # DoRA / lora_bias rows (lora_variants.py)
            apply_vectors(y, bias, slab, tables.page_table, lora.token_slot, tables.variants, group)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionMetadata,
        pool: Tensor,
        adapter_pool: Tensor,
        block_size: int,
        ops: KernelOps,
        tables: LoraTables,
        lora: LoraIndices | None,
        lora_h: Tensor,
    ) -> Tensor:
        """Hidden states [T, hidden] after the final norm for this step's tokens.

        ``pool`` is the page storage in KV's dtype [num_layers, num_pages, kv_page_size]; ``adapter_pool``
        the same memory in the adapters' dtype (``pool`` itself when they match); ``lora_h`` a scratch buffer
        [>= T, >= max group rank] for the shrink output.
        """
        c = self.config
        T = input_ids.shape[0]
        x = self.embed_tokens(input_ids)
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        q_size, kv_size = c.q_size, c.kv_size
        h = lora_h[:T]
        if lora is not None and not lora.segments:
            lora = None  # no row has an adapter
        experts_lora = expert_lora(ops, tables, lora, h) if self.moe_layers and lora is not None else None
        if lora is not None and tables.variants.in_step(lora):  # embedding LoRA rows (lora_variants.py)
            add_embedding_lora(x, input_ids, adapter_pool, tables.page_table, lora, tables.variants, h, ops)
        eps = c.rms_norm_eps
        pending: Tensor | None = None  # the last layer's MLP output, added to x by the next norm
        for i, w in enumerate(self.layers):
            slab, lora_slab = pool[i], adapter_pool[i]
            kv = slab.view(slab.shape[0], 2, block_size, c.num_kv_heads, c.head_dim)
            # ops.rms_norm adds the residual first (the CPU backend: one C call, in place on x).
            x, hs = ops.rms_norm(x, pending, w["in_norm"], eps)
            # self.linear (F.linear, or oneDNN's over packed weights), not ``hs @ w.t()``: on a CPU
            # the transposed-view matmul ran on one thread whatever the intra-op threads.
            qkv = self._project(ops, hs, w["qkv"], w.get("qkv_bias"), i, 0, lora_slab, tables, lora, h)
            # q's and k's heads sit side by side in qkv: one rotation over both (half the small ops).
            heads = c.num_heads + c.num_kv_heads
            if "q_norm" in w:  # a MoE family's q/k norms (moe.norm_qk: per head, or OLMoE's whole projection)
                qk = norm_qk(qkv, w["q_norm"], w["k_norm"], c, self._rms_norm)
            else:
                qk = qkv[:, : q_size + kv_size].view(T, heads, c.head_dim)
            if "qk_norm" in w:  # Qwen3: each head normalised before its rotation
                qk = self._rms_norm(qk, w["qk_norm"])
            qk = ops.rope(qk, cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, q_size + kv_size :].view(T, c.num_kv_heads, c.head_dim)
            ops.write_kv(kv, k, v, attn.slot_mapping)
            attn_out = self._paged_attention(ops, q, kv, attn, c.window(i))
            o = self._project(ops, attn_out, w["o"], None, i, 1, lora_slab, tables, lora, h)
            if self.comm is not None:
                self.comm.all_reduce(o)
            x, hs = ops.rms_norm(x, o, w["post_norm"], eps)
            if self.moe_layers:
                pending = self.moe_layers[i].forward(hs, self.linear, experts_lora, i, lora_slab, self.comm)
                continue
            gu = self._project(ops, hs, w["gate_up"], None, i, 2, lora_slab, tables, lora, h)
            act = ops.silu_mul(gu, c.intermediate_size)
            pending = self._project(ops, act, w["down"], None, i, 3, lora_slab, tables, lora, h)
            if self.comm is not None:
                self.comm.all_reduce(pending)
        return ops.rms_norm(x, pending, self.final_norm, eps)[1]

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The embedding rows of ``input_ids`` (under tensor parallelism each rank holds a share of
        the vocabulary: looked up where it lies and all-reduced)."""
        if self.comm is None:
            return torch.index_select(self.embed, 0, input_ids)  # a third of ``embed[input_ids]``'s time
        return vocab_embed(self.embed, input_ids, self.comm)

    def head(self, hidden: Tensor) -> Tensor:
        """lm_head's logits [N, vocab] in the model's dtype (under tensor parallelism: each rank's
        vocabulary share gathered, whole on rank 0 only)."""
        out = self.linear(hidden, self.lm_head)
        return out if self.comm is None else vocab_logits(out, self.comm, self.config.vocab_size)

    def logits(self, hidden: Tensor) -> Tensor:
        """float32 logits [N, vocab] for the given final hidden states."""
        return self.head(hidden).float()


def lora_h_width(config: ModelConfig, max_rank: int) -> int:
    """Widest shrink output: a group's modules all at ``max_rank``."""
    return max(len(g) for g in GROUPS) * max_rank


__all__ = ["LlamaModel", "AttentionMetadata", "lora_h_width", "MODULES"]
