"""Gemma 2 and Gemma 3 (text) decoder over the unified page pool, as transformers defines them.

What differs from :class:`~lorapage.model.llama.LlamaModel`, whose weights, LoRA groups, rope
rotation and paged attention it reuses:

- RMSNorm scales by ``1 + w``, the product taken in float32 before rounding to the model's dtype;
- four norms a layer: input, post-attention (on the attention's output), pre- and post-feed-forward;
- GeGLU (gelu, tanh-approximated) instead of SwiGLU;
- embeddings scaled by sqrt(hidden), the factor rounded to the model's dtype first (an embedding
  LoRA's delta too, as PEFT scales it);
- attention scaled by ``query_pre_attn_scalar ** -0.5``; Gemma 2's scores soft-capped;
- sliding-window layers (Gemma 2: every other; Gemma 3: five of six), which in Gemma 3 rotate with
  their own rope base (``rope_local_base_freq``), global layers with ``rope_theta`` and its scaling;
- Gemma 3: an RMSNorm over each query and key head before rope;
- the logits soft-capped (``final_logit_softcapping``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from lorapage.kernels import LoraIndices
from lorapage.kernels.backend import KernelOps
from lorapage.kernels.step_ref import rope_ref
from lorapage.model.config import ModelConfig
from lorapage.model.gemma_config import GemmaConfig
from lorapage.model.llama import AttentionMetadata, LlamaModel
from lorapage.model.lora_tables import LoraTables
from lorapage.model.lora_variants import add_embedding_lora
from lorapage.model.rope import rope_tables


def _scale(weight: Tensor) -> Tensor:
    """A Gemma RMSNorm's factor ``1 + w`` in float32, as its forward computes it every call."""
    return 1.0 + weight.float()


def _norm(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """HF's Gemma RMSNorm: normalized in float32, times ``1 + w`` in float32, then rounded once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


class GemmaModel(LlamaModel):
    """Gemma 2 / Gemma 3 text weights and forward pass; same interface as :class:`LlamaModel`."""

    def __init__(
        self, config: ModelConfig, state: dict[str, Tensor], device: torch.device, dtype: torch.dtype, max_len: int
    ) -> None:
        assert config.gemma is not None, "GemmaModel runs a Gemma config"
        super().__init__(config, state, device, dtype, max_len)
        g: GemmaConfig = config.gemma
        self.gemma = g
        get = lambda k: _scale(state.pop(k).to(device=device, dtype=dtype))  # noqa: E731
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer["in_norm"] = _scale(layer["in_norm"])
            layer["post_attn_norm"] = _scale(layer.pop("post_norm"))
            layer["pre_ffn_norm"] = get(p + "pre_feedforward_layernorm.weight")
            layer["post_ffn_norm"] = get(p + "post_feedforward_layernorm.weight")
            if g.qk_norm:
                layer["q_norm"] = get(p + "self_attn.q_norm.weight")
                layer["k_norm"] = get(p + "self_attn.k_norm.weight")
        self.final_norm = _scale(self.final_norm)
        # HF keeps sqrt(hidden) as a float32 buffer and rounds it to the weights' dtype per call.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(device, dtype)
        self.scale = g.query_pre_attn_scalar**-0.5
        # The sliding-window layers' rope (Gemma 3's local base, unscaled); the inherited caches
        # are the global layers' (rope_theta with its scaling).
        local = dataclasses.replace(config, rope_theta=g.local_rope_theta, rope_scaling=None)
        cos, sin = rope_tables(local, max_len)
        self.local_cos, self.local_sin = cos.to(device, dtype), sin.to(device, dtype)

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
        """Hidden states [T, hidden] after the final norm, as :meth:`LlamaModel.forward`."""
        c, g = self.config, self.gemma
        eps, T = c.rms_norm_eps, input_ids.shape[0]
        x = self.embed_tokens(input_ids) * self.embed_scale
        rope = {
            None: (self.cos_cache[positions], self.sin_cache[positions]),  # global layers
            "local": (self.local_cos[positions], self.local_sin[positions]),
        }
        h = lora_h[:T]
        if lora is not None and not lora.segments:
            lora = None  # no row has an adapter
        if lora is not None and tables.variants.in_step(lora):
            # transformers' scaled embedding module (Gemma 2 and 3 alike) multiplies its output by
            # sqrt(hidden) in the model's dtype; PEFT's embedding LoRA wraps that module and scales
            # its delta by the same factor: E[id] * s + delta * s.
            add_embedding_lora(x, input_ids, adapter_pool, tables.page_table, lora, tables.variants, h, ops,
                               self.embed_scale)  # fmt: skip
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        for i, w in enumerate(self.layers):
            slab, lora_slab = pool[i], adapter_pool[i]
            kv = slab.view(slab.shape[0], 2, block_size, kv_heads, dim)
            window = c.window(i)
            hs = _norm(x, w["in_norm"], eps)
            qkv = self.linear(hs, w["qkv"])
            if lora is not None:
                self._lora(ops, qkv, hs, i, 0, lora_slab, tables, lora, h)
            q = qkv[:, : c.q_size].view(T, heads, dim)
            k = qkv[:, c.q_size : c.q_size + c.kv_size].view(T, kv_heads, dim)
            v = qkv[:, c.q_size + c.kv_size :].view(T, kv_heads, dim)
            if g.qk_norm:
                q, k = _norm(q, w["q_norm"], eps), _norm(k, w["k_norm"], eps)
            cos, sin = rope["local" if window is not None else None]
            q, k = rope_ref(q, cos, sin), rope_ref(k, cos, sin)
            ops.write_kv(kv, k, v, attn.slot_mapping)
            attn_out = self._paged_attention(ops, q, kv, attn, window, g.attn_logit_softcapping)
            o = self.linear(attn_out, w["o"])
            if lora is not None:
                self._lora(ops, o, attn_out, i, 1, lora_slab, tables, lora, h)
            if self.comm is not None:  # the partial sums whole before the post-attention norm
                self.comm.all_reduce(o)
            x = x + _norm(o, w["post_attn_norm"], eps)
            hs = _norm(x, w["pre_ffn_norm"], eps)
            gu = self.linear(hs, w["gate_up"])
            if lora is not None:
                self._lora(ops, gu, hs, i, 2, lora_slab, tables, lora, h)
            inter = c.intermediate_size
            act = F.gelu(gu[:, :inter], approximate="tanh" if g.tanh_gelu else "none") * gu[:, inter:]
            d = self.linear(act, w["down"])
            if lora is not None:
                self._lora(ops, d, act, i, 3, lora_slab, tables, lora, h)
            if self.comm is not None:
                self.comm.all_reduce(d)
            x = x + _norm(d, w["post_ffn_norm"], eps)
        return _norm(x, self.final_norm, eps)

    def logits(self, hidden: Tensor) -> Tensor:
        """float32 logits [N, vocab], soft-capped as HF caps them (in the model's dtype)."""
        logits = self.head(hidden)  # whole (under tensor parallelism, gathered) before the cap
        cap = self.gemma.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
