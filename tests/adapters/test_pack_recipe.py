"""A load packs a weights file whose header an earlier load saw by that load's recipe (byte runs of
the file, lorapage.adapters.pack_recipe): the same bytes as the full parse and pack, and the same
refusals. Real PEFT files of the tiny model's demo adapters, rewritten with other values."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorapage import Engine, EngineConfig
from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.loader import AdapterLoader, Origin
from lorapage.adapters.pack_recipe import PackRecipe, PackRecipes, header_bytes
from lorapage.adapters.peft_format import AdapterSpec, load_adapter_tensors, read_adapter_spec
from lorapage.errors import AdapterFormatError
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

WEIGHTS = "adapter_model.safetensors"


@dataclass
class Version:
    """What a read needs of a version (loader.Readable)."""

    name: str
    spec: AdapterSpec
    layout: AdapterLayout
    digest: str = ""
    origin: Origin = Origin()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(TINY_BASE_DIR), max_loras=2, max_lora_rank=64, block_size=4))


@pytest.fixture
def loader(engine: Engine) -> AdapterLoader:
    loader = engine.debug.adapters.checks.loader
    loader.recipes = PackRecipes()
    return loader


def _copy(tmp_path: Path, name: str, seed: int, dtype: torch.dtype | None = None, poison: str | None = None) -> Path:
    """acme's directory with other values (seeded), the same names, shapes and header; ``dtype``
    stores them in another dtype; ``poison`` sets one value of that weight to NaN."""
    src = demo_adapter_dirs()["acme"]
    path = shutil.copytree(src, tmp_path / name)
    weights = load_file(src / WEIGHTS)
    gen = torch.Generator().manual_seed(seed)
    out = {k: (torch.randn(v.shape, generator=gen) * 0.1).to(dtype or v.dtype) for k, v in weights.items()}
    if poison is not None:
        out[poison].view(-1)[3] = float("nan")
    save_file(out, path / WEIGHTS, metadata={"format": "pt"})
    return path


def _version(loader: AdapterLoader, engine: Engine, path: Path) -> Version:
    model = engine.debug.adapters.checks.model
    spec = read_adapter_spec(str(path), model, 64)
    return Version(path.name, spec, AdapterLayout.plan(spec, model, loader.pool.adapter_page_size))


def _full_pack(loader: AdapterLoader, version: Version) -> torch.Tensor:
    tensors = load_adapter_tensors(version.spec, loader.dtype)
    return version.layout.pack(tensors, loader.pool.adapter_page_size)


def test_files_with_one_header_pack_by_the_first_ones_recipe_to_the_full_packs_bytes(loader, engine, tmp_path):
    paths = [_copy(tmp_path, f"a{i}", seed=i) for i in range(3)]
    headers = {header_bytes(torch.frombuffer(bytearray((p / WEIGHTS).read_bytes()), dtype=torch.uint8)) for p in paths}
    assert len(headers) == 1  # one configuration, one header: the values differ
    for i, path in enumerate(paths):
        version = _version(loader, engine, path)
        packed = loader._read_and_pack(version, version.spec)
        assert loader.recipes.hits == i  # the first load recorded the recipe, the others used it
        assert torch.equal(packed, _full_pack(loader, version))
        assert packed.dtype == loader.dtype and packed.shape[0] == len(version.layout.rank)


def test_a_value_that_is_not_finite_is_refused_by_name_under_a_recipe(loader, engine, tmp_path):
    first = _version(loader, engine, _copy(tmp_path, "ok", seed=1))
    loader._read_and_pack(first, first.spec)
    key = next(k for k in load_file(first.spec.weights_file) if "lora_B" in k)
    bad = _version(loader, engine, _copy(tmp_path, "bad", seed=2, poison=key))
    with pytest.raises(AdapterFormatError, match="NaN or Inf") as err:
        loader._read_and_pack(bad, bad.spec)
    assert key in str(err.value)
    assert loader.recipes.hits == 1  # the recipe packed it; the full path named the weight


def test_a_file_in_another_dtype_is_converted_by_the_full_path_every_time(loader, engine, tmp_path):
    half = [_version(loader, engine, _copy(tmp_path, f"h{i}", seed=i, dtype=torch.bfloat16)) for i in range(2)]
    for version in half:
        packed = loader._read_and_pack(version, version.spec)
        assert torch.equal(packed, _full_pack(loader, version))
    assert loader.recipes.hits == 0  # a converted weight is no byte run of the file


def test_a_recipe_serves_only_the_layout_it_was_recorded_for(loader, engine, tmp_path):
    version = _version(loader, engine, _copy(tmp_path, "a", seed=1))
    raw = torch.frombuffer(bytearray(version.spec.weights_file.read_bytes()), dtype=torch.uint8)
    tensors = load_adapter_tensors(version.spec, loader.dtype, raw)
    page = loader.pool.adapter_page_size
    recipe = PackRecipe.record(version.layout, version.layout.pieces(tensors, page), raw)
    assert recipe is not None
    assert torch.equal(recipe.pack(raw, loader.dtype), version.layout.pack(tensors, page))
    recipes = PackRecipes()
    header = header_bytes(raw)
    assert header is not None
    recipes.put(header, recipe)
    other_pages = AdapterLayout.plan(version.spec, engine.debug.adapters.checks.model, page * 2)
    assert recipes.get(header, other_pages, raw.numel()) is None
    assert recipes.get(header, version.layout, raw.numel() + 4) is None  # a file of another size
    assert recipes.get(header, version.layout, raw.numel()) is recipe
    converted = {k: (a.double().float(), b) for k, (a, b) in tensors.items()}  # copies, not views
    assert PackRecipe.record(version.layout, version.layout.pieces(converted, page), raw) is None


def test_the_recipes_kept_are_the_most_recent(loader):
    recipes = PackRecipes(capacity=2)
    for header in (b"a", b"b", b"c"):
        recipes.put(header, None)
    assert not recipes.known(b"a") and recipes.known(b"b") and recipes.known(b"c")
