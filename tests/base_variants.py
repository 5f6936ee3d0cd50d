"""Bases that differ from the tiny one by a chosen amount: the two-bases tests' checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lorapage.tiny import TINY_BASE_DIR


def variant(out: Path, change) -> Path:
    """The tiny base with each weight matrix ``w`` replaced by ``change(w, generator)``."""
    shutil.copytree(TINY_BASE_DIR, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    save_file({k: change(w, gen) if w.dim() == 2 else w for k, w in weights.items()}, out / "model.safetensors")
    return out


def near_base(out: Path) -> Path:
    """1e-4 relative noise: the same model for every practical purpose (a drift check passes)."""
    return variant(out, lambda w, g: w + torch.randn(w.shape, generator=g) * w.std() * 1e-4)


def far_base(out: Path) -> Path:
    """Every matrix re-drawn: another model (a drift check fails)."""
    return variant(out, lambda w, g: torch.randn(w.shape, generator=g) * w.std())
