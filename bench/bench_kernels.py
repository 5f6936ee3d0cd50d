"""The gathered LoRA update of one decode step against the base GEMMs it rides on.

A Llama-2-7B-shaped layer stack (32 layers, hidden 4096, intermediate 11008), decode batch 32,
rank 16, bf16, adapters resident in a unified page pool exactly as the engine lays them out. Every
figure is one CUDA-graph replay of the whole stack (what a decode step runs), best of a few trials:

* LoRA update (BGMV shrink + expand per targeted group and layer) with 32 distinct adapters vs
  all rows on 1 adapter, for attention-only (q, k, v, o) and all-module adapters;
* that time as a fraction of the base GEMMs of the stack (all seven projections);
* bytes the 32-adapter update must move, per second, against the device's copy bandwidth;
* paged prefill attention of one layer (bf16, two whole prompts and two chunks after cached
  prefixes, pages scattered over the pool): the Triton kernel against the PyTorch reference it
  replaced, eager calls (the launcher builds its tile table on the host; graphs capture decode
  steps only), with the kernel's error against the reference.

    .venv/bin/python bench/bench_kernels.py [--sweep]    # CUDA; --sweep also times other BGMV tiles
    .venv/bin/python bench/bench_kernels.py --tiny       # any machine: tiny shapes (Triton interpreter
                                                         # without CUDA), checks the script itself

Prints a table, then, as its last line, one JSON object with the figures and the targets.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from harness import machine_info, machine_line, print_json

from lorapage.adapters.layout import AdapterLayout
from lorapage.adapters.peft_format import AdapterSpec
from lorapage.kernels import LoraIndices
from lorapage.memory.pages import PageKind
from lorapage.memory.pool import PagePool
from lorapage.model.config import GROUPS, MODULES, ModelConfig
from lorapage.model.lora_tables import LoraTables

SHAPES = {
    "llama2-7b": dict(hidden=4096, inter=11008, heads=32, layers=32, batch=32, rank=16, max_rank=64, block_size=16),
    "tiny": dict(hidden=64, inter=96, heads=4, layers=1, batch=4, rank=4, max_rank=8, block_size=4),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGET_RATIO, TARGET_ATTENTION, TARGET_ALL = 1.2, 0.10, 0.25
TARGET_PREFILL_ERR = 1e-2  # bf16 prefill attention against the reference, relative to its largest entry
PREFILL = {  # (new tokens, context length) of each sequence of one prefill step
    "llama2-7b": ((1024, 1024), (1024, 1024), (512, 2048), (512, 3072)),
    "tiny": ((8, 8), (3, 11)),
}
SWEEP_SHRINK = [(2, 4096), (4, 2048), (8, 1024), (16, 512)]
SWEEP_EXPAND_N = [128, 256, 512]


def model_config(s: dict) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        num_kv_heads=s["heads"],
        head_dim=s["hidden"] // s["heads"],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


@dataclass
class Stack:
    """A pool holding two adapter sets (all-module in slots 1..n, attention-only in n+1..2n)."""

    model: ModelConfig
    pool: PagePool
    tables: LoraTables
    bytes_per_adapter: dict[str, int]  # adapter weight bytes over all layers, per set


def build_stack(model: ModelConfig, num_adapters: int, rank: int, page_size: int, device: torch.device) -> Stack:
    layouts, sizes = {}, {}
    dims = model.module_dims()
    for name, modules in (("all", MODULES), ("attention", ATTENTION)):
        ranks = {(layer, m): rank for layer in range(model.num_layers) for m in modules}
        spec = AdapterSpec(
            path=None,
            weights_file=None,
            ranks=ranks,
            scales={k: 2.0 for k in ranks},
            target_modules=modules,
            max_rank=rank,
            size_bytes=0,
        )
        layouts[name] = AdapterLayout.plan(spec, model, page_size)
        sizes[name] = 2 * model.num_layers * sum(rank * sum(dims[m]) for m in modules)
    num_pages = 2 + num_adapters * sum(lay.num_pages for lay in layouts.values())
    pool = PagePool(model.num_layers, num_pages, page_size, torch.bfloat16, device)
    pool.storage.normal_(0.0, 0.02)
    max_pages = max(lay.num_pages for lay in layouts.values())
    tables = LoraTables(model, 2 * num_adapters, max_pages, device)
    for i in range(num_adapters):
        for offset, name in ((1, "all"), (1 + num_adapters, "attention")):
            pages = pool.allocate(layouts[name].num_pages, PageKind.ADAPTER)
            tables.write_slot(offset + i, layouts[name], pages)
    return Stack(model, pool, tables, sizes)


def lora_update(
    stack: Stack,
    ops: tuple[Callable, Callable],
    groups: list[int],
    slots: list[int],
    max_rank: int,
    device: torch.device,
) -> Callable[[], None]:
    """One decode step's LoRA updates over the whole stack, with every argument prepared up front."""
    shrink, expand = ops
    model, t = stack.model, stack.tables
    dims = model.module_dims()
    B = len(slots)
    indices = LoraIndices(torch.tensor(slots, dtype=torch.int32, device=device), ((0, B, slots[0]),))
    h = torch.zeros(B, 3 * max_rank, dtype=torch.bfloat16, device=device)
    calls = []
    for g in groups:
        group = GROUPS[g]
        m0, m1 = MODULES.index(group[0]), MODULES.index(group[-1]) + 1
        starts = tuple(sum(dims[m][1] for m in group[:i]) for i in range(len(group)))
        x = torch.randn(B, dims[group[0]][0], dtype=torch.bfloat16, device=device)
        y = torch.zeros(B, sum(dims[m][1] for m in group), dtype=torch.bfloat16, device=device)
        for layer in range(model.num_layers):
            slab = stack.pool.storage[layer]
            calls.append(
                (
                    (h, x, slab, t.page_table, indices, t.a_offset[layer, :, g], t.a_rows[layer, :, g]),
                    (
                        y,
                        h,
                        slab,
                        t.page_table,
                        indices,
                        t.b_offset[layer, :, m0:m1],
                        t.rank[layer, :, m0:m1],
                        t.h_start[layer, :, m0:m1],
                        t.scale[layer, :, m0:m1],
                        starts,
                    ),
                )
            )

    def run() -> None:
        for shrink_args, expand_args in calls:
            shrink(*shrink_args)
            expand(*expand_args)

    return run


def base_gemms(model: ModelConfig, batch: int, device: torch.device) -> Callable[[], None]:
    """The seven projections of every layer for one decode step (four fused GEMMs per layer)."""
    h, i, q, kv = model.hidden_size, model.intermediate_size, model.q_size, model.kv_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    weights = [
        [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for n, k in shapes]
        for _ in range(model.num_layers)
    ]
    xs = [torch.randn(batch, k, dtype=torch.bfloat16, device=device) for _, k in shapes]
    outs = [torch.empty(batch, n, dtype=torch.bfloat16, device=device) for n, _ in shapes]

    def run() -> None:
        for layer in weights:
            for w, x, out in zip(layer, xs, outs):
                torch.mm(x, w.t(), out=out)

    return run


def seconds(fn: Callable[[], None], device: torch.device, reps: int, trials: int, graph: bool = True) -> float:
    """Best-of-trials time per call: a CUDA-graph replay on CUDA (an eager call when not ``graph``),
    a plain call elsewhere."""
    if device.type != "cuda":
        best = float("inf")
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - start) / reps)
        return best
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile, warm up
        torch.cuda.current_stream().wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
    else:
        run = fn
    run()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def copy_bandwidth(device: torch.device, numel: int, trials: int) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = seconds(lambda: dst.copy_(src), device, reps=5, trials=trials)
    return 2 * src.numel() * src.element_size() / t


def activation_bytes(model: ModelConfig, groups: list[int], batch: int, rank: int) -> int:
    """x read, h written and read, y read and written, per step, bf16."""
    dims = model.module_dims()
    total = 0
    for g in groups:
        group = GROUPS[g]
        d_in, n = dims[group[0]][0], sum(dims[m][1] for m in group)
        total += batch * (d_in + 2 * rank * len(group) + 2 * n)
    return 2 * total * model.num_layers


def prefill_attention_case(shape_name: str, device: torch.device, reps: int, trials: int) -> dict[str, float]:
    """One layer's prefill attention, Triton vs the PyTorch reference; the Triton output's error."""
    from lorapage.kernels import attention_triton, prefill_attention_ref

    s = SHAPES[shape_name]
    heads, dim, block_size = s["heads"], s["hidden"] // s["heads"], s["block_size"]
    chunks, lens = zip(*PREFILL[shape_name])
    gen = torch.Generator().manual_seed(0)
    need = [-(-n // block_size) for n in lens]
    pages = (torch.randperm(sum(need), generator=gen) + 1).to(torch.int32)  # scattered, page 0 unused
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n], pages = pages[:n], pages[n:]
    table = table.to(device)
    kv = torch.randn(1 + sum(need), 2, block_size, heads, dim, generator=gen).to(torch.bfloat16).to(device)
    starts = [sum(chunks[:i]) for i in range(len(chunks) + 1)]
    q = torch.randn(starts[-1], heads, dim, generator=gen).to(torch.bfloat16).to(device)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    args = (q, kv, table, starts, list(lens), dim**-0.5)
    triton_s = seconds(lambda: attention_triton.prefill_attention(out, *args), device, reps, trials, graph=False)
    ref_s = seconds(lambda: prefill_attention_ref(ref, *args), device, reps, trials, graph=False)
    # Causal: query j of a chunk of n over context c sees c - n + j + 1 positions; 4 flops per
    # position and head dimension (q . k and p * v).
    visible = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(chunks, lens))
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    return {
        "prefill_attention_triton_us": round(triton_s * 1e6, 1),
        "prefill_attention_ref_us": round(ref_s * 1e6, 1),
        "prefill_attention_speedup": round(ref_s / triton_s, 3),
        "prefill_attention_tflops": round(4 * heads * dim * visible / triton_s / 1e12, 2),
        "prefill_attention_rel_err": err,
        "prefill_attention_tokens": starts[-1],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script on any machine")
    parser.add_argument("--sweep", action="store_true", help="also time other BGMV tile sizes")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES["tiny" if args.tiny or device.type != "cuda" else "llama2-7b"]
    reps, trials = (1, 1) if device.type != "cuda" else (20, 5)  # the interpreter is slow: one call

    from lorapage.kernels import lora_triton

    ops = (lora_triton.lora_shrink, lora_triton.lora_expand)
    model = model_config(shape)
    B, rank, max_rank = shape["batch"], shape["rank"], shape["max_rank"]
    page_size = 2 * shape["block_size"] * model.kv_size  # one KV block of one layer per page
    stack = build_stack(model, B, rank, page_size, device)
    groups = {"attention": [0, 1], "all": [0, 1, 2, 3]}
    first = {"all": 1, "attention": 1 + B}
    times = {"base": seconds(base_gemms(model, B, device), device, reps, trials)}
    for name, gs in groups.items():
        distinct = [first[name] + i for i in range(B)]
        times[f"{name}_distinct"] = seconds(
            lora_update(stack, ops, gs, distinct, max_rank, device), device, reps, trials
        )
        times[f"{name}_one"] = seconds(
            lora_update(stack, ops, gs, [first[name]] * B, max_rank, device), device, reps, trials
        )
    copy_bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 20, trials)
    moved = B * stack.bytes_per_adapter["all"] + activation_bytes(model, groups["all"], B, rank)
    achieved = moved / times["all_distinct"]

    sweep = []
    if args.sweep:
        default_tile, default_n = lora_triton.BGMV_SHRINK_TILE, lora_triton.BGMV_EXPAND_BLOCK_N
        distinct = [first["all"] + i for i in range(B)]
        for tile in SWEEP_SHRINK:
            for block_n in SWEEP_EXPAND_N if tile == default_tile else [default_n]:
                lora_triton.BGMV_SHRINK_TILE, lora_triton.BGMV_EXPAND_BLOCK_N = tile, block_n
                t = seconds(lora_update(stack, ops, groups["all"], distinct, max_rank, device), device, reps, trials)
                sweep.append({"shrink_tile": list(tile), "expand_block_n": block_n, "us": round(t * 1e6, 1)})
        lora_triton.BGMV_SHRINK_TILE, lora_triton.BGMV_EXPAND_BLOCK_N = default_tile, default_n

    prefill = prefill_attention_case("tiny" if shape is SHAPES["tiny"] else "llama2-7b", device, reps, trials)

    ratio_all = times["all_distinct"] / times["all_one"]
    ratio_attn = times["attention_distinct"] / times["attention_one"]
    frac_attn = times["attention_distinct"] / times["base"]
    frac_all = times["all_distinct"] / times["base"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    us = {k: v * 1e6 for k, v in times.items()}
    how = "graph replays" if device.type == "cuda" else "calls, no warm-up"
    print(machine_line())
    print(
        f"LoRA update vs base GEMMs on {name}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"batch {B}, rank {rank}, bf16, best of {trials} x {reps} {how}"
    )
    print(f"{'case':<34} {'us/step':>10} {'of base':>8} {'target':>8}")
    print(f"{'base GEMMs, 7 projections':<34} {us['base']:>10.1f}")
    for label, key, target in (
        ("LoRA attention, 32 distinct", "attention_distinct", f"<= {TARGET_ATTENTION:.0%}"),
        ("LoRA attention, 1 adapter", "attention_one", ""),
        ("LoRA all modules, 32 distinct", "all_distinct", f"<= {TARGET_ALL:.0%}"),
        ("LoRA all modules, 1 adapter", "all_one", ""),
    ):
        label = label.replace("32", str(B))
        print(f"{label:<34} {us[key]:>10.1f} {us[key] / us['base']:>8.1%} {target:>8}")
    print(f"{'distinct / 1 adapter, all modules':<34} {ratio_all:>10.2f} {'':>8} {'<= ' + str(TARGET_RATIO):>8}")
    print(f"{'distinct / 1 adapter, attention':<34} {ratio_attn:>10.2f} {'':>8} {'<= ' + str(TARGET_RATIO):>8}")
    print(
        f"{'bytes/s, all modules, distinct':<34} {achieved / 1e12:>9.2f}T {achieved / copy_bw:>8.1%} of copy {copy_bw / 1e12:.2f} TB/s"
    )
    print(
        f"{'prefill attention, ' + str(prefill['prefill_attention_tokens']) + ' tokens':<34} "
        f"{prefill['prefill_attention_triton_us']:>10.1f} Triton vs {prefill['prefill_attention_ref_us']:.1f} PyTorch "
        f"({prefill['prefill_attention_speedup']:.2f}x, {prefill['prefill_attention_tflops']:.1f} TFLOP/s, "
        f"rel err {prefill['prefill_attention_rel_err']:.1e})"
    )
    for row in sweep:
        print(
            f"  sweep: shrink tile {tuple(row['shrink_tile'])}, expand block_n {row['expand_block_n']}: {row['us']:.1f} us"
        )
    result = {
        "bench": "kernels",
        "device": name,
        "shape": "tiny" if shape is SHAPES["tiny"] else "llama2-7b",
        "layers": model.num_layers,
        "batch": B,
        "rank": rank,
        "base_gemm_us": round(us["base"], 1),
        "lora_attention_distinct_us": round(us["attention_distinct"], 1),
        "lora_attention_one_us": round(us["attention_one"], 1),
        "lora_all_distinct_us": round(us["all_distinct"], 1),
        "lora_all_one_us": round(us["all_one"], 1),
        "ratio_distinct_vs_one_all": round(ratio_all, 3),
        "ratio_distinct_vs_one_attention": round(ratio_attn, 3),
        "fraction_of_base_attention": round(frac_attn, 4),
        "fraction_of_base_all": round(frac_all, 4),
        "achieved_bytes_per_s": round(achieved),
        "copy_bytes_per_s": round(copy_bw),
        "fraction_of_copy_bandwidth": round(achieved / copy_bw, 4),
        "target_ratio": TARGET_RATIO,
        "target_fraction_attention": TARGET_ATTENTION,
        "target_fraction_all": TARGET_ALL,
        **prefill,
        "target_prefill_rel_err": TARGET_PREFILL_ERR,
        "pass": ratio_all <= TARGET_RATIO
        and frac_attn <= TARGET_ATTENTION
        and frac_all <= TARGET_ALL
        and prefill["prefill_attention_rel_err"] <= TARGET_PREFILL_ERR,
        "sweep": sweep,
        **machine_info(),
    }
    print_json(result)
    return result


if __name__ == "__main__":
    main()
