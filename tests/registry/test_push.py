"""Versions pushed from memory (``engine.admin.push``): checked as a directory is, stored as the
next immutable version, staged in the pool before they are current; running requests keep their
version; a staleness bound refuses old versions (409) and retires those no request holds (their
pages, host copy and files freed, their registry rows kept)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from engine_util import tiny_engine
from safetensors.torch import load_file

from lorapage import SamplingParams
from lorapage.errors import AdapterFormatError, AdapterVersionStaleError, InvalidRequestError
from lorapage.registry.push import encode
from lorapage.tiny import demo_adapter_dirs

ACME = demo_adapter_dirs()["acme"]


def policy(step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The acme demo adapter's tensors moved by a step-dependent amount, and its config."""
    tensors = load_file(str(ACME / "adapter_model.safetensors"))
    config = json.loads((ACME / "adapter_config.json").read_text())
    g = torch.Generator().manual_seed(step)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}, config


GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


async def test_push_stores_the_next_version_and_makes_it_current():
    engine = tiny_engine()
    try:
        first = await engine.admin.push("policy", *policy(1))
        assert (first.key, first.current) == ("policy@1", True)
        second = await engine.admin.push("policy", *policy(2))
        assert (second.key, second.current) == ("policy@2", True)
        assert engine.admin.catalog.resolve_version("policy") == "policy@2"
        assert engine.admin.info("policy@2").tier == "gpu"  # staged before it was made current
        again = await engine.admin.push("policy", *policy(2))  # the same content: the same version
        assert again.key == "policy@2"
        as_bytes = await engine.admin.push("policy", encode(*policy(3)))  # the config in the metadata
        assert as_bytes.key == "policy@3"
        infos = engine.admin.catalog.versions("policy")
        assert [v.version for v in infos] == [1, 2, 3] and len({v.digest for v in infos}) == 3
        out = [o async for o in engine.generate([5, 9, 17], "policy@1", GREEDY)][-1]
        assert len(out.token_ids) == 4
    finally:
        await engine.close()


async def test_a_push_is_checked_as_a_directory_is():
    engine = tiny_engine()
    try:
        tensors, config = policy(1)
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        with pytest.raises(AdapterFormatError):
            await engine.admin.push("bad", {**tensors, key: tensors[key][:, :3]}, config)
        with pytest.raises(AdapterFormatError):
            await engine.admin.push("bad", {**tensors, key: torch.full_like(tensors[key], float("nan"))}, config)
        with pytest.raises(InvalidRequestError):
            await engine.admin.push("bad", b"not safetensors")
        with pytest.raises(InvalidRequestError):
            await engine.admin.push("bad@2", tensors, config)
        assert "bad" not in engine.admin.catalog.index.ids()
    finally:
        await engine.close()


async def test_running_requests_keep_their_version_while_pushes_land():
    engine = tiny_engine()
    try:
        await engine.admin.push("policy", *policy(1))
        long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        alone = [o async for o in engine.generate([5, 9, 17], "policy@1", long)][-1].token_ids
        stream = engine.generate([5, 9, 17], "policy", long)  # resolved to policy@1 when submitted
        first = await anext(stream)
        await engine.admin.push("policy", *policy(2))
        rest = [o async for o in stream]
        assert (rest[-1] if rest else first).token_ids == alone
        assert engine.admin.catalog.resolve_version("policy") == "policy@2"
    finally:
        await engine.close()


async def test_staleness_refuses_old_versions_and_retires_them():
    engine = tiny_engine()
    cache = engine.debug.adapters
    try:
        for step in range(1, 4):
            await engine.admin.push("policy", *policy(step), max_staleness=1)
        free_after_three = engine.debug.pool.num_free
        for step in range(4, 12):
            await engine.admin.push("policy", *policy(step))
        assert engine.debug.pool.num_free == free_after_three  # flat: old versions freed
        assert set(k for k in cache.entries if k.startswith("policy@")) == {"policy@10", "policy@11"}
        with pytest.raises(AdapterVersionStaleError) as err:
            engine.admin.catalog.resolve_version("policy@9")
        assert err.value.status == 409
        with pytest.raises(AdapterVersionStaleError):
            await anext(engine.generate([5, 9], "policy@3", GREEDY))
        assert engine.admin.catalog.resolve_version("policy@10") == "policy@10"
        rows = engine.admin.catalog.versions("policy")
        assert [v.version for v in rows] == list(range(1, 12))  # the registry keeps every version's row
        assert all(v.digest for v in rows)
        root = engine.admin.pusher.root / "policy"
        await asyncio.sleep(0.2)  # file deletion runs on the I/O thread
        assert len([p for p in root.iterdir() if not p.name.startswith(".")]) == 2
    finally:
        await engine.close()


async def test_a_version_in_use_is_retired_once_free():
    engine = tiny_engine()
    try:
        await engine.admin.push("policy", *policy(1), max_staleness=0)
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        stream = engine.generate([5, 9, 17], "policy@1", long)
        await anext(stream)
        await engine.admin.push("policy", *policy(2))
        assert "policy@1" in engine.debug.adapters.entries  # a running request holds it
        out = [o async for o in stream][-1]
        assert len(out.token_ids) == 40
        await engine.admin.push("policy", *policy(3))
        assert "policy@1" not in engine.debug.adapters.entries
    finally:
        await engine.close()


async def test_concurrent_pushes_land_in_order_and_ids_are_checked():
    engine = tiny_engine()
    try:
        infos = await asyncio.gather(*(engine.admin.push("policy", *policy(s)) for s in range(1, 5)))
        assert sorted(i.version for i in infos) == [1, 2, 3, 4]
        assert engine.admin.catalog.resolve_version("policy") == "policy@4"
        with pytest.raises(InvalidRequestError):
            await engine.admin.push("../escape", *policy(9))
    finally:
        await engine.close()


async def test_pushed_versions_survive_a_restart_and_retired_ones_stay_retired(tmp_path):
    engine = tiny_engine(state_dir=str(tmp_path))
    try:
        for step in (1, 2, 3):
            await engine.admin.push("policy", *policy(step), max_staleness=0)
        await asyncio.sleep(0.2)  # file deletion runs on the I/O thread
    finally:
        await engine.close()
    assert (tmp_path / "pushed" / "policy").is_dir()
    engine = tiny_engine(state_dir=str(tmp_path))
    try:
        assert [v.version for v in engine.admin.catalog.versions("policy")] == [1, 2, 3]
        out = [o async for o in engine.generate([5, 9, 17], "policy", GREEDY)][-1]
        assert len(out.token_ids) == 4
        with pytest.raises(AdapterVersionStaleError):
            engine.admin.catalog.resolve_version("policy@1")
    finally:
        await engine.close()


async def test_a_staleness_bound_outlives_a_restart(tmp_path):
    engine = tiny_engine(state_dir=str(tmp_path))
    try:
        for step in (1, 2, 3):
            await engine.admin.push("policy", *policy(step), max_staleness=2)
        assert engine.admin.catalog.resolve_version("policy@1") == "policy@1"  # 3 - 2: still served
    finally:
        await engine.close()
    engine = tiny_engine(state_dir=str(tmp_path))
    try:
        assert engine.admin.pusher.staleness == {"policy": 2}
        await engine.admin.push("policy", *policy(4))  # no bound given: the kept one applies
        with pytest.raises(AdapterVersionStaleError):
            engine.admin.catalog.resolve_version("policy@1")
        assert engine.admin.catalog.resolve_version("policy@2") == "policy@2"
        await engine.admin.push("policy", *policy(5), max_staleness=None)
        assert engine.admin.pusher.staleness == {"policy": 2}  # None leaves a kept bound as it is
    finally:
        await engine.close()
