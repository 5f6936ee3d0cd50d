"""A worker rank's process: builds its shard of the model, pool and tables, then applies rank 0's
messages in order (a step's forward, an adapter's pages) until told to stop or its pipe closes."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

import torch

from lorapage.adapters.loader import write_adapter_pages
from lorapage.kernels.backend import select_backend
from lorapage.memory.pool import PagePool
from lorapage.model.config import ModelConfig
from lorapage.model.cuda_graphs import DecodeGraphs, cuda_graph_capture, rerun_capture
from lorapage.model.gemma import GemmaModel
from lorapage.model.llama import LlamaModel
from lorapage.model.loader import load_state_dict
from lorapage.model.lora_tables import LoraTables
from lorapage.model.quantized_ops import quantized_ops
from lorapage.model.runner import ModelRunner
from lorapage.parallel.shards import shard_base, shard_config
from lorapage.parallel.wire import (
    CAPTURED,
    STOP,
    CaptureMessage,
    PagesMessage,
    StepMessage,
    WorkerSpec,
    process_group,
    rank_comm,
    unguarded,
)

log = logging.getLogger("lorapage.parallel")


def build_rank(spec: WorkerSpec) -> tuple[ModelRunner, PagePool, LoraTables]:
    """This rank's model shard, pool and lookup tables, the same shapes rank 0 made its own in."""
    device = torch.device(spec.device)
    whole = ModelConfig.from_dir(spec.model_dir)
    mc = shard_config(whole, spec.world_size)
    state = shard_base(load_state_dict(spec.model_dir, spec.dtype), spec.rank, spec.world_size, whole)
    family = GemmaModel if mc.gemma is not None else LlamaModel
    model = family(mc, state, device, spec.dtype, spec.max_model_len)
    pool = PagePool(mc.num_layers, spec.num_pages, spec.page_size, spec.dtype, device, spec.lora_dtype)
    tables = LoraTables(mc, spec.lora_slots, spec.page_list_width, device)
    ops = quantized_ops(
        select_backend(spec.kernel_backend, device, spec.dtype), spec.quantization, device, mc, spec.quantize_lm_head
    )
    runner = ModelRunner(
        model,
        pool,
        tables,
        ops,
        spec.block_size,
        spec.max_num_seqs,
        spec.max_num_batched_tokens,
        spec.max_blocks,
        spec.lora_h_width,
    )
    return runner, pool, tables


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """The worker's main: join the group, build, say ready, then serve rank 0's messages."""
    torch.set_num_threads(spec.threads)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    conn.send("joining")
    group = process_group(spec)
    try:
        runner, pool, tables = build_rank(spec)
        runner.ctx.model.comm = rank_comm(group, spec.rank, spec.world_size, unguarded)
    except Exception as exc:  # rank 0 reports it: the engine does not start
        conn.send(f"rank {spec.rank} failed to start: {exc!r}")
        # Stay until rank 0 has read why (its STOP, or its end of the pipe closing): exiting at once
        # can close this rank's sockets while rank 0 is still connecting its side of the group,
        # and rank 0 would then see gloo's "connection closed by peer" instead of the reason.
        if conn.poll(spec.timeout_s):
            try:
                conn.recv()
            except EOFError:
                pass
        return
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if isinstance(msg, StepMessage):
            hidden = runner.forward_hidden(msg.inputs)
            if msg.inputs.logits_rows:  # rank 0's logits of these rows gather this rank's vocabulary share
                with torch.inference_mode():
                    runner.ctx.model.head(hidden[torch.tensor(msg.inputs.logits_rows, device=hidden.device)])
        elif isinstance(msg, CaptureMessage):
            if not capture_graphs(runner, msg, conn, spec):
                return
        elif isinstance(msg, PagesMessage):
            write_adapter_pages(pool, tables, msg.layout, msg.packed, msg.slot, msg.pages)
        elif msg == STOP:
            return


def capture_graphs(runner: ModelRunner, msg: CaptureMessage, conn: Connection, spec: WorkerSpec) -> bool:
    """Capture ``msg.sizes`` beside rank 0 and answer; False (the worker then exits) when it failed.
    CUDA graphs on CUDA; on a CPU, where there are none (the engine never asks there), the eager
    stand-in, whose capture and replays run the same collectives a graph's would."""
    try:
        if spec.device.startswith("cuda"):
            with torch.cuda.device(torch.device(spec.device)):
                runner.graphs = DecodeGraphs(runner.ctx, msg.sizes, cuda_graph_capture())
        else:
            runner.graphs = DecodeGraphs(runner.ctx, msg.sizes, rerun_capture)
    except Exception as exc:  # rank 0 raises it from the engine's start
        conn.send(f"rank {spec.rank} failed to capture CUDA graphs of {list(msg.sizes)} rows: {exc!r}")
        return False
    conn.send(CAPTURED)
    return True
