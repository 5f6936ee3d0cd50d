"""The kernels over adapters placed by the real layout code, against dense LoRA math.

Adapters are planned with ``AdapterLayout``, packed, copied into pool pages (some in one run,
some scattered) and registered in ``LoraTables``; each projection group's shrink + expand is
called exactly as the model calls it and compared with ``y + scale * x @ A.T @ B.T`` per module.
The ``gpu`` cases repeat this at Llama-2-7B sizes and check CUDA-graph replay after adapters
are swapped in the same pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.kernels import LoraIndices, lora_expand_ref, lora_shrink_ref
from lorapage.kernels.triton_import import triton_available
from lorapage.model.config import GROUPS, MODULES, ModelConfig
from lorapage.model.lora_tables import LoraTables

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from lorapage.kernels.attention_triton import paged_decode_attention, write_kv  # noqa: E402
from lorapage.kernels.lora_triton import lora_expand, lora_shrink  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_config(hidden: int, inter: int, heads: int, kv_heads: int, layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def group_slices(model: ModelConfig) -> list[tuple[int, int, tuple[int, ...], int]]:
    """Per group: (first module index, end module index, out_start, d_in)."""
    dims = model.module_dims()
    out = []
    for group in GROUPS:
        starts, col = [], 0
        for m in group:
            starts.append(col)
            col += dims[m][1]
        m0 = MODULES.index(group[0])
        out.append((m0, m0 + len(group), tuple(starts), dims[group[0]][0]))
    return out


@dataclass
class Resident:
    """Adapters resident in a pool, with their dense weights kept for the expected values."""

    model: ModelConfig
    storage: torch.Tensor  # [layers, num_pages, page_size]
    tables: LoraTables
    weights: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]  # slot -> (A, B)
    scales: dict[int, dict[tuple[int, str], float]]
    pages: dict[int, list[int]]


def adapter_weights(model: ModelConfig, ranks: dict[str, int], gen: torch.Generator, dtype: torch.dtype):
    dims = model.module_dims()
    tensors, scales = {}, {}
    for layer in range(model.num_layers):
        for m, r in ranks.items():
            d_in, d_out = dims[m]
            a = torch.randn(r, d_in, generator=gen) / d_in**0.5
            b = torch.randn(d_out, r, generator=gen) / r**0.5
            tensors[(layer, m)] = (a.to(dtype), b.to(dtype))
            scales[(layer, m)] = 0.5 + float(torch.rand(1, generator=gen))
    return tensors, scales


def load_adapter(res: Resident, slot: int, ranks: dict[str, int], pages: list[int], gen: torch.Generator) -> None:
    """Pack an adapter into ``pages`` and point ``slot`` at it (what the adapter cache does)."""
    model, page_size = res.model, res.storage.shape[2]
    tensors, scales = adapter_weights(model, ranks, gen, res.storage.dtype)
    spec = AdapterSpec(
        path=None,
        weights_file=None,
        ranks={k: v[0].shape[0] for k, v in tensors.items()},
        scales=scales,
        target_modules=tuple(ranks),
        max_rank=max(ranks.values()),
        size_bytes=0,
    )
    layout = AdapterLayout.plan(spec, model, page_size)
    assert layout.num_pages <= len(pages), f"{layout.num_pages} pages needed, {len(pages)} given"
    packed = layout.pack(tensors, page_size).to(res.storage.device)
    used = pages[: layout.num_pages]
    res.storage[:, torch.tensor(used)] = packed.view(model.num_layers, layout.num_pages, page_size)
    res.tables.write_slot(slot, layout, used)
    res.weights[slot], res.scales[slot], res.pages[slot] = tensors, scales, used


def make_resident(
    model: ModelConfig,
    slot_ranks: list[dict[str, int]],
    dtype: torch.dtype,
    page_size: int,
    seed: int,
    kv_pages: int = 0,
) -> Resident:
    """Slots 1.. hold the given adapters; odd slots get scattered pages, even slots one run. The
    last ``kv_pages`` pages of the pool are left for KV blocks."""
    gen = torch.Generator().manual_seed(seed)
    dims = model.module_dims()
    need = [-(-sum(r * sum(dims[m]) for m, r in ranks.items()) // page_size) + 1 for ranks in slot_ranks]
    num_pages = 2 * sum(need) + 2 + kv_pages
    storage = torch.randn(model.num_layers, num_pages, page_size, generator=gen).to(dtype).to(DEVICE)
    tables = LoraTables(model, len(slot_ranks), max(need), DEVICE)
    res = Resident(model, storage, tables, {}, {}, {})
    run_start, scattered = 1, list(range(sum(need) + 1, num_pages - kv_pages))
    perm = torch.randperm(len(scattered), generator=gen).tolist()
    scattered = [scattered[i] for i in perm]
    for slot, (ranks, n) in enumerate(zip(slot_ranks, need), start=1):
        if slot % 2:
            pages, scattered = sorted(scattered[:n]), scattered[n:]
        else:
            pages, run_start = list(range(run_start, run_start + n)), run_start + n
        load_adapter(res, slot, ranks, pages, gen)
    return res


def expected_group(
    res: Resident, layer: int, group: int, x: torch.Tensor, y: torch.Tensor, token_slot: list[int]
) -> torch.Tensor:
    """``y + scale * x @ A.T @ B.T`` per module and token, in float64."""
    out = y.double().clone()
    dims = res.model.module_dims()
    col = 0
    for m in GROUPS[group]:
        width = dims[m][1]
        for t, slot in enumerate(token_slot):
            if slot and (layer, m) in res.weights[slot]:
                a, b = res.weights[slot][(layer, m)]
                delta = (x[t].double() @ a.double().t()) @ b.double().t()
                out[t, col : col + width] += res.scales[slot][(layer, m)] * delta
        col += width
    return out


def run_group(
    ops: tuple,
    res: Resident,
    layer: int,
    group: int,
    x: torch.Tensor,
    y: torch.Tensor,
    h: torch.Tensor,
    indices: LoraIndices,
) -> None:
    """One group's LoRA update, called as ``LlamaModel._lora`` calls it."""
    shrink, expand = ops
    m0, m1, out_start, _ = group_slices(res.model)[group]
    t = res.tables
    slab = res.storage[layer]
    shrink(h, x, slab, t.page_table, indices, t.a_offset[layer, :, group], t.a_rows[layer, :, group])
    expand(
        y,
        h,
        slab,
        t.page_table,
        indices,
        t.b_offset[layer, :, m0:m1],
        t.rank[layer, :, m0:m1],
        t.h_start[layer, :, m0:m1],
        t.scale[layer, :, m0:m1],
        out_start,
    )


def make_indices(token_slot: list[int], sgmv: bool) -> LoraIndices:
    segments, start = [], 0
    for i in range(1, len(token_slot) + 1):
        if i == len(token_slot) or token_slot[i] != token_slot[start]:
            if token_slot[start]:
                segments.append((start, i, token_slot[start]))
            start = i
    indices = LoraIndices(torch.tensor(token_slot, dtype=torch.int32, device=DEVICE), tuple(segments))
    return indices.with_segment_table() if sgmv else indices


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.cpu().double() - ref.cpu().double()).abs().max() / ref.cpu().double().abs().max())


def check_all_groups(res: Resident, token_slot: list[int], sgmv: bool, tol: float, seed: int) -> None:
    """Triton against the reference within ``tol``; the reference against float64 LoRA math
    within the rounding of the dtype (that the layout is read as the adapter was written)."""
    dense_tol = 1e-5 if res.storage.dtype == torch.float32 else 3e-2
    T = len(token_slot)
    indices = make_indices(token_slot, sgmv)
    dims = res.model.module_dims()
    gen = torch.Generator().manual_seed(seed)
    width = int(res.tables.a_rows.max()) + 3
    for layer in range(res.model.num_layers):
        for group, (m0, m1, _, d_in) in enumerate(group_slices(res.model)):
            n = sum(dims[m][1] for m in MODULES[m0:m1])
            x = torch.randn(T, d_in, generator=gen).to(res.storage.dtype).to(DEVICE)
            y0 = torch.randn(T, n, generator=gen).to(res.storage.dtype).to(DEVICE)
            expected = expected_group(res, layer, group, x.cpu(), y0.cpu(), token_slot)
            outs = []
            for ops in ((lora_shrink_ref, lora_expand_ref), (lora_shrink, lora_expand)):
                y = y0.clone()
                h = torch.full((T, width), float("nan"), dtype=x.dtype, device=DEVICE)
                run_group(ops, res, layer, group, x, y, h, indices)
                outs.append(y)
            where = f"layer {layer} group {group}"
            assert rel_err(outs[0], expected) < dense_tol, f"reference vs dense math, {where}"
            assert rel_err(outs[1], outs[0]) < tol, f"triton vs reference, {where}"


TINY_RANKS = [
    {"q_proj": 8, "k_proj": 1, "v_proj": 16, "o_proj": 64, "gate_proj": 8, "up_proj": 16, "down_proj": 1},
    {"q_proj": 16, "v_proj": 16},
    {"gate_proj": 64, "down_proj": 8},
    {m: 8 for m in MODULES},
]


@pytest.mark.parametrize("sgmv", [False, True], ids=["bgmv", "sgmv"])
def test_layout_tiny_float32(sgmv: bool) -> None:
    model = model_config(hidden=32, inter=48, heads=4, kv_heads=2, layers=1)
    res = make_resident(model, TINY_RANKS, torch.float32, page_size=96, seed=1)
    token_slot = [1, 2, 2, 3, 4, 0, 0] if not sgmv else [1, 1, 1, 2, 3, 3, 4, 4, 4, 0, 0]
    check_all_groups(res, token_slot, sgmv, tol=1e-5, seed=2)


# ----------------------------------------------------------------------------------- GPU, real size

LLAMA_7B = dict(hidden=4096, inter=11008, heads=32, kv_heads=32)
ALL_RANK_16 = {m: 16 for m in MODULES}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sgmv", [False, True], ids=["bgmv", "sgmv"])
def test_layout_llama7b_shapes(dtype: torch.dtype, sgmv: bool) -> None:
    """Hidden 4096, 32 rows, rank 16 on all modules, 32 distinct adapters (and some base rows)."""
    model = model_config(**LLAMA_7B, layers=1)
    res = make_resident(model, [ALL_RANK_16] * 24, dtype, page_size=16 * 4096, seed=3)
    token_slot = (
        [0] * 4 + list(range(1, 25)) + [24] * 4 if not sgmv else sorted([1] * 9 + [2] * 40 + [5] * 17 + [0] * 6)
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    check_all_groups(res, token_slot, sgmv, tol=tol, seed=4)


def capture(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` captured in a CUDA graph (after a warm-up run that compiles the kernels); its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def sync() -> None:
    torch.cuda.synchronize()


GRAPH_MODEL = dict(hidden=1024, inter=2816, heads=8, kv_heads=2, layers=2)


@pytest.mark.gpu
def test_graph_replay_after_adapter_swap() -> None:
    """Capture a decode step's LoRA + attention, swap adapters in the same pages, replay == eager."""
    model = model_config(**GRAPH_MODEL)
    head_dim, block_size, B = model.head_dim, 16, 32
    res = make_resident(
        model, [ALL_RANK_16] * 8, torch.bfloat16, page_size=2 * block_size * model.kv_size, seed=5, kv_pages=4 * B
    )
    dims = model.module_dims()
    token_slot = torch.tensor(sorted(i % 9 for i in range(B)), dtype=torch.int32, device=DEVICE)
    indices = LoraIndices(token_slot, ((0, B, 1),))  # BGMV reads token_slot only
    gen = torch.Generator().manual_seed(6)
    slices = group_slices(model)
    xs = [torch.randn(B, d_in, generator=gen).bfloat16().to(DEVICE) for _, _, _, d_in in slices]
    ys = [
        torch.empty(B, sum(dims[m][1] for m in MODULES[m0:m1]), dtype=torch.bfloat16, device=DEVICE)
        for m0, m1, _, _ in slices
    ]
    h = torch.zeros(B, 3 * 64, dtype=torch.bfloat16, device=DEVICE)
    kv_rows = torch.arange(res.storage.shape[1] - 4 * B, res.storage.shape[1]).view(B, 4)
    block_table = torch.zeros(B, 4, dtype=torch.int32, device=DEVICE)
    context_lens = torch.ones(B, dtype=torch.int32, device=DEVICE)
    slot_mapping = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    q = torch.randn(B, model.num_heads, head_dim, generator=gen).bfloat16().to(DEVICE)
    k = torch.randn(B, model.num_kv_heads, head_dim, generator=gen).bfloat16().to(DEVICE)
    attn_out = torch.empty_like(q)

    def step() -> None:
        for layer in range(model.num_layers):
            kv = res.storage[layer].view(-1, 2, block_size, model.num_kv_heads, head_dim)
            write_kv(kv, k, k, slot_mapping)
            paged_decode_attention(attn_out, q, kv, block_table, context_lens, head_dim**-0.5)
            for group in range(len(GROUPS)):
                ys[group].fill_(0.5)
                run_group((lora_shrink, lora_expand), res, layer, group, xs[group], ys[group], h, indices)

    def set_step(seed: int) -> None:
        """New block tables, lengths and slots for the KV rows, written into the same buffers."""
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, 4 * block_size, (B,), generator=g)
        rows = kv_rows[torch.randperm(B, generator=g)]
        block_table.copy_(rows.to(torch.int32))
        context_lens.copy_(lens.to(torch.int32))
        last = lens - 1
        slot_mapping.copy_(rows[torch.arange(B), last // block_size] * block_size + last % block_size)

    def outputs() -> list[torch.Tensor]:
        sync()
        return [y.clone() for y in ys] + [attn_out.clone()]

    set_step(0)
    replay = capture(step)
    replay()
    before = outputs()
    step()
    assert all(torch.equal(a, b) for a, b in zip(before, outputs())), "replay differs from eager"

    # Evict every adapter and load others, of other ranks and modules, into the same pages.
    gen = torch.Generator().manual_seed(7)
    for slot, pages in list(res.pages.items()):
        res.tables.clear_slot(slot)
        ranks = {m: 8 for m in MODULES} if slot % 2 else {m: 32 for m in MODULES[:4]}
        load_adapter(res, slot, ranks, pages, gen)
    set_step(1)
    replay()
    replayed = outputs()
    step()
    eager = outputs()
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager)), "replay after the swap differs from eager"
    assert not any(torch.equal(a, b) for a, b in zip(before, replayed)), "the swap left an output unchanged"
