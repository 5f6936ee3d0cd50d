"""Reading a Hugging Face checkpoint: safetensors (single file or sharded index) and its digest."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

DIGEST_CACHE = Path(os.environ.get("LORAPAGE_CACHE", Path.home() / ".cache" / "lorapage")) / "digests.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, in a stable order."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return found


def load_state_dict(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, converted to ``dtype`` on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key).to(dtype)
    return out


def model_digest(model_dir: str | Path) -> str:
    """sha256 over the weight files' bytes, in order; cached by (path, size, mtime)."""
    files = weight_files(model_dir)
    key = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    try:
        cache = json.loads(DIGEST_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    digest = h.hexdigest()
    cache[key] = digest
    try:
        DIGEST_CACHE.parent.mkdir(parents=True, exist_ok=True)
        DIGEST_CACHE.write_text(json.dumps(cache))
    except OSError:
        pass  # a read-only home only costs a re-hash next time
    return digest
