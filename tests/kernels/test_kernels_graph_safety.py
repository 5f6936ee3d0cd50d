"""The captured decode step launches the same kernels whatever the adapters: checked on CPU.

A CUDA graph freezes every launch it captured: kernel, grid, scalar arguments and pointers. So
one graph per batch bucket can serve any mix of adapters only if nothing about those launches
depends on which adapters are resident, which slots and pages they occupy, or which rows use
them. All of that must reach the kernels as data in buffers that are allocated once. This test
runs the step a graph captures (``decode_forward``, Triton kernels under the interpreter) twice:
once with one set of adapters, rows, positions and KV pages, and once after evicting and
reloading adapters into other slots and pages and writing different rows. It records every
launch (grid, scalars, and for each tensor either which static buffer and offset it points into,
or its shape and strides for the step's own intermediates) and requires the two records to match
exactly. The GPU test ``test_graph_replay_matches_eager_across_adapter_swaps`` replays real
graphs; this is the part of that guarantee a machine without CUDA can check.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_util import tiny_engine

from lorapage import SamplingParams
from lorapage.kernels.triton_import import triton_available
from lorapage.memory.pages import PageKind
from lorapage.model.forward import decode_forward

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from lorapage.kernels import attention_triton, lora_triton  # noqa: E402

KERNELS = {
    lora_triton: ("_bgmv_shrink_kernel", "_bgmv_expand_kernel", "_sgmv_shrink_kernel", "_sgmv_expand_kernel"),
    attention_triton: ("_write_kv_kernel", "_paged_decode_kernel", "_paged_prefill_kernel"),
}
ROWS = 4


class Recording:
    """Stands in for a kernel: records each launch, then launches the real kernel."""

    def __init__(self, fn, log: list, describe) -> None:
        self.fn, self.log, self.describe = fn, log, describe

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(
                (
                    self.fn.__name__,
                    tuple(grid),
                    tuple(map(self.describe, args)),
                    tuple(sorted((k, self.describe(v)) for k, v in kwargs.items())),
                )
            )
            return self.fn[grid](*args, **kwargs)

        return launch


def static_buffers(engine) -> dict[int, str]:
    """Storage address -> name of every buffer a captured graph may read or write."""
    r, t = engine.debug.runner.buffers, engine.debug.tables
    named = dict(
        input_ids=r.input_ids,
        positions=r.positions,
        slot_mapping=r.slot_mapping,
        token_slot=r.token_slot,
        block_tables=r.block_tables,
        context_lens=r.context_lens,
        lora_h=r.lora_h,
        pool=engine.debug.pool.storage,
        page_table=t.page_table,
        a_offset=t.a_offset,
        a_rows=t.a_rows,
        b_offset=t.b_offset,
        rank=t.rank,
        h_start=t.h_start,
        scale=t.scale,
        # The PEFT variants' per-slot tables (DoRA / lora_bias rows, embedding LoRA).
        vector_page=t.variants.vector_page,
        emb_offset=t.variants.emb_offset,
        emb_b_offset=t.variants.emb_b_offset,
        emb_rank=t.variants.emb_rank,
        emb_h_start=t.variants.emb_h_start,
        emb_scale=t.variants.emb_scale,
    )
    return {tensor.untyped_storage().data_ptr(): name for name, tensor in named.items()}


def write_rows(engine, slots: list[int], positions: list[int], kv_pages: list[int], tokens: list[int]) -> None:
    """Decode rows into the runner's static buffers, as ``ModelRunner`` writes them before a replay."""
    r, bs = engine.debug.runner.buffers, engine.config.block_size
    per_row = len(kv_pages) // ROWS
    for i, (slot, pos, token) in enumerate(zip(slots, positions, tokens)):
        pages = kv_pages[i * per_row : (i + 1) * per_row]
        r.input_ids[i], r.positions[i], r.token_slot[i] = token, pos, slot
        r.slot_mapping[i] = pages[pos // bs] * bs + pos % bs
        r.block_tables[i].zero_()
        r.block_tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        r.context_lens[i] = pos + 1


def test_decode_step_launches_do_not_depend_on_adapters_slots_or_pages():
    # Synchronous on purpose: the device image that runs the kernel tests has no pytest-asyncio.
    asyncio.run(_check_launches())


async def _check_launches() -> None:
    engine = tiny_engine(kernel_backend="triton", max_num_seqs=ROWS, max_loras=3, enforce_eager=True)
    statics = static_buffers(engine)

    def describe(value):
        if isinstance(value, torch.Tensor):
            name = statics.get(value.untyped_storage().data_ptr())
            where = (name, value.storage_offset()) if name else ("step intermediate",)
            return (*where, tuple(value.shape), value.stride(), value.dtype)
        return value

    log: list = []
    originals = {(module, name): getattr(module, name) for module, names in KERNELS.items() for name in names}
    for (module, name), fn in originals.items():
        setattr(module, name, Recording(fn, log, describe))
    try:
        await engine.admin.load("acme")
        await engine.admin.load("globex")
        slot = {n: engine.debug.residency.get(f"{n}@1").slot for n in ("acme", "globex")}
        acme_before = (slot["acme"], list(engine.debug.residency.get("acme@1").page_ids))
        kv = engine.debug.pool.allocate(2 * ROWS, PageKind.KV)
        write_rows(engine, [slot["acme"], slot["globex"], 0, slot["acme"]], [3, 5, 0, 6], kv, [11, 12, 13, 14])
        first_hidden = decode_forward(engine.debug.runner.ctx, ROWS).clone()
        first, log[:] = list(log), []

        # Other adapters, in other slots and pages; other rows, positions and KV pages.
        await engine.admin.unload("acme")
        await engine.admin.unload("globex")
        await engine.admin.load("initech")
        await engine.admin.load("acme")
        moved = {n: engine.debug.residency.get(f"{n}@1").slot for n in ("initech", "acme")}
        assert (moved["acme"], engine.debug.residency.get("acme@1").page_ids) != acme_before, "acme did not move"
        kv2 = engine.debug.pool.allocate(2 * ROWS, PageKind.KV)
        write_rows(engine, [moved["initech"], 0, moved["acme"], moved["acme"]], [7, 2, 4, 1], kv2, [21, 22, 23, 24])
        second_hidden = decode_forward(engine.debug.runner.ctx, ROWS)
        second = list(log)
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
        await engine.close()

    assert first, "the decode step launched no Triton kernel"
    names = {launch[0] for launch in first}
    assert {"_bgmv_shrink_kernel", "_bgmv_expand_kernel", "_write_kv_kernel", "_paged_decode_kernel"} <= names
    host_tables = {"_sgmv_shrink_kernel", "_sgmv_expand_kernel", "_paged_prefill_kernel"}
    assert not names & host_tables, "SGMV and prefill attention read tables built from host lists: not graph-safe"
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert a == b, f"a launch changed with the adapters:\n{a}\n{b}"
    assert not torch.equal(first_hidden, second_hidden), "the data did change: the launches read it from buffers"


REPLAYS: list[int] = []  # bucket size of each replay


def rerun_capture(step):
    """A stand-in for CUDA-graph capture where there is no CUDA: replay reruns the captured step
    on whatever the static buffers hold, into the output tensor captured the first time."""
    out = step()

    def replay() -> None:
        REPLAYS.append(out.shape[0])
        with torch.inference_mode():  # out was made under it, as a graph's output is
            out.copy_(step())

    return replay, out


def test_replayed_decode_steps_match_eager_across_adapter_swaps():
    """The runner's replay path (bucket choice, padding rows, full-width block tables, output
    slicing) gives eager's greedy tokens, before and after adapters move to other slots and
    pages. Three rows replay in the bucket of four, so one padded row rides along."""
    rows = [([5, 6, 7, 8], "acme"), ([9, 10, 11], "globex"), ([12, 13], None)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    eager = tiny_engine(kernel_backend="triton", max_num_seqs=4, enforce_eager=True)
    replayed = tiny_engine(kernel_backend="triton", max_num_seqs=4, enforce_eager=True)
    replayed.debug.runner.capture_decode_graphs(4, capture=rerun_capture)
    assert sorted(replayed.debug.runner.graphs.graphs) == [1, 2, 4]

    async def swap(engine) -> None:
        for name in ("acme", "globex", "initech"):
            await engine.admin.unload(name)
        for name in ("initech", "globex", "acme"):
            await engine.admin.load(name)

    async def preload(engine) -> None:  # every row is then admitted in the first step
        for name in ("acme", "globex"):
            await engine.admin.load(name)

    for engine in (eager, replayed):
        asyncio.run(preload(engine))
    for round_ in range(2):
        REPLAYS.clear()
        want = eager.generate_batch(rows, params)
        got = replayed.generate_batch(rows, params)
        assert REPLAYS == [4] * (params.max_tokens - 1), "every decode step replays in the bucket of four"
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, round_
            assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=1e-5)
        if round_ == 0:
            for engine in (eager, replayed):
                asyncio.run(swap(engine))
