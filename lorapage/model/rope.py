"""Rotary position tables: cos / sin for every position, computed once, as transformers computes them.

Types (``rope_scaling`` / transformers 5's ``rope_parameters``, key ``rope_type`` or ``type``):
``default``, ``linear``, ``llama3``, ``yarn`` (its ``attention_factor`` multiplies cos and sin,
as HF's rotary embedding does), ``dynamic`` and ``longrope`` (Phi-3). A table holds
``rotary_dim = head_dim * partial_rotary_factor`` columns; the rest of a head passes unrotated.

Two types depend, in transformers, on the length of the forward pass rather than the position,
and a paged server cannot follow that (a KV block written at one length is read at another):

- ``dynamic``: HF re-derives the base from the current length once it passes
  ``max_position_embeddings`` and uses the plain table below it. A context within
  ``max_position_embeddings`` gets exactly that plain table (HF's numbers); a longer one gets
  vLLM's fixed table, HF's base taken once at the served length (:func:`dynamic_ntk_base`), at
  every position (HF would rotate a short sequence with the plain table).
- ``longrope``: HF rotates a whole forward with the long factors once it reaches past
  ``original_max_position_embeddings``, and vLLM a whole batch. Here position ``p`` uses the short
  factors below ``original_max_position_embeddings`` and the long ones from it on, so a row's
  rotation never depends on its batch: what HF's cached ``generate`` does to a prompt within the
  original length decoding on past it (only a prefill that crosses it differs).
"""

from __future__ import annotations

import math

import torch

from lorapage.model.config import ROPE_TYPES, ModelConfig


def rope_type(config: ModelConfig) -> str:
    """The configured rope type (``default`` when none), refused unless lorapage computes it."""
    s = config.rope_scaling or {}
    kind = s.get("rope_type", s.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; lorapage computes {', '.join(ROPE_TYPES)}")
    return kind


def rotary_dim(config: ModelConfig) -> int:
    """Columns of a head that rotate (HF: ``int(head_dim * partial_rotary_factor)``)."""
    return int(config.head_dim * config.partial_rotary_factor)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _original_len(config: ModelConfig) -> int:
    return (config.rope_scaling or {}).get("original_max_position_embeddings") or config.max_position_embeddings


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * log(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """HF's ``_compute_yarn_parameters``: (inv_freq, attention_factor)."""
    s, base = config.rope_scaling or {}, config.rope_theta
    original = _original_len(config)
    factor = s.get("factor") or config.max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all else None
        attention = float(attention) if attention is not None else yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


def dynamic_ntk_base(base: float, factor: float, dim: int, served: int, trained: int) -> float:
    """The fixed dynamic-NTK base for a server of ``served`` positions on a model trained on
    ``trained`` (``max_position_embeddings``): HF's formula taken once at the longest sequence served,
    ``base * (factor * served / trained - (factor - 1)) ** (dim / (dim - 2))``, as vLLM's
    ``DynamicNTKScalingRotaryEmbedding`` computes it (vllm#41277); the plain base when ``served <=
    trained`` (vllm#52675: truncation, not extension; HF's own table there)."""
    if served <= trained:
        return base
    return base * (factor * served / trained - (factor - 1)) ** (dim / (dim - 2))


def _longrope_attention(config: ModelConfig) -> float:
    s = config.rope_scaling or {}
    original = _original_len(config)
    factor = s.get("factor") or config.max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is not None:
        return float(attention)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inv_freq(config: ModelConfig, max_len: int) -> torch.Tensor:
    """float32 inverse frequencies [rotary_dim / 2] for a table of ``max_len`` positions, computed
    as HF computes them (so positions match bit for bit). Not for ``longrope`` (two sets)."""
    kind, s, dim = rope_type(config), config.rope_scaling or {}, rotary_dim(config)
    inv = _base_inv_freq(config.rope_theta, dim)
    if kind == "llama3":
        return _llama3(inv, s)
    if kind == "linear":
        return inv / s["factor"]
    if kind == "yarn":
        return _yarn(config, dim)[0]
    if kind == "dynamic":
        trained = config.max_position_embeddings
        return _base_inv_freq(dynamic_ntk_base(config.rope_theta, s["factor"], dim, max_len, trained), dim)
    return inv


def rope_tables(config: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin), each [max_len, rotary_dim]: row ``p`` rotates position ``p``."""
    kind = rope_type(config)
    positions = torch.arange(max_len, dtype=torch.float32)[:, None]
    attention = 1.0
    if kind == "longrope":
        s, dim = config.rope_scaling or {}, rotary_dim(config)
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short, long = (
            1.0 / (torch.tensor(s[k], dtype=torch.float32) * config.rope_theta**shape)
            for k in ("short_factor", "long_factor")
        )
        freqs = torch.where(positions < _original_len(config), positions * short[None, :], positions * long[None, :])
        attention = _longrope_attention(config)
    else:
        freqs = positions * inv_freq(config, max_len)[None, :]
        if kind == "yarn":
            attention = _yarn(config, rotary_dim(config))[1]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention
